# SPDX-License-Identifier: Apache-2.0
"""The seed algorithms CriticalKV, KVMerger and LSH-E against ALGORITHMS.md sections 2-4, recomputed
here independently with explicit loops (no helper of the policy modules is used, except LSH-E's
seeded projection matrix), plus hypothesis property tests of the eviction contract."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.policy_reference import (
    INF,
    assert_scores,
    attn_row,
    build,
    compacted_pos,
    fresh_state,
    make_policy,
    ref_pool,
)
from vllm_kvevict.policies import POLICIES, KVView, get_policy
from vllm_kvevict.policies.base import topk_newer
from vllm_kvevict.policies.lshe import _projection

# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Independent reference math (float64, explicit loops)
# ---------------------------------------------------------------------------------------------


def ref_attention_sum(view, Qall, qpositions):
    """``[H_kv, n]``: per KV head, mean over its G query heads of the sum over the queries at
    ``qpositions`` of their attention to each slot."""
    H, n, d = view.K.shape
    scale = 1.0 / math.sqrt(d)
    out = torch.zeros(H, n, dtype=torch.float64)
    for h in range(H):
        for g in range(view.G):
            for p in qpositions:
                out[h] += attn_row(Qall[h * view.G + g, p], view.K[h], view.pos[h], p, scale) / view.G
    return out


def ref_snapkv(view, Qall, window, kernel, pooling):
    """Group mean of the pooled (prefix only) mean window attention; the window mask."""
    L, G = view.L, view.G
    H, n, d = view.K.shape
    scale = 1.0 / math.sqrt(d)
    win = view.pos >= L - window
    out = torch.zeros(H, n, dtype=torch.float64)
    for h in range(H):
        n_pre = int((~win[h]).sum())
        assert bool(win[h, n_pre:].all())
        for g in range(G):
            A = sum(attn_row(Qall[h * G + g, p], view.K[h], view.pos[h], p, scale) for p in range(L - window, L))
            A = A / window
            out[h, :n_pre] += ref_pool(A[:n_pre], kernel, pooling) / G
            out[h, n_pre:] += A[n_pre:] / G
    return out, win


def top_by(scores, pos, candidates, k):
    """The k best of ``candidates`` by (score desc, position desc)."""
    return sorted(candidates, key=lambda j: (-float(scores[j]), -int(pos[j])))[:k]


# ---------------------------------------------------------------------------------------------
# CriticalKV
# ---------------------------------------------------------------------------------------------


def test_criticalkv_defaults():
    p = POLICIES["criticalkv"].Params()
    assert (p.base, p.alpha, p.eps) == ("snapkv", 0.5, 1e-4)
    assert (p.snapkv.window, p.snapkv.kernel, p.snapkv.pooling) == (32, 7, "max")
    pol = get_policy("criticalkv")
    assert pol.needs.w_o and pol.needs.query_window == 32 and pol.needs.trigger == "once"


def ref_projected_norms(V, W_O, G):
    """``[H_kv, n]``: mean over the group's query heads of ||v_i W_O^g||_1, explicit loops."""
    H, n, d = V.shape
    D = W_O.shape[-1]
    out = torch.zeros(H, n, dtype=torch.float64)
    for h in range(H):
        for i in range(n):
            for g in range(G):
                Wg = W_O[h * G + g].double()
                total = 0.0
                for c in range(D):
                    total += abs(sum(float(V[h, i, k]) * float(Wg[k, c]) for k in range(d)))
                out[h, i] += total / G
    return out


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("alpha", [0.5, 0.25, 0.0, 1.0])
def test_criticalkv_two_stage_selection(G, alpha):
    window, n, keep, eps = 4, 26, 13, 1e-4
    pol = make_policy("criticalkv", alpha=alpha, snapkv={"window": window, "pooling": "max"})
    view, Qall = build(pol, G=G, n=n, d=4, D=6, m=2, seed=21 + G)
    A, win = ref_snapkv(view, Qall, window, 7, "max")
    Vp = ref_projected_norms(view.V, view.W_O, G)
    crit = (A + eps) * Vp
    b = keep - window
    b1 = math.floor(alpha * b)
    expected_kept, expected_scores = [], crit.clone()
    for h in range(2):
        prefix = [j for j in range(n) if not bool(win[h, j])]
        S1 = top_by(A[h], view.pos[h], prefix, b1)  # stage 1: attention alone
        rest = [j for j in prefix if j not in S1]
        S2 = top_by(crit[h], view.pos[h], rest, b - b1)  # stage 2: (A + eps) * ||v W_O||_1
        window_slots = [j for j in range(n) if bool(win[h, j])]
        expected_kept.append(sorted(window_slots + S1 + S2))
        for j in window_slots + S1:
            expected_scores[h, j] = INF
    view.keep = keep
    assert_scores(pol.score(view), expected_scores)
    kept, merged = pol.evict(view, keep)
    assert merged is None
    assert kept.tolist() == expected_kept
    if alpha == 1.0:  # stage 1 only: plain max-pooled SnapKV
        snap = make_policy("snapkv", window=window, pooling="max")
        assert torch.equal(kept, snap.evict(view, keep)[0])


