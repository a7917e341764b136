# SPDX-License-Identifier: Apache-2.0
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

from vllm_kvevict.kernels import ops
from vllm_kvevict.policies.base import Policy


class KeyDiff(Policy):
    name = "keydiff"
    evicts_during_decode = True

    def score_ragged(self, K, pos, cu, L, layer):
        # -cos(k_i, mu), mu the mean of the row's normalised keys, per (row, KV head); in torch:
        # kernels/torch_ops.py keydiff_scores, fused in Triton and CUDA.
        return ops.keydiff_scores(K, cu)
