# SPDX-License-Identifier: Apache-2.0
"""The attention/norm baselines (SnapKV, TOVA, H2O, K-norm, Random) and CAOTE/FastCAOTE against the
formulas of ALGORITHMS.md 0.2 and 5, recomputed here independently with explicit loops (no helper of
the policy modules is used), plus hypothesis property tests of the eviction contract."""

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
    ref_keep,
    ref_pool,
)
from vllm_kvevict.policies import POLICIES, KVView, get_policy

# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Independent reference math (float64, explicit loops)
# ---------------------------------------------------------------------------------------------


def scale_of(view):
    return view.scale if view.scale is not None else 1.0 / math.sqrt(view.K.shape[-1])


def ref_mean_attention(view, Qall, qpositions):
    """``[H_q, n]``: attention of the queries at ``qpositions``, averaged over those queries."""
    H, n, _ = view.K.shape
    out = torch.zeros(H * view.G, n, dtype=torch.float64)
    for hq in range(H * view.G):
        h = hq // view.G
        for p in qpositions:
            out[hq] += attn_row(Qall[hq, p], view.K[h], view.pos[h], p, scale_of(view), view.softcap)
        out[hq] /= len(qpositions)
    return out


def ref_column_sums(view, Qall, qpositions):
    return ref_mean_attention(view, Qall, qpositions) * len(qpositions)


def ref_group_mean(x, G):
    H = x.shape[0] // G
    out = torch.zeros(H, *x.shape[1:], dtype=torch.float64)
    for h in range(H):
        for g in range(G):
            out[h] += x[h * G + g]
        out[h] /= G
    return out


def ref_snapkv(view, Qall, window, kernel=7, pooling="avg"):
    """(scores ``[H_kv, n]`` with the window's raw mean attention, window mask ``[H_kv, n]``)."""
    L = view.L
    A = ref_mean_attention(view, Qall, list(range(L - window, L)))  # [H_q, n]
    H, n = view.pos.shape
    pooled = torch.zeros_like(A)
    win = view.pos >= L - window
    for hq in range(A.shape[0]):
        h = hq // view.G
        pre = [j for j in range(n) if not bool(win[h, j])]
        assert pre == list(range(len(pre)))  # the window is the last slots
        pooled[hq, : len(pre)] = ref_pool(A[hq, : len(pre)], kernel, pooling)
        pooled[hq, len(pre) :] = A[hq, len(pre) :]
    return ref_group_mean(pooled, view.G), win


# ---------------------------------------------------------------------------------------------
# SnapKV
# ---------------------------------------------------------------------------------------------


def test_snapkv_defaults():
    p = POLICIES["snapkv"].Params()
    assert (p.window, p.kernel, p.pooling) == (32, 7, "avg")
    assert get_policy("snapkv").needs.query_window == 32


@pytest.mark.parametrize("pooling", ["avg", "max"])
@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("compacted", [False, True])
def test_snapkv_matches_pooled_window_attention(pooling, G, compacted):
    window, n = 5, 26
    pol = make_policy("snapkv", window=window, kernel=7, pooling=pooling)
    if compacted:  # heads hold different older positions; masking must follow positions
        L = 40
        view, Qall = build(pol, G=G, n=n, L=L, pos=compacted_pos(2, n, L, window, seed=3), m=1, seed=1)
    else:
        view, Qall = build(pol, G=G, n=n, m=3, seed=1)
    ref, win = ref_snapkv(view, Qall, window, 7, pooling)
    expected = ref.masked_fill(win, INF)
    scores = pol.score(view)
    assert_scores(scores, expected)
    assert int(win[0].sum()) == window
    for keep in (window + 1, 12, n - 1):
        kept, merged = pol.evict(view, keep)
        assert merged is None
        assert torch.equal(kept, ref_keep(expected, view.pos, keep))
        for h in range(2):  # the window's slots are always kept
            assert set(range(n - window, n)) <= set(kept[h].tolist())


