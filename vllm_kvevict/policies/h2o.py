# SPDX-License-Identifier: Apache-2.0
"""H2O: heavy hitters by accumulated attention (Zhang et al. 2023).

    phi(A) = A_prev + A^T 1      every query's attention, summed per key, accumulated over steps

The accumulator is per-slot state (``h2o``): every step adds the column sums of that step's
queries (group-mean over GQA), and it moves with its token at compaction. As in the KeyDiff
harness no recent window is reserved by default; ``recent_tokens`` reserves one (the H2O paper
splits the budget between heavy hitters and recent tokens).
"""

from __future__ import annotations

import torch
from pydantic import Field

from vllm_kvevict.policies.attention import group_mean
from vllm_kvevict.policies.base import MAX_TOKENS_PARAM, KVView, Needs, Policy, PolicyParams

STATE = "h2o"


class H2OParams(PolicyParams):
    recent_tokens: int = Field(0, ge=0, le=MAX_TOKENS_PARAM, description="most recent tokens always kept")

    def min_budget(self) -> int:
        return self.recent_tokens + 1


def h2o_observe(view: KVView, A: torch.Tensor) -> None:
    """Add ``A^T 1``, this step's queries' attention summed per key (``[H_q, n]``), to every key's
    accumulator."""
    view.state[STATE] += group_mean(A, view.G)


def protect_recent(scores: torch.Tensor, view: KVView, recent: int) -> torch.Tensor:
    return scores.masked_fill(view.pos >= view.length - recent, float("inf")) if recent else scores


class H2O(Policy[H2OParams]):
    name = "h2o"
    Params = H2OParams
    needs = Needs(queries="step", attention=True, state={STATE: (torch.float32, 0.0)}, decode=True)

    def observe(self, view: KVView) -> None:
        h2o_observe(view, self.attention(view))

    def score(self, view: KVView) -> torch.Tensor:
        return protect_recent(view.state[STATE].clone(), view, self.params.recent_tokens)