def test_criticalkv_stage2_prefers_large_projected_values():
    # Equal attention everywhere in the prefix: stage 1 takes the newest (tie rule), stage 2 the
    # tokens whose projected values are largest.
    window, n, keep = 2, 12, 6
    pol = make_policy("criticalkv", alpha=0.5, snapkv={"window": window, "pooling": "max"})
    view, _ = build(pol, H=1, G=1, n=n, d=4, D=4, seed=5)
    view.K[:] = 0.0  # uniform attention
    view.W_O[:] = torch.eye(4)
    view.V[0] = 0.1
    view.V[0, 1] = 5.0
    view.V[0, 3] = 4.0
    kept, _ = pol.evict(view, keep)
    # window {10, 11}; b = 4, b1 = 2: the prefix ties, newest first: {8, 9}; stage 2: {1, 3}
    assert kept.tolist() == [[1, 3, 8, 9, 10, 11]]


# ---------------------------------------------------------------------------------------------
# KVMerger
# ---------------------------------------------------------------------------------------------


def ref_kvmerger(K, V, a, pos, L, keep, p):
    """The whole KVMerger rule, per head: kept slots and merged K/V (float64)."""
    H, n, d = K.shape
    if keep >= n:
        return None
    n_recent, n_heavy = int(p.recent_ratio * n), int(p.heavy_ratio * n)
    if n_recent + n_heavy > keep:
        shrink = keep / (n_recent + n_heavy)
        n_recent, n_heavy = int(n_recent * shrink), int(n_heavy * shrink)
    kept_all, K_all, V_all, info = [], [], [], []
    for h in range(H):
        Kh, Vh = K[h].double(), V[h].double()
        recent = [j for j in range(n) if int(pos[h, j]) >= L - n_recent]
        heavy = top_by(a[h], pos[h], [j for j in range(n) if j not in recent], n_heavy)
        prot = set(recent) | set(heavy)
        cos = []
        for i in range(n - 1):
            x, y = Kh[i], Kh[i + 1]
            cos.append(float((x * y).sum()) / (math.sqrt(float((x * x).sum())) * math.sqrt(float((y * y).sum()))))
        can = [i for i in range(n - 1) if cos[i] > p.threshold and i not in prot and i + 1 not in prot]
        if n - len(can) <= keep:  # only the n - keep most similar links
            links = set(sorted(can, key=lambda i: -cos[i])[: n - keep])
        else:
            links = set(can)
        sets, cur = [], [0]
        for i in range(1, n):
            if i - 1 in links:
                cur.append(i)
            else:
                sets.append(cur)
                cur = [i]
        sets.append(cur)
        merged = {}
        for S in sets:
            piv = max(S, key=lambda j: (float(a[h, j]), j))  # largest attention, ties: newer
            gk = [math.exp(-float(((Kh[piv] - Kh[j]) ** 2).sum()) / (2 * p.sigma**2)) for j in S]
            w = [x / sum(gk) for x in gk]
            kM = sum(w[i] * Kh[j] for i, j in enumerate(S))
            vM = sum(w[i] * Vh[j] for i, j in enumerate(S))
            if p.value_scale == "set_size":
                vM = vM * len(S)
            merged[piv] = (kM, vM, S)
        pivots = sorted(merged)
        if len(pivots) > keep:
            sc = {j: (INF if j in prot else float(a[h, j])) for j in pivots}
            pivots = sorted(sorted(pivots, key=lambda j: (-sc[j], -int(pos[h, j])))[:keep])
        kept_all.append(pivots)
        K_all.append(torch.stack([merged[j][0] for j in pivots]))
        V_all.append(torch.stack([merged[j][1] for j in pivots]))
        info.append(dict(sets=[merged[j][2] for j in pivots], prot=prot))
    return torch.tensor(kept_all), torch.stack(K_all), torch.stack(V_all), info


