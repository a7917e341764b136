# SPDX-License-Identifier: Apache-2.0
"""Shared by the policy unit tests: views with every input explicit, and reference math written
with plain loops in float64 (nothing from the policy modules)."""

from __future__ import annotations

import math
from dataclasses import fields, replace

import torch

from vllm_kvevict.policies import POLICIES, KVView, get_policy

INF = float("inf")


def make_policy(name, **kw):
    return get_policy(name, POLICIES[name].Params(**kw))


def on_device(view: KVView, device) -> KVView:
    """``view`` with every tensor, per-slot state included, on ``device`` (a GPU where there is one:
    what the engine hands a policy there)."""

    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(device)
        return {k: move(v) for k, v in x.items()} if isinstance(x, dict) else x

    return replace(view, **{f.name: move(getattr(view, f.name)) for f in fields(view)})


def fresh_state(policy, H, n):
    return {k: torch.full((H, n), init, dtype=dt) for k, (dt, init) in policy.needs.state.items()}


def compacted_pos(H, n, L, tail, seed):
    """``[H, n]`` ascending positions < L per head: the last ``tail`` positions plus a random
    subset of the older ones (what a head holds after earlier compactions)."""
    g = torch.Generator().manual_seed(seed + 991)
    rows = []
    for _ in range(H):
        older = torch.randperm(L - tail, generator=g)[: n - tail].sort().values
        rows.append(torch.cat([older, torch.arange(L - tail, L)]))
    return torch.stack(rows)


def build(
    policy,
    *,
    H=2,
    G=2,
    n=24,
    d=8,
    D=12,
    L=None,
    pos=None,
    m=None,
    w=None,
    seed=0,
    scale=None,
    softcap=None,
    budget=None,
    layer=0,
):
    """A view with every input explicit. ``Qall [H*G, L, d]``: one query per position of the
    sequence; Q = what the policy reads of them (``Needs.queries``): the last w (its query window,
    or ``w``), the last one (``newest``), or the last m (this step's)."""
    g = torch.Generator().manual_seed(seed)
    L = n if L is None else L
    K = torch.randn(H, n, d, generator=g)
    V = torch.randn(H, n, d, generator=g)
    Qall = torch.randn(H * G, L, d, generator=g)
    W_O = torch.randn(H * G, d, D, generator=g) / math.sqrt(d)
    if pos is None:
        assert L == n
        pos = torch.arange(n).expand(H, n).clone()
    m = n if m is None else m
    w = policy.needs.query_window if w is None else w
    if w:
        Q, q_pos = Qall[:, L - w :].clone(), torch.arange(L - w, L)
    else:
        Q, q_pos = Qall[:, L - m :].clone(), torch.arange(L - m, L)
        if policy.needs.queries == "newest":
            Q, q_pos = Q[:, -1:], q_pos[-1:]
    view = KVView(
        K=K,
        V=V,
        pos=pos,
        layer=layer,
        G=G,
        L=L,
        Q=Q,
        q_pos=q_pos,
        scale=scale,
        softcap=softcap,
        W_O=W_O,
        budget=budget if budget is not None else n,
        state=fresh_state(policy, H, n),
    )
    return view, Qall


def attn_row(q, Kh, posh, p, scale, softcap=None):
    """softmax(q k_j * scale) over the keys with position <= p (0 elsewhere), float64 ``[n]``."""
    n = Kh.shape[0]
    logits = [float((q.double() * Kh[j].double()).sum()) * scale for j in range(n)]
    if softcap:
        logits = [softcap * math.tanh(s / softcap) for s in logits]
    visible = [j for j in range(n) if int(posh[j]) <= p]
    mx = max(logits[j] for j in visible)
    e = [math.exp(logits[j] - mx) if j in visible else 0.0 for j in range(n)]
    tot = sum(e)
    return torch.tensor([x / tot for x in e], dtype=torch.float64)


def ref_pool(x, kernel, mode):
    """Stride 1, same length; avg counts the zero padding (F.avg_pool1d), max ignores it."""
    n, r = len(x), kernel // 2
    out = []
    for i in range(n):
        vals = [float(x[j]) for j in range(i - r, i + r + 1) if 0 <= j < n]
        out.append(sum(vals) / kernel if mode == "avg" else max(vals))
    return torch.tensor(out, dtype=torch.float64)


def ref_keep(scores, pos, keep):
    """Kept slots per head: the ``keep`` best by (score desc, position desc), in slot order."""
    out = []
    for h in range(scores.shape[0]):
        s, p = scores[h].tolist(), pos[h].tolist()
        order = sorted(range(len(s)), key=lambda j: (-s[j], -p[j]))
        out.append(sorted(order[:keep]))
    return torch.tensor(out)


def assert_scores(actual, expected, atol=1e-5, rtol=1e-5):
    """Same +inf (protected) pattern; the finite scores agree."""
    assert actual.shape == expected.shape
    inf_a, inf_e = torch.isinf(actual), torch.isinf(expected)
    assert torch.equal(inf_a, inf_e)
    assert (actual[inf_a] > 0).all()
    torch.testing.assert_close(actual[~inf_a].double(), expected[~inf_e].double(), atol=atol, rtol=rtol)