def test_snapkv_avg_pool_counts_zero_padding():
    # One prefix slot carries all the prefix attention: its pooled neighbours get exactly A/7,
    # including at the border (the zero padding counts in the divisor).
    pol = make_policy("snapkv", window=2, kernel=7, pooling="avg")
    view, Qall = build(pol, H=1, G=1, n=12, d=4, seed=5)
    view.K[:] = 0.0
    view.K[0, 1] = torch.tensor([30.0, 0, 0, 0])
    view.Q[:] = torch.tensor([1.0, 0, 0, 0])
    Qall[:, -2:] = torch.tensor([1.0, 0, 0, 0])
    ref, win = ref_snapkv(view, Qall, 2, 7, "avg")
    s = pol.score(view)
    assert_scores(s, ref.masked_fill(win, INF))
    a1 = float(ref_mean_attention(view, Qall, [10, 11])[0, 1])
    assert a1 > 0.99
    # slots 0..4 see slot 1 within their kernel: ~a1/7 each (plus tiny leaks from the other slots)
    for j in range(0, 5):
        assert abs(float(s[0, j]) - a1 / 7) < 1e-3


# ---------------------------------------------------------------------------------------------
# TOVA
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("compacted", [False, True])
def test_tova_last_query_group_mean(G, compacted):
    pol = make_policy("tova")
    if compacted:
        L, n = 37, 20
        view, Qall = build(pol, G=G, n=n, L=L, pos=compacted_pos(2, n, L, 4, seed=7), m=4, seed=2)
    else:
        n = 20
        view, Qall = build(pol, G=G, n=n, m=4, seed=2, scale=0.7, softcap=2.0)
    L = view.L
    ref = ref_group_mean(ref_mean_attention(view, Qall, [L - 1]), G)
    scores = pol.score(view)
    assert_scores(scores, ref)
    torch.testing.assert_close(scores.sum(-1).double(), torch.ones(2, dtype=torch.float64), atol=1e-5, rtol=0)
    for keep in (1, 7, n - 1):
        kept, merged = pol.evict(view, keep)
        assert merged is None
        assert torch.equal(kept, ref_keep(ref, view.pos, keep))


# ---------------------------------------------------------------------------------------------
# H2O
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("G", [1, 2])
def test_h2o_accumulates_column_sums_over_steps(G):
    recent, n1, n, H = 3, 9, 21, 2
    pol = make_policy("h2o", recent_tokens=recent)
    (name,) = pol.needs.state
    full, Qall = build(pol, H=H, G=G, n=n, m=n - n1, seed=4)
    # step 1: the first n1 tokens (their queries); step 2: the rest appended, state carried over
    v1 = KVView(
        K=full.K[:, :n1].clone(),
        V=full.V[:, :n1].clone(),
        pos=full.pos[:, :n1].clone(),
        G=G,
        L=n1,
        Q=Qall[:, :n1].clone(),
        q_pos=torch.arange(n1),
        budget=n,
        state=fresh_state(pol, H, n1),
    )
    pol.observe(v1)
    torch.testing.assert_close(
        v1.state[name].double(), ref_group_mean(ref_column_sums(v1, Qall, range(n1)), G), atol=1e-5, rtol=1e-5
    )
    carried = torch.cat([v1.state[name], torch.zeros(H, n - n1)], dim=1)
    v2 = KVView(
        K=full.K,
        V=full.V,
        pos=full.pos,
        G=G,
        L=n,
        Q=Qall[:, n1:].clone(),
        q_pos=torch.arange(n1, n),
        budget=n,
        state={name: carried},
    )
    pol.observe(v2)
    ref = ref_group_mean(ref_column_sums(v2, Qall, range(n)), G)  # the full causal matrix, every query
    torch.testing.assert_close(v2.state[name].double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref.sum(-1), torch.full((H,), float(n), dtype=torch.float64))
    expected = ref.masked_fill(v2.pos >= n - recent, INF)
    assert_scores(pol.score(v2), expected)
    for keep in (recent + 1, 10, n - 1):
        kept, merged = pol.evict(v2, keep)
        assert merged is None
        assert torch.equal(kept, ref_keep(expected, v2.pos, keep))
        assert set(range(n - recent, n)) <= set(kept[0].tolist())


