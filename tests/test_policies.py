# SPDX-License-Identifier: Apache-2.0
"""Policy scores on small tensors, checked against the papers' formulas computed here independently."""

from __future__ import annotations

import torch

from vllm_kvevict.policies import POLICIES, KVView, get_policy
from vllm_kvevict.policies.base import topk_newer


def _view(h=2, n=24, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    K = torch.randn(h, n, d, generator=g)
    V = torch.randn(h, n, d, generator=g)
    pos = torch.arange(n).expand(h, n).clone()
    return KVView(K=K, V=V, pos=pos)


def test_registry_names():
    assert set(POLICIES) >= {"none", "keydiff", "streamingllm"}
    for name, cls in POLICIES.items():
        assert cls.name == name


def test_keydiff_ranks_like_pairwise_cosine_eq7():
    v = _view()
    scores = get_policy("keydiff").score(v)
    for h in range(v.K.shape[0]):
        K = v.K[h].double()
        Kn = K / K.norm(dim=-1, keepdim=True)
        pairwise = -(Kn @ Kn.T).sum(dim=1)  # Eq. 7: -CosSim(K) 1
        assert torch.equal(torch.argsort(scores[h], descending=True), torch.argsort(pairwise, descending=True))
        # Eq. 8 exactly: -cos(k_i, mean of normalised keys)
        mu = Kn.mean(0)
        eq8 = -(K @ mu) / (K.norm(dim=-1) * mu.norm())
        torch.testing.assert_close(scores[h].double(), eq8, atol=1e-5, rtol=0)


def test_keydiff_zero_and_duplicate_keys_are_finite():
    v = _view(n=8)
    v.K[0, 3] = 0
    v.K[1, 5] = v.K[1, 6]
    assert torch.isfinite(get_policy("keydiff").score(v)).all()


def test_streamingllm_keeps_sinks_and_most_recent():
    v = _view(n=40)
    pol = get_policy("streamingllm")
    kept = topk_newer(pol.score(v), 10, v.pos)
    expected = torch.tensor(list(range(4)) + list(range(34, 40)))
    for h in range(kept.shape[0]):
        assert torch.equal(kept[h], expected)


def test_select_count_order_and_tie_rule():
    v = _view(h=1, n=6)
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0]])
    kept = topk_newer(scores, 3, v.pos)
    assert kept.tolist() == [[1, 2, 4]]  # three 3.0s
    kept = topk_newer(scores, 2, v.pos)
    assert kept.tolist() == [[2, 4]]  # ties: the newer tokens win
    assert topk_newer(scores, 10, v.pos).tolist() == [list(range(6))]


def test_heads_select_independently():
    v = _view(h=3, n=32, seed=1)
    pol = get_policy("keydiff")
    kept = topk_newer(pol.score(v), 8, v.pos)
    assert kept.shape == (3, 8)
    assert not all(torch.equal(kept[0], kept[h]) for h in range(1, 3))


def test_every_policy_and_parameter_is_documented():
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "policies.md").read_text()
    for name, cls in POLICIES.items():
        assert f"`{name}`" in doc, name
        for field in cls.Params.model_fields:
            assert f"`{field}`" in doc, f"{name}.{field} is not in docs/policies.md"