def run_keys(d, n, runs, seed, noise=0.15):
    """Keys ``[n, d]``: one basis direction per slot, shared within each run, plus small noise."""
    g = torch.Generator().manual_seed(seed)
    direction, nxt = [], 0
    for i in range(n):
        if any(i in r and i != r[0] for r in runs):
            direction.append(direction[-1])
        else:
            direction.append(nxt)
            nxt += 1
    assert nxt <= d
    K = torch.zeros(n, d)
    for i, k in enumerate(direction):
        K[i, k] = 3.0
    return K + noise * torch.randn(n, d, generator=g)


def kvmerger_view(pol, seed=0):
    """Two KV heads, n = 20: head 0 has runs 2..6 and 9..11 (slot 6 is a heavy hitter, which must
    break the run: the set is 2..5), head 1 runs 5..8 and 12..13. Recent: 3 slots (17..19),
    heavy: 2 per head."""
    n, d = 20, 16
    view, _ = build(pol, H=2, G=2, n=n, d=d, seed=seed)
    view.K[0] = run_keys(d, n, [range(2, 7), range(9, 12)], seed + 1)
    view.K[1] = run_keys(d, n, [range(5, 9), range(12, 14)], seed + 2)
    g = torch.Generator().manual_seed(seed + 3)
    a = 0.1 + 0.1 * torch.rand(2, n, generator=g)
    a[0, 4], a[0, 9] = 1.0, 1.0  # pivots of head 0's sets
    a[0, 6], a[0, 14] = 5.0, 6.0  # heavy hitters
    a[1, 8], a[1, 12] = 1.0, 1.0
    a[1, 1], a[1, 15] = 5.0, 6.0
    view.state["h2o"] = a
    return view


