# SPDX-License-Identifier: Apache-2.0
"""K-norm: keep the keys with the lowest L2 norm (Devoto et al. 2024).

    s_i = - ||k_i||_2

Per KV head, keys as stored. As in cold-compress (LSH-E's harness), the first ``sink_tokens`` and
the last ``recent_tokens`` are always kept.
"""

from __future__ import annotations

import torch
from pydantic import Field

from vllm_kvevict.kernels import ops
from vllm_kvevict.kernels.torch_ops import PagedKeys, dense_positions, row_ids
from vllm_kvevict.policies.base import MAX_TOKENS_PARAM, Needs, Policy, PolicyParams


class KNormParams(PolicyParams):
    sink_tokens: int = Field(4, ge=0, le=MAX_TOKENS_PARAM, description="initial tokens always kept")
    recent_tokens: int = Field(10, ge=0, le=MAX_TOKENS_PARAM, description="most recent tokens always kept")

    def min_budget(self) -> int:
        return self.sink_tokens + self.recent_tokens + 1


def key_norms(K: torch.Tensor) -> torch.Tensor:
    """``[N, H]`` float32 ``||k_i||_2`` of the keys ``K [N, H, d]``."""
    return K.float().norm(dim=-1)


@ops.fused("knorm_scores")
def knorm_scores(
    K: torch.Tensor, pos: torch.Tensor | PagedKeys, cu: torch.Tensor, L: torch.Tensor, sink: int, recent: int
) -> torch.Tensor:
    """``[N, H]`` float32 K-norm scores of packed rows (row ``r``: tokens ``[cu[r], cu[r + 1])``,
    ``L[r]`` long): ``-||k_i||``, ``+inf`` at the positions below ``sink`` and the row's last
    ``recent`` (``>= L - recent``)."""
    pos = dense_positions(pos)
    length = L[row_ids(cu, K.shape[0])][:, None]  # each token's row length
    protected = (pos < sink) | (pos >= length - recent)
    return (-key_norms(K)).masked_fill(protected, float("inf"))


def knorm_scores_paged(keys: PagedKeys, pos, cu, L, sink: int, recent: int) -> torch.Tensor:
    """:func:`knorm_scores` of keys read where they are in the cache: the Triton kernel reads them
    (and the positions) through their blocks; elsewhere they are gathered first."""
    return ops.fused_paged("knorm_scores", knorm_scores, keys, pos, cu, L, sink, recent)


class KNorm(Policy[KNormParams]):
    name = "knorm"
    Params = KNormParams
    needs = Needs(decode=True)

    def score_ragged(self, K: torch.Tensor, pos, cu, L, layer) -> torch.Tensor:
        return knorm_scores(K, pos, cu, L, self.params.sink_tokens, self.params.recent_tokens)

    def score_paged(self, keys, pos, cu, L, layer):
        return knorm_scores_paged(keys, pos, cu, L, self.params.sink_tokens, self.params.recent_tokens)
