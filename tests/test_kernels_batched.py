# SPDX-License-Identifier: Apache-2.0
"""The batched eviction operations: the torch reference against a per-row loop over the policies'
own code (the specification), and the Triton kernels against the reference, under
``TRITON_INTERPRET=1`` on CPU (on a GPU, natively): small ragged row sets, several block sizes,
GQA-sized head counts, fp32/bf16. Kept indices must match exactly; values within dtype tolerance.
"""

from __future__ import annotations

import os

import pytest
import torch

from vllm_kvevict.kernels import torch_ops as ref
from vllm_kvevict.kernels.ops import FUSED
from vllm_kvevict.policies.base import KVView, topk_newer
from vllm_kvevict.policies.keydiff import KeyDiff

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def paged_case(seed: int, bs: int, H: int, D: int, lens: list[int], dtype=torch.float32, starts=None):
    """A FlashAttention-layout cache with random blocks per row, and the rows' windows."""
    g = torch.Generator().manual_seed(seed)
    ends = torch.tensor([s + n for s, n in zip(starts or [0] * len(lens), lens)])
    starts = torch.tensor(starts or [0] * len(lens))
    max_blocks = int((ends.max() + bs - 1) // bs) + 1
    nb = len(lens) * max_blocks + 3
    perm = torch.randperm(nb - 1, generator=g) + 1  # block 0 is vLLM's null block
    bt = perm[: len(lens) * max_blocks].reshape(len(lens), max_blocks).to(torch.int32)
    bt = torch.cat([torch.zeros(2, max_blocks, dtype=torch.int32), bt])  # rows 2.. are ours: rows != r
    rows = torch.arange(len(lens), dtype=torch.int32) + 2
    cache = torch.randn(nb, H, bs, 2 * D, generator=g).to(dtype)  # vLLM's [nb, H, bs, 2D]
    k_cache, v_cache = cache.transpose(1, 2).split(D, dim=-1)  # FlashAttention views [nb, bs, H, D]
    return [x.to(DEV) for x in (cache, k_cache, v_cache, bt, rows, starts, ends)]


def per_row_loop(K, pos, cu, keep):
    """The specification: the policy's own scoring and selection, one row at a time."""
    out = []
    for r in range(cu.numel() - 1):
        a, b = int(cu[r]), int(cu[r + 1])
        view = KVView(K=K[a:b].transpose(0, 1), V=K[a:b].transpose(0, 1), pos=pos[a:b].transpose(0, 1))
        s = KeyDiff().score(view)
        out.append(topk_newer(s, int(keep[r]), view.pos).transpose(0, 1))
    return torch.cat(out)


CASES = [  # (block size, H, D, row lengths, window starts)
    (32, 2, 64, [40, 1, 100], [0, 32, 64]),
    (16, 3, 64, [17, 64, 33, 5], None),
    (64, 1, 128, [130], [64]),
    (32, 8, 64, [0, 70], [0, 96]),  # an empty row
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reference_matches_policy_loop(case):
    bs, H, D, lens, starts = CASES[case]
    cache, kc, vc, bt, rows, st, en = paged_case(case, bs, H, D, lens, starts=starts)
    K, V, cu = ref.gather_paged(kc, vc, bt, rows, st, en)
    for r in range(len(lens)):  # the gather reads exactly those tokens
        b = bt[rows[r]].long()
        for j, tok in enumerate(range(int(st[r]), int(en[r]))):
            assert torch.equal(K[int(cu[r]) + j], kc[b[tok // bs], tok % bs])
            assert torch.equal(V[int(cu[r]) + j], vc[b[tok // bs], tok % bs])
    pos = (torch.arange(K.shape[0], device=DEV)[:, None] * 7 % 1000).expand(-1, H).contiguous()
    keep = torch.tensor([max(1, n // 3) for n in lens], device=DEV)
    scores = FUSED["keydiff_scores"](K, cu)
    idx, cu_keep = ref.select_topk(scores, pos, cu, keep)
    assert torch.equal(idx, per_row_loop(K, pos, cu, torch.minimum(keep, cu[1:] - cu[:-1])))
    for r in range(len(lens)):  # one row alone (its own code path) selects the same
        a, b, ka, kb = int(cu[r]), int(cu[r + 1]), int(cu_keep[r]), int(cu_keep[r + 1])
        one, _ = ref.select_topk(scores[a:b], pos[a:b], torch.tensor([0, b - a], device=DEV), keep[r : r + 1])
        assert torch.equal(one, idx[ka:kb])


def test_select_ties_go_to_the_newer_token_and_keep_whole_rows():
    scores = torch.tensor([[1.0], [2.0], [2.0], [0.0], [-0.0], [0.0], [5.0]])
    pos = torch.tensor([[10], [3], [7], [1], [2], [0], [9]])
    cu = torch.tensor([0, 3, 6, 7])
    idx, cu_keep = ref.select_topk(scores, pos, cu, torch.tensor([2, 1, 4]))
    assert cu_keep.tolist() == [0, 2, 3, 4]
    # row 0: 2.0@3 and 2.0@7 beat 1.0; row 1: 0.0 = -0.0 = 0.0, the newest (pos 2) wins; row 2: whole row
    assert idx[:, 0].tolist() == [1, 2, 1, 0]


def test_scatter_right_aligns_per_head():
    cache, kc, vc, bt, rows, st, en = paged_case(5, 32, 2, 64, [70, 40], starts=[32, 0])
    K, V, cu = ref.gather_paged(kc, vc, bt, rows, st, en)
    idx = torch.tensor([[0, 5], [3, 6], [69, 7], [1, 0], [39, 39]], device=DEV)
    cu_keep = torch.tensor([0, 3, 5], device=DEV)
    dst_start = en - torch.tensor([3, 2], device=DEV)
    ref.scatter_paged(kc, K, idx, cu, cu_keep, bt, rows, dst_start)
    for r, (c0, c1) in enumerate(((0, 3), (3, 5))):
        for j in range(c1 - c0):
            tok = int(dst_start[r]) + j
            blk = bt[rows[r], tok // 32].long()
            for h in range(2):
                assert torch.equal(kc[blk, tok % 32, h], K[int(cu[r]) + int(idx[c0 + j, h]), h])


# -- Triton against the reference ------------------------------------------------------------------

TRITON_CASES = CASES + [(32, 4, 64, [300, 3], [32, 0])]  # rows longer than one tile


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(TRITON_CASES)))
def test_triton_gather_scores_select_scatter(tri, case, dtype):
    bs, H, D, lens, starts = TRITON_CASES[case]
    cache, kc, vc, bt, rows, st, en = paged_case(100 + case, bs, H, D, lens, dtype=dtype, starts=starts)
    K, V, cu = ref.gather_paged(kc, vc, bt, rows, st, en)
    K2, V2, cu2 = tri.gather_paged(kc, vc, bt, rows, st, en)
    assert torch.equal(cu, cu2) and torch.equal(K, K2) and torch.equal(V, V2)  # a copy: bit-exact

    s = FUSED["keydiff_scores"](K, cu)
    torch.testing.assert_close(tri.keydiff_scores(K, cu), s, atol=1e-5, rtol=1e-5)
    # the keys read in place, through their blocks: the same reads as from the gathered copy
    blocks, offs, _ = ref.logical_tokens(bt, rows, st, en, bs)
    assert torch.equal(tri.keydiff_scores_paged(ref.PagedKeys(kc, blocks, offs), cu), tri.keydiff_scores(K, cu))
    # some tokens of each head copied out of the cache: the gathered copy's
    pos = torch.randperm(max(1, K.shape[0] * H), generator=torch.Generator().manual_seed(case))[: K.shape[0] * H]
    pos = pos.reshape(K.shape[0], H).to(DEV)
    pcache = torch.full(kc.shape[:3], -1, dtype=torch.int32, device=DEV)  # slot positions, as the engine's
    pcache[blocks, offs] = pos.to(torch.int32)
    paged_pos = ref.PagedKeys(pcache, blocks, offs)
    g = torch.Generator().manual_seed(case)
    some = torch.randint(0, max(1, K.shape[0]), (K.shape[0] // 2 + 1, H), generator=g).to(DEV) if K.shape[0] else None
    if some is not None:
        h = torch.arange(H, device=DEV)
        cols = (torch.randn(K.shape[0], H).to(DEV), torch.arange(K.shape[0] * H).view(-1, H).to(DEV), -pos.float())
        for take in (ref.take_paged, tri.take_paged):
            Kt, Vt, pt = take(kc, vc, pcache, blocks, offs, some)
            assert torch.equal(Kt, K[some, h]) and torch.equal(Vt, V[some, h]) and torch.equal(pt, pos[some, h])
            # packed [N, H] columns taken with them (scores, per-slot state): two in the launch, the rest after
            for n in range(len(cols) + 1):
                got = take(kc, vc, pcache, blocks, offs, some, cols[:n])
                assert len(got) == 3 + n and all(torch.equal(g, c[some, h]) for g, c in zip(got[3:], cols))
    s = s.round(decimals=2)  # many exact ties: the tie rule decides
    keep = torch.tensor([max(1, n // 2) for n in lens], device=DEV)
    idx, cu_keep = ref.select_topk(s, pos, cu, keep)
    idx2, cu_keep2 = tri.select_topk(s, pos, cu, keep)
    assert torch.equal(cu_keep, cu_keep2) and torch.equal(idx, idx2)
    # the same selection as indices into the packed tokens, shifted
    packed = idx + cu[:-1].repeat_interleave(cu_keep.diff())[:, None] + 5
    for select in (ref.select_topk, tri.select_topk):
        assert torch.equal(select(s, pos, cu, keep, packed_offset=5)[0], packed)
        assert torch.equal(select(s, paged_pos, cu, keep)[0], idx)  # positions read where they are
    # and with the tokens each row drops: every packed token not kept, row after row, ascending per head
    every = set(range(5, K.shape[0] + 5))
    dropped = [torch.tensor(sorted(every - set(packed[:, j].tolist())), dtype=torch.long) for j in range(H)]
    dropped = torch.stack(dropped, 1).to(DEV)
    # a selection that marks its winners (+inf in another score, CriticalKV's stage 1) instead of listing them
    target = torch.randn(s.shape).to(DEV)
    want = target.clone().scatter_(0, packed - 5, float("inf"))
    for mod in (ref, tri):
        for t in (target.clone(), target.clone().T.contiguous().T):  # contiguous or not
            assert mod.promote_topk(t, s, paged_pos, cu, keep) is t and torch.equal(t, want), mod.__name__
    for split in (ref.select_split, tri.select_split):
        for p in (pos, paged_pos):
            kept, gone = split(s, p, cu, keep, packed_offset=5)
            assert torch.equal(kept, packed) and torch.equal(gone, dropped), split.__module__

    dst_start = en - (cu_keep[1:] - cu_keep[:-1])
    for name, dst in (("k", kc), ("v", vc)):
        want = dst.clone()
        got = dst.clone()
        src = K if name == "k" else V
        ref.scatter_paged(want, src, idx, cu, cu_keep, bt, rows, dst_start)
        tri.scatter_paged(got, src, idx, cu, cu_keep, bt, rows, dst_start)
        assert torch.equal(want, got)
    # K, V and positions in one write, every index into the packed tokens: the three scatters'
    glob, zero = packed - 5, torch.zeros_like(cu)
    want = [x.clone() for x in (kc, vc, pcache)]
    for dst, src in zip(want, (K, V, pos)):
        ref.scatter_paged(dst, src, glob, zero, cu_keep, bt, rows, dst_start)
    for mod in (ref, tri):
        got = [x.clone() for x in (kc, vc, pcache)]
        mod.scatter_kv_paged(*got, (K, V, pos), glob, glob, cu_keep, bt, rows, dst_start)
        assert all(torch.equal(w, x) for w, x in zip(want, got)), mod.__name__
    # with a per-slot state written to one or two stores (the live state and its windows' snapshot),
    # K and V copied out first (the in-place step: identity indices for them, the state's its own)
    h = torch.arange(H, device=DEV)
    taken, ident = (K[glob, h], V[glob, h]), torch.arange(glob.shape[0], device=DEV)[:, None].expand_as(glob)
    st, base = torch.randn(K.shape[0], H).to(DEV), torch.randn(kc.shape[0], bs, H).to(DEV)
    want_st = base.clone()
    ref.scatter_paged(want_st, st, glob, zero, cu_keep, bt, rows, dst_start)
    for mod, n in ((ref, 1), (ref, 2), (tri, 1), (tri, 2)):
        got, stores = [x.clone() for x in (kc, vc, pcache)], tuple(base.clone() for _ in range(n))
        state = ref.StateWrite(st, glob, stores)
        mod.scatter_kv_paged(*got, (*taken, pos), ident, glob, cu_keep, bt, rows, dst_start, state)
        assert all(torch.equal(w, x) for w, x in zip(want, got)), mod.__name__
        assert all(torch.equal(x, want_st) for x in stores), (mod.__name__, n)
    state = torch.randn(kc.shape[0] * bs, H).to(DEV)  # a per-slot state [slots, H], moved the same way
    want, got = state.clone(), state.clone()
    ref.scatter_paged(want.view(-1, bs, H), s, idx, cu, cu_keep, bt, rows, dst_start)
    tri.scatter_paged(got.view(-1, bs, H), s, idx, cu, cu_keep, bt, rows, dst_start)
    assert torch.equal(want, got)


@pytest.mark.parametrize(
    "lens,H,D",
    [
        ([3000, 0, 1, 2, 1500, 37], 2, 64),  # 3 chunks per row: rows shorter than that, empty rows
        ([70_000, 5], 1, 16),  # more than 32 chunks' worth: 32, longer ones
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_keydiff_splits_long_rows(tri, lens, H, D, dtype):
    """Sets of more than 2048 tokens score every row in chunks (at most 32), the anchor summed over
    the chunks' partial sums: the statement's scores."""
    cu = ref.cu_from_lengths(torch.tensor(lens))
    g = torch.Generator().manual_seed(len(lens))
    K = (torch.randn(int(cu[-1]), H, D, generator=g) + 0.3).to(dtype).to(DEV)  # a common direction
    cu = cu.to(DEV)
    torch.testing.assert_close(tri.keydiff_scores(K, cu), FUSED["keydiff_scores"](K, cu), atol=1e-5, rtol=1e-5)


def test_triton_select_extreme_scores(tri):
    scores = torch.tensor([[float("inf")], [-1e30], [float("-inf")], [3.0], [float("inf")], [-0.0], [0.0]])
    pos = torch.tensor([[0], [1], [2], [3], [4], [5], [6]])
    cu = torch.tensor([0, 7])
    for keep in range(1, 8):
        a = ref.select_topk(scores.to(DEV), pos.to(DEV), cu.to(DEV), torch.tensor([keep]))
        b = tri.select_topk(scores.to(DEV), pos.to(DEV), cu.to(DEV), torch.tensor([keep]))
        assert torch.equal(a[0], b[0]), keep


def test_triton_select_a_row_that_keeps_nothing(tri):
    """A row with a keep of 0 in a batch (CriticalKV's stage 1 for its rows that only observe in a
    step) yields no indices; the others theirs, as each selected alone."""
    g = torch.Generator().manual_seed(3)
    scores, pos = torch.rand(30, 2, generator=g).to(DEV), torch.arange(30)[:, None].expand(30, 2).contiguous().to(DEV)
    cu, keep = torch.tensor([0, 10, 22, 30], device=DEV), torch.tensor([3, 0, 2])
    want = torch.cat([topk_newer(scores[a:b].T, int(k), pos[a:b].T).T + a for a, b, k in ((0, 10, 3), (22, 30, 2))])
    for mod in (ref, tri):
        idx, cu_keep = mod.select_topk(scores, pos, cu, keep)
        assert cu_keep.tolist() == [0, 3, 3, 5]
        assert torch.equal(idx + torch.tensor([0, 0, 0, 22, 22], device=DEV)[:, None], want), mod.__name__


@pytest.mark.parametrize("H", [1, 3, 8])
@pytest.mark.parametrize("states", [0, 1, 2])
def test_record_slots_in_one_kernel(tri, H, states):
    """A step's written slots (some repeated: vLLM's padding goes to slot 0) get their positions in
    every head and each state's initial value (float and int64 ones); other slots are untouched."""
    g = torch.Generator().manual_seed(H * 10 + states)
    n_slots, n = 200, 70
    slots = torch.cat([torch.randperm(n_slots, generator=g)[: n - 3], torch.zeros(3, dtype=torch.long)]).to(DEV)
    positions = torch.cat([torch.randint(0, 10_000, (n - 3,), generator=g), torch.zeros(3, dtype=torch.long)])
    positions = positions.to(torch.int32)[:, None].to(DEV)
    before = [
        torch.randint(-5, 5, (n_slots, H), generator=g, dtype=torch.int32),
        torch.randn(n_slots, H, generator=g),
        torch.randint(0, 9, (n_slots, H), generator=g),
    ]
    inits = [0.0, -1]
    for mod in (ref, tri):
        pos, *st = (t.clone().to(DEV) for t in before[: 1 + states])
        mod.record_slots(pos, slots, positions, list(zip(st, inits)))
        want = before[0].clone().to(DEV)
        want[slots] = positions
        assert torch.equal(pos, want), mod.__name__
        for t, b, init in zip(st, before[1:], inits):
            w = b.clone().to(DEV)
            w[slots] = init
            assert torch.equal(t, w), mod.__name__


# -- the engine's step: batched rows against the per-row path ---------------------------------------


def _step(monkeypatch, batched: bool, kernels: str):
    from vllm_kvevict.backends import flash_layout as flash_cache
    from vllm_kvevict.backends.evict import RowWork, evict_step
    from vllm_kvevict.backends.plan import StepPlan
    from vllm_kvevict.kernels import ops
    from vllm_kvevict.kernels.torch_ops import ragged
    from vllm_kvevict.policies import get_policy
    from vllm_kvevict.policies.base import RowInputs

    monkeypatch.setenv("KVEVICT_KERNELS", kernels)
    if not batched:  # KVEVICT_BATCHED=0: every row through its policy object
        monkeypatch.setenv("KVEVICT_BATCHED", "0")
    calls = []
    select = ops.select_topk
    monkeypatch.setattr(ops, "select_topk", lambda *a: calls.append(ragged(a[2]).rows) or select(*a))
    NB, H, bs, D = 40, 2, 16, 64
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(NB, H, bs, 2 * D, generator=g).to(DEV)
    slot_pos = torch.randint(0, 10_000, (NB * bs, H), generator=g, dtype=torch.int32).to(DEV)
    state = {"h2o": torch.rand(NB * bs, H, generator=g).to(DEV)}  # another policy's state moves with the tokens
    tables = (torch.randperm(NB - 1, generator=g)[:36].reshape(6, 6) + 1).to(DEV)
    lens, e_prev, e_new = [90, 40, 70, 33, 64, 80], [16, 0, 32, 0, 0, 48], [48, 16, 48, 16, 32, 64]
    plan = StepPlan(
        L_prev=[0] * 6,
        e_prev=e_prev,
        e_new=e_new,
        seq_lens=lens,
        block_table=tables,
        slot_mapping=torch.tensor([]),
        positions=torch.tensor([]),
        req_ids=list("abcdef"),
        states=[],
        query_start_loc=[0] * 7,
    )
    kd, kn, sl, rnd = (get_policy(p) for p in ("keydiff", "knorm", "streamingllm", "random"))
    pols = [kd, kn, kd, sl, rnd, kd]
    work = [RowWork(r, p, True, RowInputs(L=lens[r])) for r, p in enumerate(pols)]
    kept = evict_step(
        plan,
        work,
        bs,
        gather=lambda b, o: flash_cache.gather_tokens(cache, b, o),
        write=lambda s, K, V: flash_cache.write_tokens(cache, s, K, V),
        slot_pos=slot_pos,
        slot_state=state,
        layer=3,
        G=2,
    )
    assert calls == ([6] if batched else [])  # one selection for every row, whatever its policy
    return cache, slot_pos, state["h2o"], kept


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_evict_step_batched_equals_per_row(monkeypatch, kernels):
    if kernels == "triton" and not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 from the start")
    with monkeypatch.context() as m:
        want = _step(m, batched=False, kernels="torch")
    got = _step(monkeypatch, batched=True, kernels=kernels)
    for a, b in zip(want[:3], got[:3]):
        assert torch.equal(a, b)
    assert len(want[3]) == len(got[3]) == 6 and all(torch.equal(a, b) for a, b in zip(want[3], got[3]))


ATTN_CASES = [  # (H_q, H_kv, head_dim, softcap, rows as (m queries, n keys))
    (2, 2, 64, None, [(1, 37)]),
    (4, 2, 64, None, [(40, 100), (1, 7), (33, 64), (5, 130)]),
    (6, 3, 128, 30.0, [(33, 130), (2, 0), (0, 12), (17, 65)]),  # rows without keys / without queries
    (2, 1, 64, None, [(5, 3), (3, 40)]),  # row 0: its queries are older than every key (see nothing)
]


def ragged_attention_case(case: int):
    """Packed queries ``[M, H_q, D]`` and keys ``[N, H_kv, D]`` of several rows, compacted (shuffled,
    gapped) key positions per head, each row's queries at its newest positions."""
    Hq, H, D, cap, shape = ATTN_CASES[case]
    g = torch.Generator().manual_seed(case)
    Q, K, q_pos, k_pos = [], [], [], []
    for r, (m, n) in enumerate(shape):
        Q.append(torch.randn(m, Hq, D, generator=g))
        K.append(2 * torch.randn(n, H, D, generator=g))
        k_pos.append(torch.stack([torch.randperm(n + 10, generator=g)[:n] for _ in range(H)], dim=1))
        q_pos.append(torch.arange(m) + n + 10 - m if not (case == 3 and r == 0) else torch.arange(m) - 100)
    cu_q = ref.cu_from_lengths(torch.tensor([m for m, _ in shape]))
    cu_k = ref.cu_from_lengths(torch.tensor([n for _, n in shape]))
    return [x.to(DEV) for x in (torch.cat(Q), torch.cat(K), torch.cat(q_pos), torch.cat(k_pos), cu_q, cu_k)] + [
        Hq // H,
        D**-0.5,
        cap,
    ]


@pytest.mark.parametrize("case", range(len(ATTN_CASES)))
def test_column_sums_rows_are_attention_probs(case):
    """The ragged reference, row by row: the softmax probabilities of each row's queries over its own
    keys (never another row's), summed per key; each query that sees a key sums to one."""
    Q, K, q_pos, k_pos, cu_q, cu_k, G, scale, cap = ragged_attention_case(case)
    got = ref.column_sums(Q, K, q_pos, k_pos, cu_q, cu_k, G, scale, cap)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for r in range(len(cq) - 1):
        q, k, kp = Q[cq[r] : cq[r + 1]], K[ck[r] : ck[r + 1]], k_pos[ck[r] : ck[r + 1]]
        p = ref.attention_probs(q.transpose(0, 1), k.transpose(0, 1), q_pos[cq[r] : cq[r + 1]], kp.T, G, scale, cap)
        torch.testing.assert_close(got[ck[r] : ck[r + 1]], p.sum(dim=1).T, atol=1e-5, rtol=1e-5)
        if k.shape[0]:
            sees = (q_pos[cq[r] : cq[r + 1]][None, :] >= kp.min(dim=0).values[:, None]).repeat_interleave(G, 0)
            torch.testing.assert_close(got[ck[r] : ck[r + 1]].sum(0), sees.sum(-1).float(), atol=1e-3, rtol=1e-4)
    if case == 3:
        assert not got[: ck[1]].any()


@pytest.mark.parametrize("case", range(len(ATTN_CASES)))
def test_column_sums_with_attention_sinks(case):
    """Learned attention sinks (gpt-oss): one more logit per query head in every softmax, whose
    probability is no key's. Each query's probabilities over the keys are its sinkless ones scaled
    by ``1 / (1 + exp(sink - lse))`` (``lse`` over the keys it sees): a query that sees no key stays
    0, and the column sums are no longer a sum of ones per query."""
    Q, K, q_pos, k_pos, cu_q, cu_k, G, scale, cap = ragged_attention_case(case)
    sinks = torch.linspace(-2.0, 3.0, Q.shape[1], device=Q.device)
    got = ref.column_sums(Q, K, q_pos, k_pos, cu_q, cu_k, G, scale, cap, sinks)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for r in range(len(cq) - 1):
        q, k, kp = (
            Q[cq[r] : cq[r + 1]].transpose(0, 1),
            K[ck[r] : ck[r + 1]].transpose(0, 1),
            k_pos[ck[r] : ck[r + 1]].T,
        )
        qp = q_pos[cq[r] : cq[r + 1]]
        s = torch.einsum("hmd,hnd->hmn", q.float(), k.float().repeat_interleave(G, 0)) * scale
        if cap:
            s = cap * torch.tanh(s / cap)
        s = s.masked_fill(kp.repeat_interleave(G, 0)[:, None, :] > qp[None, :, None], float("-inf"))
        p = torch.exp(s - torch.logaddexp(torch.logsumexp(s, -1, keepdim=True), sinks[:, None, None]))
        torch.testing.assert_close(got[ck[r] : ck[r + 1]], p.sum(dim=1).T, atol=1e-5, rtol=1e-5)
    if any(m and n for m, n in ATTN_CASES[case][4]):
        assert not torch.allclose(got, ref.column_sums(Q, K, q_pos, k_pos, cu_q, cu_k, G, scale, cap))


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("case", range(len(ATTN_CASES)))
def test_triton_column_sums(tri, case, sinks):
    """Every row in one launch per pass equals the reference's row-by-row matmuls (with attention
    sinks too)."""
    args = ragged_attention_case(case)
    if sinks:
        args.append(torch.linspace(-2.0, 3.0, args[0].shape[1], device=args[0].device))
    want = ref.column_sums(*args)
    got = tri.column_sums(*args)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # the keys and their positions read where they are (the in-place step): the same bits
    Q, K, q_pos, k_pos = args[:4]
    N, H, D = K.shape
    g = torch.Generator().manual_seed(case)
    nb, bs = N // 16 + 2, 16
    slots = torch.randperm(nb * bs, generator=g)[:N].to(K.device)  # scattered over the blocks
    cache = torch.randn(nb, bs, H, D, generator=g).to(K.device, K.dtype)
    pcache = torch.full((nb, bs, H), -7, dtype=torch.int32, device=K.device)
    blocks, offs = slots // bs, slots % bs
    cache[blocks, offs], pcache[blocks, offs] = K, k_pos.to(torch.int32)
    paged = (ref.PagedKeys(cache, blocks, offs), ref.PagedKeys(pcache, blocks, offs))
    assert torch.equal(tri.column_sums(Q, paged[0], q_pos, paged[1], *args[4:]), got)
    from vllm_kvevict.kernels import ops  # whichever kernels dispatch: torch's gathers them first

    torch.testing.assert_close(ops.column_sums(Q, paged[0], q_pos, paged[1], *args[4:]), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("G", [1, 2, 3])
def test_lshe_victims_of_every_row_in_one_kernel_equal_its_statement(tri, G):
    """LSH-E's victims for packed rows (ragged windows and steps, their own budgets, compacted
    layouts, earlier victims, 3-bit codes: many distance ties) in one launch: the statement's,
    which runs the reference loop row by row; positions packed and read through their blocks."""
    g = torch.Generator().manual_seed(G)
    H, lens, steps, budgets = 2, [40, 150, 9, 64], [12, 30, 5, 1], [20, 60, 3, 63]
    cu, cq = ref.cu_from_lengths(torch.tensor(lens)), ref.cu_from_lengths(torch.tensor(steps))
    pos = torch.cat([torch.stack([torch.randperm(n, generator=g) for _ in range(H)], 1) for n in lens])
    q_pos = torch.cat([torch.arange(n - m, n) for n, m in zip(lens, steps)])
    codes, q_codes = (
        torch.randint(0, 8, (sum(lens), H), generator=g),
        torch.randint(0, 8, (sum(steps), H * G), generator=g),
    )
    victim = torch.where(torch.rand(sum(lens), H, generator=g) < 0.1, 0, -1)  # some earlier victims
    rest = (torch.tensor(budgets), 2, 3, G)  # budgets, sinks, recent tokens, group size
    want = FUSED["lshe_victims_ragged"](q_codes, codes, pos, victim.clone(), q_pos, cq, cu, *rest)
    assert (want != victim).any()
    nb, bs = sum(lens) // 16 + 2, 16
    slots = torch.randperm(nb * bs, generator=g)[: sum(lens)]
    pcache = torch.full((nb, bs, H), -7, dtype=torch.int32)
    pcache[slots // bs, slots % bs] = pos.to(torch.int32)
    paged = ref.PagedKeys(pcache.to(DEV), (slots // bs).to(DEV), (slots % bs).to(DEV))
    for p in (pos.to(DEV), paged):
        on = [t.to(DEV) for t in (q_codes, codes, victim.clone(), q_pos, cq, cu, rest[0])]
        got = tri.lshe_victims_ragged(*on[:2], p, *on[2:], *rest[1:])
        assert torch.equal(got.cpu(), want)


def _victims_by_the_letter(dist, pos, victim, q_pos, budget, sinks, recent):
    """Alg. 1 line 1 read literally: token by token, head by head, key by key."""
    vic = victim.clone()
    for i, t in enumerate(q_pos.tolist()):
        for h in range(pos.shape[0]):
            alive = [j for j in range(pos.shape[1]) if pos[h, j] < t and vic[h, j] < 0]
            if len(alive) < budget:
                continue
            eligible = [j for j in alive if pos[h, j] >= sinks and pos[h, j] < t - recent]
            if eligible:  # the farthest, then the oldest
                j = max(eligible, key=lambda j: (int(dist[h, i, j]), -int(pos[h, j])))
                vic[h, j] = t
    return vic


@pytest.mark.parametrize("order", ["in order", "shuffled"])
@pytest.mark.parametrize("case", range(3))
def test_lshe_victims_follow_the_algorithm(case, order):
    """The torch path's victims (token by token, with what does not depend on earlier choices
    computed for all tokens at once) equal the algorithm read literally, also when the tokens do
    not come in position order."""
    g = torch.Generator().manual_seed(10 + case)
    H, n, m, budget, sinks, recent = [(2, 40, 12, 20, 4, 3), (3, 90, 30, 40, 2, 10), (1, 9, 5, 3, 0, 0)][case]
    pos = torch.stack([torch.randperm(n, generator=g) for _ in range(H)])
    q_pos = torch.arange(n - m, n)
    if order == "shuffled":
        q_pos = q_pos[torch.randperm(m, generator=g)]
    dist = torch.randint(0, 5, (H, m, n), generator=g)
    victim = torch.full((H, n), -1, dtype=torch.int64)
    victim[:, : n // 10] = torch.where(pos[:, : n // 10] < n - m - 5, n - m - 1, -1)
    got = victim.clone()
    ref.lshe_victims(dist, pos, got, q_pos, budget, sinks, recent)
    want = _victims_by_the_letter(dist, pos, victim, q_pos, budget, sinks, recent)
    assert (want != victim).any() and torch.equal(got, want)


def test_every_op_has_both_implementations(tri):
    """ops.OPS: each dispatched op exists in the reference and in Triton, with ops' parameter names;
    each fused policy score (ops.FUSED) in Triton, with its statement's."""
    import inspect

    from vllm_kvevict.kernels import ops

    for name in ops.OPS:
        params = [list(inspect.signature(getattr(mod, name)).parameters) for mod in (ops, ref, tri)]
        assert params[0] == params[1] == params[2], name
    # the policies' scores: stated in torch in the policy's file, fused in Triton, same parameters
    assert set(FUSED) == {
        "keydiff_scores",
        "knorm_scores",
        "h2o_observe_columns",
        "projected_value_norms",
        "criticalkv_scores",
        "pool_segments",
        "snapkv_scores",
        "caote_scores",
        "lshe_victims_ragged",
    }
    for name, statement in FUSED.items():
        assert list(inspect.signature(getattr(tri, name)).parameters) == list(inspect.signature(statement).parameters)


@pytest.mark.skipif(not CUDA, reason="only a GPU's atomics sum in a varying order")
def test_statements_give_the_same_bits_every_run_and_in_any_batch():
    """The torch statements on a GPU: KeyDiff's anchor and KVMerger's set sums are segmented sums
    (index_add_ adds with atomics there, in whatever order the threads come), so a score, a kept
    set and a merged value are the same bits on every run, and a row's scores do not depend on
    which rows share its call."""
    from tests.policy_reference import build, make_policy, on_device

    g = torch.Generator().manual_seed(0)
    lens = [3000, 1, 4096, 700, 0, 2048]
    cu = ref.cu_from_lengths(torch.tensor(lens)).to(DEV)
    K = (torch.randn(sum(lens), 8, 128, generator=g) + 0.05).to(DEV)  # a common direction: long sums
    s = FUSED["keydiff_scores"](K, cu)
    assert torch.equal(s, FUSED["keydiff_scores"](K, cu))
    for r, n in enumerate(lens):
        a = int(cu[r])
        alone = FUSED["keydiff_scores"](K[a : a + n], torch.tensor([0, n], device=DEV))
        assert torch.equal(alone, s[a : a + n]), r

    pol = make_policy("kvmerger", threshold=0.0)  # every unprotected run merges: long sets
    view, _ = build(pol, H=2, G=2, n=3000, d=128, seed=1)
    view.state["h2o"] = torch.rand(2, 3000, generator=g)
    view = on_device(view, DEV)
    kept, (Km, Vm) = pol.evict(view, 300)
    for _ in range(3):
        kept2, (Km2, Vm2) = pol.evict(view, 300)
        assert torch.equal(kept, kept2) and torch.equal(Km, Km2) and torch.equal(Vm, Vm2)


@pytest.mark.skipif(not CUDA, reason="auto's choices on a GPU")
def test_auto_runs_the_measured_fastest_implementation_on_a_gpu(monkeypatch):
    """``KVEVICT_KERNELS=auto`` on a GPU: torch's ``column_sums``, and torch's ``select_topk`` for
    sets with a row longer than ``SELECT_TRITON_MAX_ROW`` (Triton's below); Triton for the rest."""
    from vllm_kvevict.kernels import ops

    monkeypatch.setenv("KVEVICT_KERNELS", "auto")
    t = torch.empty(1, device=DEV)
    assert ops.backend_for(t, "column_sums") is ref
    assert ops.backend_for(t, "gather_paged").__name__.endswith("triton_ops")
    calls, select = [], ref.select_topk
    monkeypatch.setattr(ref, "select_topk", lambda *a: calls.append(int(a[2][-1])) or select(*a))
    for n in (ops.SELECT_TRITON_MAX_ROW, ops.SELECT_TRITON_MAX_ROW + 1):
        cu = torch.tensor([0, 3, 3 + n], device=DEV)
        scores = torch.rand(int(cu[-1]), 2, device=DEV)
        pos = torch.arange(int(cu[-1]), device=DEV)[:, None].expand(-1, 2).contiguous()
        idx, _ = ops.select_topk(scores, pos, cu, torch.tensor([2, 100], device=DEV))
        assert idx.shape == (102, 2)
    assert calls == [3 + ops.SELECT_TRITON_MAX_ROW + 1]  # the longer set only


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("kernel", [1, 3, 7])
def test_pool_segments_is_pool1d_per_segment_and_triton_has_its_bits(tri, mode, kernel):
    """SnapKV's pooling over packed rows: each row's prefix pooled as ``pool1d`` pools it alone
    (close: the neighbours are added in another order), its tail left as it is; Triton's kernel
    gives the statement's bits."""
    from vllm_kvevict.policies.attention import pool1d

    g = torch.Generator().manual_seed(kernel)
    lens, tails = [1, 40, 0, 300, 7], [1, 32, 0, 32, 3]
    firsts = [sum(lens[:r]) for r in range(len(lens))]
    x = torch.rand(sum(lens), 6, generator=g).to(DEV)
    start = torch.tensor([a for a, n in zip(firsts, lens) for _ in range(n)], device=DEV)
    end = torch.tensor([a + n - t for a, n, t in zip(firsts, lens, tails) for _ in range(n)], device=DEV)
    got = FUSED["pool_segments"](x, start, end, kernel, mode)
    assert torch.equal(tri.pool_segments(x, start, end, kernel, mode), got)
    for a, n, t in zip(firsts, lens, tails):
        if n - t:
            want = pool1d(x[a : a + n - t].T, kernel, mode).T
            torch.testing.assert_close(got[a : a + n - t], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("G", [1, 3])
def test_snapkv_scores_in_one_kernel_equal_its_statement(tri, mode, G):
    """SnapKV's window mean, pooling within each row's prefix, group mean and the window's
    protection in one Triton kernel: the statement's scores (close: the group's mean adds in
    another order), ``+inf`` exactly where the statement protects; positions packed or read where
    they are (the in-place step); rows shorter than the window, one that computed fewer tokens
    than it holds, and an empty one."""
    g = torch.Generator().manual_seed(G)
    lens, Ls, ms, H, window = [40, 5, 0, 300, 33], [40, 5, 0, 290, 700], [32, 5, 1, 32, 3], 2, 32
    N, bs = sum(lens), 32
    cu = ref.cu_from_lengths(torch.tensor(lens)).to(DEV)
    row = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(DEV)
    A = (torch.rand(N, H * G, generator=g) * 5).to(DEV)
    L, m = torch.tensor(Ls, device=DEV), torch.tensor(ms, device=DEV)
    pos = torch.stack([torch.randperm(max(Ls) + 1, generator=g)[:N] for _ in range(H)], 1)
    pos = torch.minimum(pos, L[row].cpu()[:, None] - 1).to(DEV)  # a row's tokens are older than its L
    slots = torch.randperm(N + 7, generator=g)[:N].to(DEV)
    pcache = torch.full(((N + 7 + bs - 1) // bs, bs, H), -1, dtype=torch.int32, device=DEV)
    pcache[slots // bs, slots % bs] = pos.to(torch.int32)
    paged = ref.PagedKeys(pcache, slots // bs, slots % bs)
    for protect in (False, True):
        args = (row, cu, m, L, G, window, 7, mode, protect)
        want = FUSED["snapkv_scores"](A, pos, *args)
        for p in (pos, paged):
            got = tri.snapkv_scores(A, p, *args)
            assert torch.equal(got.isinf(), want.isinf()) and (want.isinf().any() == protect)
            fin = ~want.isinf()
            torch.testing.assert_close(got[fin], want[fin], rtol=1e-6, atol=1e-7)


def test_knorm_scores_in_one_kernel_equal_its_statement(tri):
    """K-norm's norms and its sink and recent tokens' protection in one Triton kernel: the
    statement's scores, ``+inf`` exactly where it protects; keys and positions packed or read where
    they are (the in-place step); a row split over several programs, a short one, an empty one,
    and one that computed more tokens than it holds."""
    g = torch.Generator().manual_seed(3)
    lens, Ls, H, D, bs = [2300, 5, 0, 140], [2300, 5, 0, 900], 2, 24, 32
    N = sum(lens)
    cu = ref.cu_from_lengths(torch.tensor(lens)).to(DEV)
    row = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    L = torch.tensor(Ls, device=DEV)
    K = torch.randn(N, H, D, generator=g).to(DEV)
    pos = (torch.rand(N, H, generator=g) * L.cpu()[row][:, None]).long().to(DEV)  # older than the row's L
    slots = torch.randperm(N + 9, generator=g)[:N].to(DEV)
    kcache = torch.zeros((N + 9 + bs - 1) // bs, bs, H, D, device=DEV)
    kcache[slots // bs, slots % bs] = K
    pcache = torch.full(kcache.shape[:3], -1, dtype=torch.int32, device=DEV)
    pcache[slots // bs, slots % bs] = pos.to(torch.int32)
    keys, paged = ref.PagedKeys(kcache, slots // bs, slots % bs), ref.PagedKeys(pcache, slots // bs, slots % bs)
    assert tri.knorm_scores_paged(keys, paged, cu, L, 4, 10).shape == (N, H)
    for sink, recent in ((4, 10), (0, 0), (3, 200)):
        want = FUSED["knorm_scores"](K, pos, cu, L, sink, recent)
        assert want.isinf().any() == (sink + recent > 0)
        for got in (
            tri.knorm_scores(K, pos, cu, L, sink, recent),
            tri.knorm_scores_paged(keys, paged, cu, L, sink, recent),
        ):
            assert torch.equal(got.isinf(), want.isinf())
            fin = ~want.isinf()
            torch.testing.assert_close(got[fin], want[fin], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("G", [1, 3])
def test_h2o_observe_in_one_kernel_equals_its_statement(tri, G):
    """H2O's observation in one Triton kernel: each key's accumulators plus the step's attention
    sums averaged over the query group, in place; the sums a slice of a wider buffer and the
    accumulators a strided view (a request's own rows of the layer's), longer than a tile, and none."""
    g = torch.Generator().manual_seed(G)
    for N in (300, 0):
        H = 2
        A = (torch.rand(N + 5, H * G + 1, generator=g) * 3).to(DEV)[5:, 1:]  # strided, as a slice of the sums
        acc = torch.rand(H, N, generator=g).to(DEV).T  # [N, H], column-major
        want = FUSED["h2o_observe_columns"](A, acc.clone(), G)
        got = acc.clone().T.contiguous().T  # the same strides as ``acc``
        assert tri.h2o_observe_columns(A, got, G) is got
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fast", [False, True])
def test_caote_scores_in_one_kernel_equal_its_statement(tri, fast):
    """CAOTE's closed form (FastCAOTE's) in one Triton kernel, one program per (row, KV head):
    the statement's errors (close: the row's sums add in tiles), values packed or read where they
    are; rows longer than a tile, of one token, empty, and one whose base scores are all zero
    (each token then weighs 1/n)."""
    g = torch.Generator().manual_seed(int(fast))
    lens, H, D, bs = [150, 1, 0, 40, 7], 2, 24, 32
    N = sum(lens)
    cu = ref.cu_from_lengths(torch.tensor(lens)).to(DEV)
    row = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(DEV)
    h = torch.rand(N, H, generator=g)
    h[151:191] = 0.0  # row 3: no base score at all
    h = h.to(DEV)
    V = torch.randn(N, H, D, generator=g).to(DEV)
    slots = torch.randperm(N + 9, generator=g)[:N].to(DEV)
    cache = torch.zeros((N + 9 + bs - 1) // bs, bs, H, D, device=DEV)
    cache[slots // bs, slots % bs] = V
    want = FUSED["caote_scores"](h, V, cu, row, fast)
    assert torch.isfinite(want).all()
    for v in (V, ref.PagedKeys(cache, slots // bs, slots % bs)):
        torch.testing.assert_close(tri.caote_scores(h, v, cu, row, fast), want, rtol=1e-5, atol=1e-6)