@pytest.mark.parametrize("keep", [15, 12, 17, 14])
@pytest.mark.parametrize("sigma", [5.0, 0.5])
def test_kvmerger_known_merge_sets(keep, sigma):
    pol = make_policy("kvmerger", sigma=sigma)
    p = pol.params
    assert (p.threshold, p.recent_ratio, p.heavy_ratio, p.value_scale) == (0.75, 0.17, 0.12, "set_size")
    view = kvmerger_view(pol)
    K0, V0 = view.K.clone(), view.V.clone()
    kept, (Km, Vm) = pol.evict(view, keep)
    ref_kept, rK, rV, info = ref_kvmerger(K0, V0, view.state["h2o"], view.pos, view.L, keep, p)
    assert kept.tolist() == ref_kept.tolist()
    torch.testing.assert_close(Km.double(), rK, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(Vm.double(), rV, atol=1e-5, rtol=1e-5)
    assert torch.equal(view.K, K0) and torch.equal(view.V, V0)
    # protected (recent 17..19, heavy 6/14 and 1/15) tokens stay, unchanged
    for h, prot in ((0, [6, 14, 17, 18, 19]), (1, [1, 15, 17, 18, 19])):
        assert info[h]["prot"] == set(prot)
        for j in prot:
            i = kept[h].tolist().index(j)
            assert torch.equal(Km[h, i], K0[h, j]) and torch.equal(Vm[h, i], V0[h, j])
    if keep == 15:
        # head 0: all 5 links merge ({2,3,4,5} -> pivot 4, {9,10,11} -> pivot 9); n - 5 = 15 sets
        assert kept[0].tolist() == [0, 1, 4, 6, 7, 8, 9, 12, 13, 14, 15, 16, 17, 18, 19]
        # head 1: 4 links ({5..8} -> 8, {12,13} -> 12) leave 16: the lowest-attention set goes
        assert 8 in kept[1].tolist() and 12 in kept[1].tolist() and len(set(kept[1].tolist())) == 15
        for h, piv, S in ((0, 4, [2, 3, 4, 5]), (0, 9, [9, 10, 11]), (1, 8, [5, 6, 7, 8]), (1, 12, [12, 13])):
            i = kept[h].tolist().index(piv)
            assert info[h]["sets"][i] == S
            kp = K0[h, piv].double()
            gk = torch.tensor(
                [math.exp(-float(((kp - K0[h, j].double()) ** 2).sum()) / (2 * sigma**2)) for j in S],
                dtype=torch.float64,
            )
            w = gk / gk.sum()
            k_M = sum(w[t] * K0[h, j].double() for t, j in enumerate(S))
            v_M = len(S) * sum(w[t] * V0[h, j].double() for t, j in enumerate(S))
            torch.testing.assert_close(Km[h, i].double(), k_M, atol=1e-5, rtol=1e-5)  # in the pivot's slot
            torch.testing.assert_close(Vm[h, i].double(), v_M, atol=1e-5, rtol=1e-5)
            if sigma == 0.5:
                assert float(w.max() - w.min()) > 0.05  # the kernel really weights
    if keep == 17:  # only the 3 most similar links of each head merge
        assert all(sum(len(S) - 1 for S in info[h]["sets"]) == 3 for h in range(2))


def test_kvmerger_value_scale_none_and_no_merge_at_full_keep():
    pol = make_policy("kvmerger", value_scale="none")
    view = kvmerger_view(pol, seed=4)
    kept, (Km, Vm) = pol.evict(view, 15)
    _, rK, rV, _ = ref_kvmerger(view.K, view.V, view.state["h2o"], view.pos, view.L, 15, pol.params)
    torch.testing.assert_close(Vm.double(), rV, atol=1e-5, rtol=1e-5)
    kept, merged = pol.evict(view, 20)
    assert merged is None and kept.tolist() == [list(range(20))] * 2


@pytest.mark.parametrize("G", [1, 2])
def test_kvmerger_observe_accumulates_and_pivots(G):
    pol = make_policy("kvmerger", sigma=1.0)
    n, d = 20, 16
    view, Qall = build(pol, H=2, G=G, n=n, d=d, seed=30)
    view.K[0] = run_keys(d, n, [range(3, 8), range(10, 13)], 31)
    view.K[1] = run_keys(d, n, [range(1, 4), range(6, 11)], 32)
    pol.observe(view)
    a = ref_attention_sum(view, Qall, range(n))
    torch.testing.assert_close(view.state["h2o"].double(), a, atol=1e-5, rtol=1e-5)
    for keep in (11, 14, 17):
        kept, (Km, Vm) = pol.evict(view, keep)
        ref_kept, rK, rV, info = ref_kvmerger(view.K, view.V, a, view.pos, n, keep, pol.params)
        assert kept.tolist() == ref_kept.tolist()
        torch.testing.assert_close(Km.double(), rK, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(Vm.double(), rV, atol=1e-5, rtol=1e-5)
        for h in range(2):  # each set sits in its pivot, the argmax of the accumulated attention
            for i, S in enumerate(info[h]["sets"]):
                assert kept[h, i] == max(S, key=lambda j: float(a[h, j]))


@pytest.mark.parametrize("chunk_bytes", [None, 8 * 16 * 70])
@pytest.mark.parametrize("threshold", [0.75, 0.0])
def test_kvmerger_rows_merged_together_equal_each_alone(monkeypatch, threshold, chunk_bytes):
    """``merge_columns`` over the packed tokens of several rows (ragged, compacted positions that
    differ by head, each its own length and keep, one that keeps nothing of what it may merge, one
    that does not compact)
    equals each row's ``merge`` alone: the same kept slots and the same merged K/V, bit for bit (each
    set's sum its own). No recent tokens: a row's last may link to nothing. ``chunk_bytes``: the
    rows merged at most 70 tokens at a time (rows 0-1, 2, 4-5), one head at a time."""
    from vllm_kvevict.kernels.torch_ops import Ragged, on_device
    from vllm_kvevict.policies import kvmerger
    from vllm_kvevict.policies.base import Columns, Packed

    calls, merge_heads = [], kvmerger._merge_heads
    monkeypatch.setattr(kvmerger, "_merge_heads", lambda K, *a: calls.append(K.shape[:2]) or merge_heads(K, *a))
    if chunk_bytes:
        monkeypatch.setattr(kvmerger, "MERGE_CHUNK_BYTES", chunk_bytes)

    pol = make_policy("kvmerger", threshold=threshold, sigma=2.0, recent_ratio=0.17 if threshold else 0.0)
    g = torch.Generator().manual_seed(5)
    shape = [(40, 55, 17), (1, 1, 1), (64, 64, 20), (30, 30, 0), (25, 90, 24), (33, 40, 32)]  # (n, L, keep)
    H, d = 3, 16
    views = []
    for r, (n, L, keep) in enumerate(shape):
        pos = torch.stack([torch.sort(torch.randperm(L - 1, generator=g)[: n - 1]).values for _ in range(H)])
        view, _ = build(pol, H=H, G=1, n=n, d=d, L=L, pos=torch.cat([pos, torch.full((H, 1), L - 1)], 1), seed=r)
        view.K[:, n // 3 : n // 2] = view.K[:, n // 3 : n // 3 + 1] + 0.1 * view.K[:, n // 3 : n // 2]  # a run
        view.state["h2o"] = torch.rand(H, n, generator=g)
        views.append((view, keep))
    cat = lambda f: torch.cat([f(v) for v, _ in views])  # noqa: E731
    lens = [n for n, _, _ in shape]
    cu = Ragged.of(lens, "cpu")
    cols = Columns(
        torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)),
        on_device([L for _, L, _ in shape], "cpu"),
        on_device([0] * len(lens), "cpu"),
        1,
        cu,
        tuple(L for _, L, _ in shape),
        tuple(k for _, _, k in shape),
    )
    x = Packed(
        None,
        cat(lambda v: v.pos.T),
        {"h2o": cat(lambda v: v.state["h2o"].T)},
        cat(lambda v: v.V.transpose(0, 1)),
        K=cat(lambda v: v.K.transpose(0, 1)),
    )
    score, Km, Vm = pol.merge_columns(x, cols)
    want = [(41, 1)] * 3 + [(64, 1)] * 3 + [(58, 1)] * 3 if chunk_bytes else [(105, 3), (58, 3)]
    assert [tuple(c) for c in calls] == want
    for r, (view, keep) in enumerate(views):
        sl = slice(cu.host[r], cu.host[r + 1])
        if keep == 0:  # a row that does not compact: not merged, nothing of it kept
            assert (score[sl] == float("-inf")).all() and torch.equal(Km[sl], view.K.transpose(0, 1)), r
            continue
        kept, merged = pol.merge(view, keep)
        assert torch.equal(topk_newer(score[sl].T, keep, view.pos), kept), r
        if merged is None:
            continue
        at = kept[..., None].expand(-1, -1, d)
        assert torch.equal(Km[sl].transpose(0, 1).gather(1, at), merged[0]), r
        assert torch.equal(Vm[sl].transpose(0, 1).gather(1, at), merged[1]), r
        assert threshold > 0.5 or not torch.equal(merged[0], view.K.gather(1, at)), "nothing merged"


# ---------------------------------------------------------------------------------------------
# LSH-E
# ---------------------------------------------------------------------------------------------


def ref_bits(x, R):
    """SimHash: bit b = [R_b . x >= 0]."""
    return [1 if sum(float(R[b, i]) * float(x[i]) for i in range(R.shape[1])) >= 0 else 0 for b in range(R.shape[0])]


def ref_lshe(K, Qall, G, budget, p, layer):
    """Token-by-token LSH-E over positions 0..n-1: (victim position per slot or -1, packed codes,
    the non-victim positions)."""
    H, n, d = K.shape
    R = _projection(p.seed, layer, p.bits, d)
    victims = [[-1] * n for _ in range(H)]
    codes = [[0] * n for _ in range(H)]
    lives = []
    for h in range(H):
        kc = [ref_bits(K[h, j], R) for j in range(n)]
        codes[h] = [sum(b << i for i, b in enumerate(c)) for c in kc]
        live = []
        for t in range(n):
            if len(live) >= budget:
                cands = [j for j in live if j >= p.sink_tokens and j < t - p.recent_tokens]
                if cands:
                    if p.hash == "query":
                        qc = [ref_bits(Qall[h * G + g, t], R) for g in range(G)]

                        def dist(j):
                            return sum(sum(x != y for x, y in zip(c, kc[j])) for c in qc)
                    else:

                        def dist(j):
                            return sum(x != y for x, y in zip(kc[t], kc[j]))

                    e = max(cands, key=lambda j: (dist(j), -j))  # farthest, ties: the oldest
                    victims[h][e] = t
                    live.remove(e)
            live.append(t)
        lives.append(sorted(live))
    return torch.tensor(victims), torch.tensor(codes), lives


def lshe_chunk_view(pol, K, V, Qall, G, lo, hi, budget, state, layer):
    return KVView(
        K=K[:, :hi].clone(),
        V=V[:, :hi].clone(),
        pos=torch.arange(hi).expand(K.shape[0], hi).clone(),
        layer=layer,
        G=G,
        L=hi,
        Q=Qall[:, lo:hi].clone(),
        q_pos=torch.arange(lo, hi),
        budget=budget,
        state=state,
    )


def lshe_run_chunks(pol, K, V, Qall, G, budget, bounds, layer):
    """Observe chunk by chunk (no compaction in between), carrying the state."""
    H = K.shape[0]
    state = None
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        new = fresh_state(pol, H, hi - lo)
        state = new if state is None else {k: torch.cat([state[k], new[k]], dim=1) for k in new}
        view = lshe_chunk_view(pol, K, V, Qall, G, lo, hi, budget, state, layer)
        pol.observe(view)
        state = view.state
    return view


@pytest.mark.parametrize("hash_mode", ["query", "key"])
@pytest.mark.parametrize("bits", [16, 3])
@pytest.mark.parametrize("G", [1, 2])
def test_lshe_sequential_victims(hash_mode, bits, G):
    n, budget, layer = 40, 16, 3
    pol = make_policy("lshe", bits=bits, hash=hash_mode)
    p = pol.params
    assert (p.sink_tokens, p.recent_tokens, p.seed) == (4, 10, 0)
    _, Qall = build(pol, H=2, G=G, n=n, d=8, seed=40 + bits)
    g = torch.Generator().manual_seed(41)
    K, V = torch.randn(2, n, 8, generator=g), torch.randn(2, n, 8, generator=g)
    K[:, 20] = 0.0  # a zero key: every bit set
    K[:, 25] = K[:, 24]  # a duplicate
    one = lshe_run_chunks(pol, K, V, Qall, G, budget, [0, n], layer)
    two = lshe_run_chunks(pol, K, V, Qall, G, budget, [0, 17, n], layer)
    three = lshe_run_chunks(pol, K, V, Qall, G, budget, [0, 5, 31, n], layer)
    for other in (two, three):
        for k in one.state:
            assert torch.equal(one.state[k], other.state[k])
    victims, codes, lives = ref_lshe(K, Qall, G, budget, p, layer)
    assert torch.equal(one.state["lsh_victim"], victims)
    assert torch.equal(one.state["lsh_code"], codes)
    # after the prompt: exactly `budget` non-victims per head; the compaction keeps them
    assert all(len(lv) == budget for lv in lives)
    kept, merged = pol.evict(one, budget)
    assert merged is None and kept.tolist() == lives
    assert (one.state["lsh_victim"] >= 0).sum(1).tolist() == [n - budget] * 2
    # victims: evicted by a later token, never a sink or a recent token
    for h in range(2):
        for j, t in enumerate(one.state["lsh_victim"][h].tolist()):
            if t >= 0:
                assert j >= 4 and j < t - 10


def test_lshe_compaction_between_chunks_matches_one_chunk():
    # Victims are dropped at the compaction after each chunk; the survivors are the same as in
    # one pass in which victims merely stay flagged.
    n, budget, layer, G, H, d = 36, 15, 0, 2, 2, 8
    pol = make_policy("lshe", bits=8)
    _, Qall = build(pol, H=H, G=G, n=n, d=d, seed=50)
    g = torch.Generator().manual_seed(51)
    K, V = torch.randn(H, n, d, generator=g), torch.randn(H, n, d, generator=g)
    one = lshe_run_chunks(pol, K, V, Qall, G, budget, [0, n], layer)
    _, _, lives = ref_lshe(K, Qall, G, budget, pol.params, layer)
    Kc, Vc, pos, state = K[:, :0], V[:, :0], torch.zeros(H, 0, dtype=torch.long), None
    for lo, hi in ((0, 20), (20, 29), (29, n)):
        new = fresh_state(pol, H, hi - lo)
        state = new if state is None else {k: torch.cat([state[k], new[k]], dim=1) for k in new}
        Kc, Vc = torch.cat([Kc, K[:, lo:hi]], 1), torch.cat([Vc, V[:, lo:hi]], 1)
        pos = torch.cat([pos, torch.arange(lo, hi).expand(H, hi - lo)], 1)
        view = KVView(
            K=Kc,
            V=Vc,
            pos=pos,
            layer=layer,
            G=G,
            L=hi,
            Q=Qall[:, lo:hi].clone(),
            q_pos=torch.arange(lo, hi),
            budget=budget,
            state=state,
        )
        pol.observe(view)
        keep = min(budget, pos.shape[1])
        kept, _ = pol.evict(view, keep)
        assert (torch.gather(view.state["lsh_victim"], 1, kept) < 0).all()
        idx = kept[..., None].expand(-1, -1, d)
        Kc, Vc, pos = torch.gather(Kc, 1, idx), torch.gather(Vc, 1, idx), torch.gather(pos, 1, kept)
        state = {k: torch.gather(t, 1, kept) for k, t in view.state.items()}
    assert pos.tolist() == lives
    assert pos.tolist() == pol.evict(one, budget)[0].tolist()


# ---------------------------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------------------------


def draw_view(data, pol, *, min_n, max_n=24, window=0, compact=True):
    H = data.draw(st.sampled_from([1, 2]), label="H")
    G = data.draw(st.sampled_from([1, 2]), label="G")
    n = data.draw(st.integers(min_n, max_n), label="n")
    d = data.draw(st.sampled_from([2, 4, 8]), label="d")
    m = data.draw(st.integers(1, n), label="m")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    extra = data.draw(st.integers(0, 6), label="evicted before") if compact else 0
    L = n + extra
    pos = compacted_pos(H, n, L, max(m, window), seed) if extra else None
    view, Qall = build(pol, H=H, G=G, n=n, d=d, D=5, L=L, pos=pos, m=m, seed=seed)
    for j in data.draw(st.lists(st.integers(0, n - 1), max_size=n), label="zero keys"):
        view.K[:, j] = 0.0
    for j in data.draw(st.lists(st.integers(0, n - 1), max_size=3), label="zero values"):
        view.V[:, j] = 0.0
    for i, j in data.draw(
        st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=4), label="duplicate keys"
    ):
        view.K[:, j] = view.K[:, i]
    if data.draw(st.booleans(), label="runs of equal keys"):
        for j in range(1, n, 3):
            view.K[:, j] = view.K[:, j - 1]
    return view, Qall