def test_h2o_default_reserves_no_recent_window():
    pol = make_policy("h2o")
    view, Qall = build(pol, H=2, G=2, n=12, seed=8)
    pol.observe(view)
    assert torch.isfinite(pol.score(view)).all()


# ---------------------------------------------------------------------------------------------
# K-norm
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compacted", [False, True])
def test_knorm_lowest_norm_with_sinks_and_recent(compacted):
    pol = make_policy("knorm")
    assert (pol.params.sink_tokens, pol.params.recent_tokens) == (4, 10)
    n = 24
    if compacted:
        L = 40
        pos = compacted_pos(2, n, L, 10, seed=11)
        view, _ = build(pol, G=1, n=n, L=L, pos=pos, seed=9)
    else:
        L = n
        view, _ = build(pol, G=1, n=n, seed=9)
    # Varied norms so the ranking is not decided by noise.
    view.K *= torch.linspace(0.2, 3.0, n).flip(0)[None, :, None]
    expected = torch.zeros(2, n, dtype=torch.float64)
    for h in range(2):
        for j in range(n):
            p = int(view.pos[h, j])
            if p < 4 or p >= L - 10:
                expected[h, j] = INF
            else:
                expected[h, j] = -math.sqrt(sum(float(x) ** 2 for x in view.K[h, j]))
    assert_scores(pol.score(view), expected)
    for keep in (15, 18, n - 1):
        kept, merged = pol.evict(view, keep)
        assert merged is None
        assert torch.equal(kept, ref_keep(expected, view.pos, keep))


# ---------------------------------------------------------------------------------------------
# Random
# ---------------------------------------------------------------------------------------------


def test_random_seeded_reproducible_and_batch_independent():
    n = 30
    pol = make_policy("random", seed=7)
    view, _ = build(pol, G=1, n=n, seed=0)
    s = pol.score(view)
    assert ((s >= 0) & (s < 1)).all()
    kept1 = pol.evict(view, 12)[0]
    # same seed, a new policy object and other K/V: same kept set
    view2, _ = build(pol, G=1, n=n, seed=123)
    assert torch.equal(make_policy("random", seed=7).evict(view2, 12)[0], kept1)
    assert torch.equal(pol.evict(view, 12)[0], kept1)
    # a token's score does not depend on the other tokens of the view
    sub = torch.stack([torch.tensor([0, 3, 4, 9, 17, 29]), torch.tensor([1, 2, 8, 20, 28, 29])])
    vs = KVView(
        K=torch.gather(view.K, 1, sub[..., None].expand(-1, -1, view.K.shape[-1])),
        V=torch.gather(view.V, 1, sub[..., None].expand(-1, -1, view.V.shape[-1])),
        pos=sub.clone(),
        L=n,
    )
    assert torch.equal(pol.score(vs), torch.gather(s, 1, sub))
    # ... so the kept set of a sub-view is the top of the full ranking restricted to it
    assert torch.equal(pol.evict(vs, 3)[0], ref_keep(torch.gather(s, 1, sub).double(), sub, 3))
    # heads and layers draw differently; another seed gives another kept set
    assert not torch.equal(s[0], s[1])
    view.layer = 1
    assert not torch.equal(pol.score(view), s)
    view.layer = 0
    others = [make_policy("random", seed=k).evict(view, 12)[0] for k in (0, 1, 8, 99)]
    assert all(not torch.equal(o, kept1) for o in others)


# ---------------------------------------------------------------------------------------------
# CAOTE / FastCAOTE
# ---------------------------------------------------------------------------------------------


