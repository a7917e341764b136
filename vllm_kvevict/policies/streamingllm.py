# SPDX-License-Identifier: Apache-2.0
"""StreamingLLM ("Sink"): keep the first ``sink_tokens`` tokens and the most recent ones.

Xiao et al., *Efficient Streaming Language Models with Attention Sinks*; as used by the seed papers
(KeyDiff App. B.2): the first 4 tokens plus the most recent ``N - 4``.
"""

from __future__ import annotations

import torch
from pydantic import Field

from vllm_kvevict.policies.base import MAX_TOKENS_PARAM, Needs, Policy, PolicyParams


class StreamingLLMParams(PolicyParams):
    sink_tokens: int = Field(4, ge=0, le=MAX_TOKENS_PARAM, description="initial tokens always kept (attention sinks)")

    def min_budget(self) -> int:
        return self.sink_tokens + 1


class StreamingLLM(Policy[StreamingLLMParams]):
    name = "streamingllm"
    Params = StreamingLLMParams
    needs = Needs(decode=True)

    def score_ragged(self, K, pos: torch.Tensor, cu, L, layer) -> torch.Tensor:
        # Recency is the score; sinks are protected.
        return pos.to(torch.float32).masked_fill(pos < self.params.sink_tokens, float("inf"))