def clone_view(v):
    return KVView(
        K=v.K.clone(),
        V=v.V.clone(),
        pos=v.pos.clone(),
        layer=v.layer,
        G=v.G,
        L=v.L,
        Q=v.Q.clone(),
        q_pos=v.q_pos.clone(),
        scale=v.scale,
        softcap=v.softcap,
        W_O=v.W_O.clone(),
        budget=v.budget,
        keep=v.keep,
        state={k: t.clone() for k, t in v.state.items()},
    )


def check_kept(kept, H, n, keep):
    assert kept.shape == (H, keep) and kept.dtype == torch.int64
    assert ((kept >= 0) & (kept < n)).all()
    assert (kept[:, 1:] > kept[:, :-1]).all()  # unique, ascending


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_criticalkv(data):
    base = data.draw(st.sampled_from(["snapkv", "snapkv", "tova", "h2o"]), label="base")
    window = data.draw(st.integers(1, 4), label="window")
    alpha = data.draw(st.sampled_from([0.0, 0.25, 0.5, 1.0]), label="alpha")
    pol = make_policy(
        "criticalkv",
        base=base,
        alpha=alpha,
        snapkv={"window": window, "pooling": data.draw(st.sampled_from(["max", "avg"]))},
    )
    view, _ = draw_view(data, pol, min_n=window + 1, window=window if base == "snapkv" else 0)
    H, n = view.pos.shape
    keep = data.draw(st.integers(pol.params.min_budget(), n), label="keep")
    v2 = clone_view(view)
    if pol.needs.observes:
        pol.observe(view)
    view.keep = keep
    s = pol.score(view)
    assert not torch.isnan(s).any() and not (s == -INF).any()
    kept, merged = pol.evict(view, keep)
    assert merged is None
    check_kept(kept, H, n, keep)
    if base == "snapkv":
        for h in range(H):
            win = torch.nonzero(view.pos[h] >= view.L - window).flatten().tolist()
            assert set(win) <= set(kept[h].tolist())
    # every +inf slot (window and stage 1) is kept
    for h in range(H):
        assert set(torch.nonzero(torch.isinf(s[h])).flatten().tolist()) <= set(kept[h].tolist())
    if pol.needs.observes:
        pol.observe(v2)
    assert torch.equal(pol.evict(v2, keep)[0], kept)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_kvmerger(data):
    pol = make_policy(
        "kvmerger",
        threshold=data.draw(st.sampled_from([0.75, 0.0, -1.0, 0.99]), label="threshold"),
        sigma=data.draw(st.sampled_from([5.0, 0.1]), label="sigma"),
        recent_ratio=data.draw(st.sampled_from([0.17, 0.0, 0.5]), label="recent"),
        heavy_ratio=data.draw(st.sampled_from([0.12, 0.0, 0.4]), label="heavy"),
        value_scale=data.draw(st.sampled_from(["set_size", "none"]), label="value_scale"),
    )
    view, _ = draw_view(data, pol, min_n=1)
    H, n = view.pos.shape
    keep = data.draw(st.integers(1, n), label="keep")
    K0, V0 = view.K.clone(), view.V.clone()
    v2 = clone_view(view)
    pol.observe(view)
    a = view.state["h2o"]
    assert torch.isfinite(a).all()
    kept, merged = pol.evict(view, keep)
    check_kept(kept, H, n, keep)
    assert torch.equal(view.K, K0) and torch.equal(view.V, V0)
    if keep == n:
        assert merged is None
    else:
        Km, Vm = merged
        assert Km.shape == (H, keep, view.K.shape[-1]) and Vm.shape == Km.shape
        assert torch.isfinite(Km).all() and torch.isfinite(Vm).all()
        # protected: recent tokens and heavy hitters, unchanged in their slots
        p = pol.params
        n_recent, n_heavy = int(p.recent_ratio * n), int(p.heavy_ratio * n)
        if n_recent + n_heavy > keep:
            shrink = keep / (n_recent + n_heavy)
            n_recent, n_heavy = int(n_recent * shrink), int(n_heavy * shrink)
        for h in range(H):
            recent = [j for j in range(n) if int(view.pos[h, j]) >= view.L - n_recent]
            heavy = top_by(a[h], view.pos[h], [j for j in range(n) if j not in recent], n_heavy)
            row = kept[h].tolist()
            for j in recent + heavy:
                assert j in row
                i = row.index(j)
                assert torch.equal(Km[h, i], K0[h, j]) and torch.equal(Vm[h, i], V0[h, j])
    pol.observe(v2)
    kept2, merged2 = pol.evict(v2, keep)
    assert torch.equal(kept, kept2)
    if merged is not None:
        assert torch.equal(merged[0], merged2[0]) and torch.equal(merged[1], merged2[1])


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_lshe(data):
    sinks = data.draw(st.integers(0, 4), label="sinks")
    recent = data.draw(st.integers(0, 10), label="recent")
    pol = make_policy(
        "lshe",
        sink_tokens=sinks,
        recent_tokens=recent,
        bits=data.draw(st.integers(1, 20), label="bits"),
        hash=data.draw(st.sampled_from(["query", "key"]), label="hash"),
        seed=data.draw(st.integers(0, 5), label="policy seed"),
    )
    mb = pol.params.min_budget()
    view, Qall = draw_view(data, pol, min_n=mb, max_n=30, compact=False)
    H, n = view.pos.shape
    budget = data.draw(st.integers(mb, n), label="budget")
    cuts = sorted({c for c in data.draw(st.lists(st.integers(1, max(1, n - 1)), max_size=3), label="chunks") if c < n})
    bounds = [0, *cuts, n]
    one = lshe_run_chunks(pol, view.K, view.V, Qall, view.G, budget, [0, n], view.layer)
    many = lshe_run_chunks(pol, view.K, view.V, Qall, view.G, budget, bounds, view.layer)
    for k in one.state:  # chunking does not change the decisions
        assert torch.equal(one.state[k], many.state[k])
    victim = one.state["lsh_victim"]
    assert ((victim < 0).sum(1) == min(n, budget)).all()  # the budget holds
    for h in range(H):
        for j, t in enumerate(victim[h].tolist()):
            if t >= 0:
                assert sinks <= j < t - recent
    s = pol.score(one)
    assert torch.isfinite(s).all()
    keep = data.draw(st.integers(budget, n), label="keep")
    kept, merged = pol.evict(one, keep)
    assert merged is None
    check_kept(kept, H, n, keep)
    for h in range(H):
        row = set(kept[h].tolist())
        assert set(torch.nonzero(victim[h] < 0).flatten().tolist()) <= row  # sinks, recent, survivors
        assert set(range(min(sinks, n))) <= row and set(range(max(0, n - recent), n)) <= row
    again = lshe_run_chunks(pol, view.K, view.V, Qall, view.G, budget, bounds, view.layer)
    assert torch.equal(pol.evict(again, keep)[0], kept)