def ref_caote(h, V, fast):
    """Eq. 21 / 23 per KV head: c_j = h_j/(1-h_j) * ||X - v_j||_2 with h normalised to sum 1."""
    H, n = h.shape
    out = torch.zeros(H, n, dtype=torch.float64)
    for k in range(H):
        tot = sum(float(x) for x in h[k])
        hn = [float(x) / tot for x in h[k]]
        vs = [V[k, j].double() for j in range(n)]
        X = sum(vs) / n if fast else sum(hn[j] * vs[j] for j in range(n))
        for j in range(n):
            out[k, j] = hn[j] / max(1 - hn[j], 1e-6) * math.sqrt(float(((X - vs[j]) ** 2).sum()))
    return out


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("base", ["h2o", "tova", "snapkv"])
@pytest.mark.parametrize("G", [1, 2])
def test_caote_closed_form_error(fast, base, G):
    name = "fastcaote" if fast else "caote"
    window, n = 4, 22
    pol = make_policy(name, base=base, snapkv={"window": window})
    assert pol.needs.attention
    view, Qall = build(pol, G=G, n=n, m=n if base == "h2o" else 3, seed=12)
    assert view.Q.shape[1] == {"h2o": n, "tova": 1, "snapkv": window}[base]
    if pol.needs.observes:
        pol.observe(view)
    L = view.L
    protected = torch.zeros(2, n, dtype=torch.bool)
    if base == "h2o":
        h = ref_group_mean(ref_column_sums(view, Qall, range(L)), G)
    elif base == "tova":
        h = ref_group_mean(ref_mean_attention(view, Qall, [L - 1]), G)
    else:  # prefix: avg-pooled window attention; the window's slots: their raw mean attention
        h, protected = ref_snapkv(view, Qall, window, 7, "avg")
    expected = ref_caote(h, view.V, fast).masked_fill(protected, INF)
    assert_scores(pol.score(view), expected)
    for keep in (window + 1, 11, n - 1):
        kept, merged = pol.evict(view, keep)
        assert merged is None
        assert torch.equal(kept, ref_keep(expected, view.pos, keep))


def test_caote_tova_single_token_is_output_change():
    # Thm 3.2 with G = 1 and TOVA: c_j is exactly || X_attn - X'_attn,j ||, the change of the
    # attention output when j alone is evicted and the rest renormalised.
    pol = make_policy("caote", base="tova")
    view, Qall = build(pol, H=1, G=1, n=9, seed=13)
    a = attn_row(Qall[0, 8], view.K[0], view.pos[0], 8, scale_of(view))
    Vd = view.V[0].double()
    X = (a[:, None] * Vd).sum(0)
    s = pol.score(view)
    for j in range(9):
        keepmask = torch.ones(9, dtype=torch.bool)
        keepmask[j] = False
        a2 = a[keepmask] / a[keepmask].sum()
        X2 = (a2[:, None] * Vd[keepmask]).sum(0)
        assert abs(float(s[0, j]) - float((X - X2).norm())) < 1e-5


# ---------------------------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------------------------


def draw_view(data, pol, *, min_n, window=0):
    """A random small view with zero keys, zero values and duplicate keys; maybe compacted."""
    H = data.draw(st.sampled_from([1, 2]), label="H")
    G = data.draw(st.sampled_from([1, 2]), label="G")
    n = data.draw(st.integers(min_n, 24), label="n")
    d = data.draw(st.sampled_from([2, 4, 8]), label="d")
    m = data.draw(st.integers(1, n), label="m")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    extra = data.draw(st.integers(0, 6), label="evicted before")
    tail = max(m, window)
    L = n + extra
    pos = compacted_pos(H, n, L, tail, seed) if extra else None
    view, _ = build(pol, H=H, G=G, n=n, d=d, L=L, pos=pos, m=m, seed=seed)
    for j in data.draw(st.lists(st.integers(0, n - 1), max_size=n), label="zero keys"):
        view.K[:, j] = 0.0
    for j in data.draw(st.lists(st.integers(0, n - 1), max_size=3), label="zero values"):
        view.V[:, j] = 0.0
    for i, j in data.draw(
        st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=4), label="duplicate keys"
    ):
        view.K[:, j] = view.K[:, i]
    return view


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


