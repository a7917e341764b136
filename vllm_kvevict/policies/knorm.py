"""K-norm: keep the keys with the lowest L2 norm (Devoto et al. 2024).

    s_i = - ||k_i||_2

Per KV head, keys as stored. As in cold-compress (LSH-E's harness), the first ``sink_tokens`` and
the last ``recent_tokens`` are always kept.
"""

from __future__ import annotations

import torch
from pydantic import Field

from vllm_kvevict.kernels import ops
from vllm_kvevict.kernels.reference import row_ids
from vllm_kvevict.policies.base import MAX_TOKENS_PARAM, KVView, Policy, PolicyParams


class KNormParams(PolicyParams):
    sink_tokens: int = Field(4, ge=0, le=MAX_TOKENS_PARAM, description="initial tokens always kept")
    recent_tokens: int = Field(10, ge=0, le=MAX_TOKENS_PARAM, description="most recent tokens always kept")

    def min_budget(self) -> int:
        return self.sink_tokens + self.recent_tokens + 1


def protect_sinks_recent(scores: torch.Tensor, view: KVView, sinks: int, recent: int) -> torch.Tensor:
    protected = (view.pos < sinks) | (view.pos >= view.length - recent)
    return scores.masked_fill(protected, float("inf"))


class KNorm(Policy):
    name = "knorm"
    Params = KNormParams
    evicts_during_decode = True

    def score(self, view: KVView) -> torch.Tensor:
        s = -view.K.float().norm(dim=-1)
        return protect_sinks_recent(s, view, self.params.sink_tokens, self.params.recent_tokens)

    def score_ragged(self, K, pos, cu, L, layer):
        length = L.to(pos.device)[row_ids(cu)][:, None]
        protected = (pos < self.params.sink_tokens) | (pos >= length - self.params.recent_tokens)
        return (-ops.key_norms(K)).masked_fill(protected, float("inf"))
