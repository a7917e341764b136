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


@ops.fused("key_norms")
def key_norms(K: torch.Tensor) -> torch.Tensor:
    """``[N, H]`` float32 ``||k_i||_2`` of the keys ``K [N, H, d]``."""
    return K.float().norm(dim=-1)


def key_norms_paged(keys: PagedKeys) -> torch.Tensor:
    """:func:`key_norms` of keys read where they are in the cache: the Triton kernel reads them
    through their blocks; elsewhere they are gathered first."""
    return ops.fused_paged("key_norms", key_norms, keys)


class KNorm(Policy[KNormParams]):
    name = "knorm"
    Params = KNormParams
    needs = Needs(decode=True)

    def score_ragged(self, K: torch.Tensor, pos, cu, L, layer) -> torch.Tensor:
        return self._protect(-key_norms(K), pos, cu, L)

    def score_paged(self, keys, pos, cu, L, layer):
        return self._protect(-key_norms_paged(keys), dense_positions(pos), cu, L)

    def _protect(self, scores: torch.Tensor, pos: torch.Tensor, cu, L) -> torch.Tensor:
        """The sink and recent tokens scored above every other."""
        length = L.to(pos.device)[row_ids(cu, scores.shape[0])][:, None]  # each token's row length
        protected = (pos < self.params.sink_tokens) | (pos >= length - self.params.recent_tokens)
        return scores.masked_fill(protected, float("inf"))