def run_policy(pol, view, keep):
    if pol.needs.observes:
        pol.observe(view)
    s = pol.score(view)
    kept, merged = pol.evict(view, keep)
    return s, kept, merged


def check_contract(pol, view, keep, protected):
    K0, V0, pos0 = view.K.clone(), view.V.clone(), view.pos.clone()
    v2 = clone_view(view)
    s, kept, merged = run_policy(pol, view, keep)
    H, n = view.pos.shape
    assert not torch.isnan(s).any() and not (s == -INF).any()
    assert kept.shape == (H, keep) and kept.dtype == torch.int64
    assert ((kept >= 0) & (kept < n)).all()
    assert (kept[:, 1:] > kept[:, :-1]).all()  # unique, ascending
    assert merged is None
    for h in range(H):
        assert set(torch.nonzero(protected[h]).flatten().tolist()) <= set(kept[h].tolist())
    assert torch.equal(view.K, K0) and torch.equal(view.V, V0) and torch.equal(view.pos, pos0)
    s2, kept2, _ = run_policy(pol, v2, keep)  # deterministic
    assert torch.equal(kept, kept2)
    assert torch.equal(s.nan_to_num(posinf=1e30), s2.nan_to_num(posinf=1e30))


def draw_keep(data, pol, n):
    mb = pol.params.min_budget()
    return data.draw(st.integers(min(mb, n), n), label="keep")


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_snapkv(data):
    window = data.draw(st.integers(1, 4), label="window")
    pol = make_policy(
        "snapkv",
        window=window,
        kernel=data.draw(st.sampled_from([1, 3, 7])),
        pooling=data.draw(st.sampled_from(["avg", "max"])),
    )
    view = draw_view(data, pol, min_n=window + 1, window=window)
    keep = draw_keep(data, pol, view.pos.shape[1])
    check_contract(pol, view, keep, view.pos >= view.L - window)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_tova(data):
    pol = make_policy("tova")
    view = draw_view(data, pol, min_n=1)
    keep = draw_keep(data, pol, view.pos.shape[1])
    check_contract(pol, view, keep, torch.zeros_like(view.pos, dtype=torch.bool))


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_h2o(data):
    recent = data.draw(st.integers(0, 4), label="recent")
    pol = make_policy("h2o", recent_tokens=recent)
    view = draw_view(data, pol, min_n=recent + 1)
    keep = draw_keep(data, pol, view.pos.shape[1])
    check_contract(pol, view, keep, view.pos >= view.L - recent)
    assert torch.isfinite(view.state["h2o"]).all() and (view.state["h2o"] >= 0).all()


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_knorm(data):
    sinks, recent = data.draw(st.integers(0, 4), label="sinks"), data.draw(st.integers(0, 6), label="recent")
    pol = make_policy("knorm", sink_tokens=sinks, recent_tokens=recent)
    view = draw_view(data, pol, min_n=sinks + recent + 1, window=recent)
    keep = draw_keep(data, pol, view.pos.shape[1])
    check_contract(pol, view, keep, (view.pos < sinks) | (view.pos >= view.L - recent))


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_random(data):
    pol = make_policy("random", seed=data.draw(st.integers(0, 1000), label="policy seed"))
    view = draw_view(data, pol, min_n=1)
    keep = draw_keep(data, pol, view.pos.shape[1])
    check_contract(pol, view, keep, torch.zeros_like(view.pos, dtype=torch.bool))


@pytest.mark.parametrize("name", ["caote", "fastcaote"])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_caote(name, data):
    base = data.draw(st.sampled_from(["h2o", "tova", "snapkv"]), label="base")
    window = data.draw(st.integers(1, 4), label="window")
    pol = make_policy(name, base=base, snapkv={"window": window})
    view = draw_view(data, pol, min_n=window + 1, window=window if base == "snapkv" else 0)
    keep = draw_keep(data, pol, view.pos.shape[1])
    protected = view.pos >= view.L - window if base == "snapkv" else torch.zeros_like(view.pos, dtype=torch.bool)
    check_contract(pol, view, keep, protected)
