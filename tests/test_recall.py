# SPDX-License-Identifier: Apache-2.0
"""The recall tier and its selection (vllm_kvevict/backends/recall.py) against plain loops."""

from __future__ import annotations

import math
import os

import pytest
import torch

from vllm_kvevict.backends.recall import (
    Candidates,
    Tier,
    TierEntry,
    recall_scores,
    select_recalled,
)
from vllm_kvevict.kernels.torch_ops import complement


def _entry(pos: list[list[int]], score: list[list[float]], D: int = 4) -> TierEntry:
    p = torch.tensor(pos).T  # [n, H]
    n, H = p.shape
    K = torch.arange(n * H * D, dtype=torch.float32).view(n, H, D)
    return TierEntry(K, -K, p, torch.tensor(score).T, {"acc": p.float() * 10})


def test_tier_keeps_the_best_scored_per_head_within_its_cap():
    tier = Tier()
    tier.add(_entry([[1, 2, 3], [4, 5, 6]], [[0.1, 0.9, 0.5], [0.3, 0.2, 0.1]]), cap=4)
    tier.add(_entry([[7, 8], [9, 10]], [[0.2, 0.8], [0.7, 0.0]]), cap=4)
    assert tier.tokens == 4
    (e,) = tier.chunks
    assert sorted(e.pos[:, 0].tolist()) == [2, 3, 7, 8]  # head 0 dropped 1 (0.1)
    assert sorted(e.pos[:, 1].tolist()) == [4, 5, 6, 9]  # head 1 dropped 10 (0.0)
    # everything of a token moves together: its K, V and state
    for h in range(2):
        for j in range(4):
            assert e.state["acc"][j, h] == e.pos[j, h] * 10
            assert torch.equal(e.V[j, h], -e.K[j, h])
    assert tier.take() and tier.tokens == 0 and tier.take() == []  # take empties it
    other = Tier()
    other.add(_entry([[1], [1]], [[0.0], [0.0]]), cap=0)  # cap 0: nothing kept
    assert other.chunks == [] and other.tokens == 0


def test_parts_read_the_whole_tier_and_keep_it():
    tier = Tier()
    tier.add(_entry([[1, 2], [3, 4]], [[0.1, 0.2], [0.3, 0.4]]), cap=10)
    new = _entry([[5], [6]], [[0.5], [0.6]])
    new.copy = copy = _Copy(done=False)  # the newest chunk's copy still in flight: parts waits for it
    tier.chunks.append(new)
    seen = tier.parts()
    assert copy.waited and seen[1] is new  # the entries themselves, nothing copied
    assert torch.cat([p.pos for p in seen])[:, 0].tolist() == [1, 2, 5] and tier.tokens == 3
    taken = tier.take()
    assert torch.equal(torch.cat([p.pos for p in taken]), torch.cat([p.pos for p in seen])) and tier.tokens == 0


class _Copy:
    """A device-to-host copy in flight, as the GPU tier sees one (a CUDA event's query/synchronize)."""

    def __init__(self, done: bool) -> None:
        self.done, self.waited = done, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


def test_candidates_pick_what_the_concatenated_entries_hold():
    """Recall scores a window and a tier's chunks as one set: what it picks (each KV head its own
    indices, any part, a chunk without a state key giving zeros) is what indexing the entries
    concatenated gives; the tier's chunks are taken as they are (a copy in flight waited for)."""
    g = torch.Generator().manual_seed(0)
    parts = []
    for n in (5, 3, 1, 4):
        p = torch.randint(0, 100, (n, 2), generator=g)
        state = {"acc": torch.rand(n, 2, generator=g)} if n != 3 else {}
        parts.append(TierEntry(torch.rand(n, 2, 4, generator=g), torch.rand(n, 2, 4, generator=g), p, p.float(), state))
    tier = Tier.of(tuple(parts[1:]), cap=100)
    parts[-1].copy = copy = _Copy(done=False)
    taken = tier.take()
    assert copy.waited and tier.tokens == 0 and [t.pos.shape for t in taken] == [t.pos.shape for t in parts[1:]]
    cand = Candidates([parts[0], *taken])
    score = torch.rand(cand.tokens, 2, generator=g)
    idx = torch.stack([torch.randperm(cand.tokens, generator=g)[:7] for _ in range(2)], dim=1)
    got = cand.pick(idx, score)
    h = torch.arange(2)[None, :]
    acc = torch.cat([t.state.get("acc", torch.zeros(t.tokens, 2)) for t in parts])
    for name, whole in (("K", "K"), ("V", "V"), ("pos", "pos")):
        assert torch.equal(getattr(got, name), torch.cat([getattr(t, whole) for t in parts])[idx, h])
    assert torch.equal(got.score, score[idx, h]) and torch.equal(got.state["acc"], acc[idx, h])
    assert [t.tokens for t in Tier.of(tuple(parts[1:]), cap=4).take()] == [4]  # over its cap: its best, merged


