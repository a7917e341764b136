"""KeyDiff: keep the keys least similar to the anchor (KeyDiff paper, Eq. 8).

    k_hat_i = k_i / ||k_i||
    mu      = mean_i k_hat_i                       (anchor: mean of normalised keys)
    s_i     = - cos(mu, k_i)
    S       = topk(s, N)

Per KV head, keys as stored (post-RoPE); no attention needed. Eq. 8 ranks exactly like the
pairwise Eq. 7 (``sum_j cos(k_i, k_j) = n ||mu|| cos(k_i, mu)``). Block-wise: the backend calls
this after every prefill chunk (the chunk is the paper's block B) and during decoding.
"""

from __future__ import annotations

import torch

from vllm_kvevict.kernels import ops
from vllm_kvevict.policies.base import KVView, Policy

EPS = 1e-8


class KeyDiff(Policy):
    name = "keydiff"
    evicts_during_decode = True

    def score(self, view: KVView) -> torch.Tensor:
        K = view.K.to(torch.float32)  # [H, n, d]
        k_norm = K.norm(dim=-1)  # [H, n]
        k_hat = K / k_norm.clamp_min(EPS).unsqueeze(-1)
        mu = k_hat.mean(dim=1, keepdim=True)  # [H, 1, d]
        cos = (K * mu).sum(-1) / (mu.norm(dim=-1) * k_norm).clamp_min(EPS)
        return -cos

    def score_ragged(self, K, pos, cu, L, layer):
        return ops.keydiff_scores(K, cu)  # the same formula, fused per (row, KV head)
