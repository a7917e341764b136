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

import torch

from vllm_kvevict.kernels import ops
from vllm_kvevict.kernels.torch_ops import EPS, PagedKeys, row_ids
from vllm_kvevict.policies.base import Needs, Policy


@ops.fused("keydiff_scores")
def keydiff_scores(K: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """``[N, H]`` float32 ``s_i`` of the packed keys ``K [N, H, d]`` of every row (``cu``), per KV head."""
    K = K.float()
    norm = K.norm(dim=-1)  # [N, H]
    k_hat = K / norm.clamp_min(EPS)[..., None]
    # each token reads its row's mean; a segmented sum, not index_add_ (atomics on CUDA): the same
    # bits on every run and whichever rows share the call
    lens = cu[1:] - cu[:-1]
    mu = torch.segment_reduce(k_hat, "sum", lengths=lens, axis=0) / lens.clamp_min(1)[:, None, None].float()
    mu = mu.expand_as(k_hat) if cu.numel() == 2 else mu[row_ids(cu, K.shape[0])]
    return -((K * mu).sum(-1) / (mu.norm(dim=-1) * norm).clamp_min(EPS))


def keydiff_scores_paged(keys: PagedKeys, cu: torch.Tensor) -> torch.Tensor:
    """:func:`keydiff_scores` of keys read where they are in the cache: the Triton kernel reads them
    through their blocks; elsewhere they are gathered first."""
    return ops.fused_paged("keydiff_scores", keydiff_scores, keys, cu)


class KeyDiff(Policy):
    name = "keydiff"
    needs = Needs(decode=True)

    def score_ragged(self, K, pos, cu, L, layer):
        return keydiff_scores(K, cu)

    def score_paged(self, keys, pos, cu, L, layer):
        return keydiff_scores_paged(keys, cu)