def test_tier_merges_a_chunk_only_once_its_copy_has_landed():
    """On a GPU the newest chunk's copy to pinned memory may still be in flight: it stays apart
    (bound: cap plus that chunk) and is waited for at the next add or at take, never read before."""
    tier = Tier()
    first = _entry([[1, 2, 3], [4, 5, 6]], [[0.1, 0.9, 0.5], [0.3, 0.2, 0.1]])
    first.copy = _Copy(done=False)
    tier.add(first, cap=2)
    assert tier.chunks == [first] and not first.copy.waited  # not read, not capped yet
    second = _entry([[7], [9]], [[0.8], [0.7]])
    second.copy = copy2 = _Copy(done=False)
    tier.add(second, cap=2)
    merged, pending = tier.chunks
    assert pending is second and not copy2.waited
    assert merged.copy is None and first.copy is None and merged.tokens == 2  # the first waited for, capped
    assert sorted(merged.pos[:, 0].tolist()) == [2, 3] and tier.tokens == 3
    third = _entry([[8], [10]], [[0.0], [0.9]])
    third.copy = _Copy(done=True)  # already landed: merged at once
    tier.add(third, cap=2)
    (e,) = tier.chunks
    assert copy2.waited and e.tokens == 2
    assert sorted(e.pos[:, 0].tolist()) == [2, 7] and sorted(e.pos[:, 1].tolist()) == [9, 10]
    last = _entry([[11], [12]], [[1.0], [1.0]])
    last.copy = copy4 = _Copy(done=False)
    tier.add(last, cap=2)
    (got,) = tier.take("cpu")  # over its cap: merged, its best
    assert copy4.waited and got.tokens == 2 and tier.chunks == [] and tier.tokens == 0
    assert sorted(got.pos[:, 0].tolist()) == [2, 11] and sorted(got.pos[:, 1].tolist()) == [10, 12]


def _reference_scores(Q, q_pos, K, pos, G, scale, kernel):
    """Plain loops: per query head, softmax over the candidates it may see, summed over queries;
    mean over each KV head's group; max-pooled over the ``kernel`` nearest candidates by position."""
    H_q, w, _ = Q.shape
    n, H, _ = K.shape
    A = torch.zeros(n, H_q, dtype=torch.float64)
    for hq in range(H_q):
        h = hq // G
        for i in range(w):
            logits = [float(Q[hq, i] @ K[j, h]) * scale if pos[j, h] <= q_pos[i] else -math.inf for j in range(n)]
            m = max(logits)
            ex = [math.exp(x - m) if x > -math.inf else 0.0 for x in logits]
            z = sum(ex)
            for j in range(n):
                A[j, hq] += ex[j] / z
    s = A.view(n, H, G).mean(-1)
    out = torch.empty_like(s)
    for h in range(H):
        order = sorted(range(n), key=lambda j: int(pos[j, h]))
        for rank, j in enumerate(order):
            lo, hi = max(0, rank - kernel // 2), min(n, rank + kernel // 2 + 1)
            out[j, h] = max(s[order[k], h] for k in range(lo, hi))
    return out


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("kernel", [1, 3, 7])
def test_recall_scores_equal_the_loops(kernel, kernels, monkeypatch):
    """The scores come from the ragged ``column_sums`` (torch, and the Triton kernel under Triton's
    interpreter here, on the GPU where one is lent) and equal the plain loops."""
    if kernels == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 from the start")
    monkeypatch.setenv("KVEVICT_KERNELS", kernels)
    torch.manual_seed(0)
    H, G, d, n, w = 2, 2, 8, 23, 5
    K = torch.randn(n, H, d)
    pos = torch.stack([torch.randperm(40)[:n] for _ in range(H)], dim=1)  # window and tier mixed, any order
    q_pos = torch.arange(35, 35 + w)
    Q = torch.randn(H * G, w, d)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = recall_scores(Q.to(dev), q_pos.to(dev), K.to(dev), pos.to(dev), G, 0.3, None, kernel).cpu()
    want = _reference_scores(Q, q_pos, K, pos, G, 0.3, kernel)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_selection_protects_the_observation_window_and_orders_by_position():
    pos = torch.tensor([[10, 3], [50, 51], [2, 52], [51, 9], [7, 1]])  # [5, 2]
    scores = torch.tensor([[0.9, 0.1], [0.0, 0.0], [0.5, 0.0], [0.0, 0.8], [0.5, 0.7]])
    idx = select_recalled(scores, pos, keep=3, protect_from=50)
    kept = torch.gather(pos, 0, idx)
    assert kept[:, 0].tolist() == [10, 50, 51]  # 50 and 51 protected, then the best (10)
    assert kept[:, 1].tolist() == [9, 51, 52]  # 51, 52 protected, then 9 (0.8)
    # ties go to the newer position
    idx = select_recalled(torch.zeros(4, 1), torch.tensor([[4], [1], [3], [2]]), keep=2, protect_from=99)
    assert torch.gather(torch.tensor([[4], [1], [3], [2]]), 0, idx)[:, 0].tolist() == [3, 4]


def test_complement():
    kept = torch.tensor([[0, 2], [3, 4]])
    assert complement(5, kept).tolist() == [[1, 0], [2, 1], [4, 3]]
    # token 1 never dropped (another request's): two dropped per head
    fixed = torch.tensor([0, 1, 0, 0, 0], dtype=torch.int8)
    assert complement(5, kept, fixed, 2).tolist() == [[2, 0], [4, 3]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: pinned host memory and CUDA events")
def test_tier_on_a_gpu_copies_without_waiting_and_reads_only_landed_copies():
    """A GPU's tier: each chunk is copied to pinned host memory on the current stream and ``add``
    returns while the copy is in flight (the stream held busy by a long kernel before it); the
    chunk is merged only after its event, so the tier's tokens are the device's values (pinned
    memory read early would hold whatever ``torch.empty`` left there)."""
    n, H, D, dev = 2048, 8, 128, "cuda"

    def entry(seed: int, first_pos: int) -> TierEntry:
        g = torch.Generator(device=dev).manual_seed(seed)
        K = torch.randn(n, H, D, device=dev, generator=g).to(torch.bfloat16)
        pos = (first_pos + torch.arange(n, device=dev))[:, None].expand(n, H).contiguous()
        score = torch.rand(n, H, device=dev, generator=g)
        return TierEntry(K, -K, pos, score, {"acc": score * 2})

    a, b = entry(0, 0), entry(1, n)
    want = [e.map(lambda t: t.cpu()) for e in (a, b)]  # what the device holds
    tier = Tier()
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time ahead of the copy
    tier.add(a, cap=n)
    (pending,) = tier.chunks
    assert pending.copy is not None and not pending.copy.query()  # in flight: the host went on
    assert pending.K.device.type == "cpu" and pending.K.is_pinned()
    tier.add(b, cap=n)  # waits for a's copy; b's own copy landed or not, it is kept apart until then
    assert tier.chunks[0].copy is None and tier.tokens == 2 * n
    (got,) = tier.take(dev)  # over its cap: merged, its best
    torch.cuda.synchronize()
    assert got.K.device.type == "cuda" and got.tokens == n

    cat = TierEntry(*(torch.cat([getattr(w, f) for w in want]) for f in ("K", "V", "pos", "score")))
    best = torch.topk(cat.score, n, dim=0).indices  # [n, H]; random scores: no ties
    best = torch.gather(best, 0, torch.argsort(torch.gather(cat.pos, 0, best), dim=0))
    h = torch.arange(H)[None, :]
    order = torch.argsort(got.pos.cpu(), dim=0)
    for f in ("K", "V", "pos", "score"):
        assert torch.equal(getattr(got, f).cpu()[order, h], getattr(cat, f)[best, h]), f
    assert torch.equal(got.state["acc"].cpu()[order, h], 2 * cat.score[best, h])


def test_tiers_over_the_budget_drop_their_lowest_scored():
    """``trim_tiers``: all of a request's tiers (its layers) within ``max_bytes``, each keeping its
    best tokens of each head; what goes is the lowest-scored across its layers (a layer of high
    scores keeps more)."""
    from vllm_kvevict.backends.recall import trim_tiers

    g = torch.Generator().manual_seed(0)

    def tier(n: int, lo: float, hi: float) -> Tier:
        t = Tier()
        pos = torch.arange(n)[:, None].expand(n, 2).contiguous()
        score = lo + (hi - lo) * torch.rand(n, 2, generator=g)
        t.add(TierEntry(torch.randn(n, 2, 4, generator=g), torch.randn(n, 2, 4, generator=g), pos, score), cap=1000)
        return t

    high, low, mixed = tier(50, 0.5, 1.0), tier(50, 0.0, 0.5), tier(50, 0.0, 1.0)
    tiers = [high, low, mixed]
    scores = [t.chunks[0].score.clone() for t in tiers]
    row = high.nbytes / 50
    assert trim_tiers([tiers], 10**9) == 0  # within the budget: nothing changes
    budget = int(60 * row)
    dropped = trim_tiers([tiers], budget)
    assert sum(t.nbytes for t in tiers) <= budget and dropped > 0
    assert high.tokens > mixed.tokens > low.tokens
    for t, s in zip(tiers, scores):  # each head keeps its best scores
        if t.tokens:
            kept = t.chunks[0].score
            for h in range(2):
                assert torch.equal(
                    kept[:, h].sort(descending=True).values, s[:, h].sort(descending=True).values[: t.tokens]
                )
    assert trim_tiers([tiers], 0) > 0 and all(t.tokens == 0 for t in tiers)


def test_a_trim_is_fair_across_requests_and_policies():
    """Scores of different policies are not comparable (StreamingLLM's are positions, up to the
    context length; SnapKV's at most 1): the trim gives every request holding tiers at least its
    share of the budget (a request below its share keeps all it holds, and what it leaves goes to
    the others), and ranks tokens only within a request."""
    from vllm_kvevict.backends.recall import trim_tiers

    g = torch.Generator().manual_seed(1)

    def tier(n: int, score: torch.Tensor) -> Tier:
        t = Tier()
        pos = torch.arange(n)[:, None].expand(n, 2).contiguous()
        t.add(TierEntry(torch.randn(n, 2, 4, generator=g), torch.randn(n, 2, 4, generator=g), pos, score), cap=10**6)
        return t

    def snapkv(n: int) -> Tier:
        return tier(n, torch.rand(n, 2, generator=g))

    def streaming(n: int) -> Tier:
        return tier(n, torch.arange(1000, 1000 + n, dtype=torch.float32)[:, None].expand(n, 2).contiguous())

    tenant_a = [snapkv(400), snapkv(400)]  # two layers each
    tenant_b = [streaming(400), streaming(400)]
    row = tenant_a[0].nbytes / 400
    budget = int(800 * row)  # half of what both hold
    trim_tiers([tenant_a, tenant_b], budget)
    held = [sum(t.nbytes for t in req) for req in (tenant_a, tenant_b)]
    assert sum(held) <= budget
    assert all(h >= budget / 2 - 2 * row for h in held), held  # each its half (whole rows per tier)
    # a small request keeps all it holds; the large one gets the rest
    small, large = [snapkv(50)], [streaming(1000)]
    trim_tiers([small, large], int(400 * row))
    assert small[0].tokens == 50 and large[0].tokens == 350
    # within a request, the best-scored go last (across its layers)
    layers = [tier(100, torch.full((100, 2), 0.9)), tier(100, torch.full((100, 2), 0.1))]
    trim_tiers([layers], int(100 * row))
    assert layers[0].tokens == 100 and layers[1].tokens == 0


@pytest.mark.parametrize("m, block", [(9, 4), (40, 256), (1, 3)])
def test_attend_after_equals_attend_by_positions(m, block):
    """A prefill chunk over the window's kept tokens and the tier (every one before the chunk, each
    KV head its own positions) and its own tokens: ``attend_after``, one mask for every head, is
    :func:`attend` over the same keys by their positions."""
    from vllm_kvevict.kernels.torch_ops import attend, attend_after

    g = torch.Generator().manual_seed(5)
    H, G, n, d = 3, 2, 57, 8
    L0 = 100  # the chunk's first position
    K, V = torch.randn(H, n + m, d, generator=g), torch.randn(H, n + m, d, generator=g)
    Q = torch.randn(H * G, m, d, generator=g)
    before = torch.stack([torch.randperm(L0, generator=g)[:n] for _ in range(H)])  # per head, unordered
    k_pos = torch.cat([before, torch.arange(L0, L0 + m).expand(H, m)], dim=1)
    q_pos = torch.arange(L0, L0 + m)
    want = attend(Q, K, V, q_pos, k_pos, G, 0.3)
    got = attend_after(Q, K, V, G, 0.3, block=block)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap, sinks", [(None, False), (30.0, False), (None, True)])
def test_attend_is_the_attention_of_each_query_head(softcap, sinks):
    """``recall.prefill: all`` computes a chunk's attention over window and tier with
    ``torch_ops.attend``: per query head, the softmax over the keys at positions up to the query's
    (each KV head its own positions), soft-capped, with the sink's logit in the denominator, times
    the values; a query that sees no key gets zeros."""
    from vllm_kvevict.kernels.torch_ops import attend

    g = torch.Generator().manual_seed(3)
    H, G, n, m, d = 2, 3, 37, 9, 8
    K, V = torch.randn(H, n, d, generator=g), torch.randn(H, n, d, generator=g)
    Q = torch.randn(H * G, m, d, generator=g)
    k_pos = torch.stack([torch.randperm(60, generator=g)[:n] + 5 for _ in range(H)])  # per head, unordered
    q_pos = torch.tensor([3, 10, 20, 30, 40, 50, 60, 64, 70])  # the first sees no key
    sink = torch.randn(H * G, generator=g) if sinks else None
    got = attend(Q, K, V, q_pos, k_pos, G, 0.3, softcap, sink, block=4)
    for h in range(H * G):
        for i in range(m):
            seen = k_pos[h // G] <= q_pos[i]
            s = (K[h // G, seen] @ Q[h, i]) * 0.3
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            logits = torch.cat([s, sink[h : h + 1]]) if sinks else s
            p = torch.softmax(logits, 0)[: len(s)] if len(logits) else s
            want = p @ V[h // G, seen] if len(s) else torch.zeros(d)
            assert torch.allclose(got[h, i], want, atol=1e-5), (h, i)


@pytest.mark.parametrize("softcap, sinks", [(None, False), (30.0, False), (None, True)])
def test_recalled_chunks_are_computed_over_every_token_before_them(softcap, sinks):
    """``recall.prefill: all``, through a layer's steps (the step driver): once a compaction has
    dropped tokens into the tier, each prompt chunk's output is the attention over every token of
    the prompt up to it (the window and the tier), soft-capped, with sinks, as without eviction;
    the layer computes it in place of vLLM's attention (``attend_instead``: the driver's output
    holds noise where vLLM's would be)."""
    from tests.step_driver import BS, D, Driver, G, H, Request
    from vllm_kvevict.backends.layout import Heads
    from vllm_kvevict.kernels.torch_ops import attend
    from vllm_kvevict.window import WindowConfig, first_boundary

    sink = torch.randn(H * G, generator=torch.Generator().manual_seed(5)) if sinks else None
    heads = Heads(H * G, H, D**-0.5, softcap, sink)
    req = Request("all-0", 330, "keydiff", True)
    server = {"policy": "keydiff", "budget": 64, "recall": {"enabled": True, "prefill": "all", "cap": 4096}}
    driver = Driver([req], server, layers=1, heads=heads)
    replaced = 0
    try:
        for tokens in driver.schedule(chunk=96, decodes=0):
            plan = driver.step(tokens)
            assert not driver.fell_back()
            pos, q, k, v, out = driver.seen[0][-1]
            allpos = torch.cat([s[0] for s in driver.seen[0]])
            K, V = (torch.cat([s[i] for s in driver.seen[0]]).transpose(0, 1) for i in (2, 3))
            want = attend(q.transpose(0, 1), K, V, pos, allpos.expand(H, -1), G, D**-0.5, softcap, sink)
            got = out.view(len(pos), H * G, D).transpose(0, 1)
            if plan.e_prev[0] > 0:  # the tier holds what the window lost
                replaced += 1
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        driver.close()
    # the chunks after the first compaction (at 128, in the chunk [96, 192)): [192, 288) and [288, 330)
    assert replaced == 2 and first_boundary(WindowConfig(64, BS)) == 128


@pytest.mark.parametrize("prompt, compacts", [(300, False), (330, True)])
def test_a_window_reselected_before_the_last_step_is_the_prompts_last_choice(prompt, compacts, monkeypatch):
    """``recall.prefill: window``: in the step that completes the prompt, the window is re-selected
    once, before the attention, by the prompt's last queries. Where that step compacts nothing, the
    window it leaves is that choice and the step's own tokens; where it compacts, the compaction
    chooses among them by recall's score (SnapKV's equation with the recall's parameters, the same
    queries), and recall does not choose again from the whole tier."""
    from tests.step_driver import BS, D, Driver, G, Request
    from vllm_kvevict.backends.recall import Recall, select_recalled
    from vllm_kvevict.policies.base import KVView
    from vllm_kvevict.request import WORKER

    calls: list[object] = []
    real = Recall._reselect

    def spy(self, *args, **kwargs):
        got = real(self, *args, **kwargs)
        calls.append(got)
        return got

    monkeypatch.setattr(Recall, "_reselect", spy)
    req = Request(f"window-{prompt}", prompt, "keydiff", True)
    server = {"policy": "keydiff", "budget": 64, "recall": {"enabled": True, "prefill": "window", "cap": 4096}}
    driver = Driver([req], server, layers=1)
    try:
        for tokens in driver.schedule(chunk=96, decodes=0):
            plan = driver.step(tokens)
            assert not driver.fell_back()
        assert (plan.e_new[0] > plan.e_prev[0]) == compacts and plan.seq_lens[0] == prompt
        assert len(calls) == 1  # before the last step's attention only
        before = calls[0][0].long()  # the positions chosen then [L_prev - E_prev, H]
        slots = plan.slots(((0, plan.e_new[0], prompt),), BS)
        window = driver.layers[0].slots.positions(driver.caches[0])[slots].long()
        own = torch.arange(plan.L_prev[0], prompt)[:, None].expand(-1, window.shape[1])  # the step's tokens
        cand = torch.cat([before, own])
        if compacts:  # recall's score (the request's decode policy) over the re-selected window and the step's tokens
            seen = driver.seen[0]
            K_all = torch.cat([k for _, _, k, _, _ in seen])  # [prompt, H, D], by position
            h = torch.arange(cand.shape[1])[None, :]
            policy = WORKER.get(req.rid).settings.decode_policy
            assert policy.name == "snapkv" and policy.params.kernel == 31
            view = KVView(
                K=K_all[cand, h].transpose(0, 1),
                V=K_all[cand, h].transpose(0, 1),
                pos=cand.T,
                G=G,
                L=prompt,
                Q=seen[-1][1][-32:].transpose(0, 1),  # the prompt's last queries
                q_pos=torch.arange(prompt - 32, prompt),
                scale=D**-0.5,
                budget=64,
            )
            keep = select_recalled(policy.score(view).T, cand, prompt - plan.e_new[0], prompt - 32)
            torch.testing.assert_close(window, torch.gather(cand, 0, keep))
        else:
            torch.testing.assert_close(window, cand)
    finally:
        driver.close()
