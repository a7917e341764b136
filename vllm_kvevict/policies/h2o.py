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

from vllm_kvevict.kernels import ops
from vllm_kvevict.kernels.torch_ops import PagedKeys
from vllm_kvevict.policies.attention import columns_group_mean, in_window
from vllm_kvevict.policies.base import MAX_TOKENS_PARAM, Columns, KVView, Needs, Packed, Policy, PolicyParams

STATE = "h2o"


class H2OParams(PolicyParams):
    recent_tokens: int = Field(0, ge=0, le=MAX_TOKENS_PARAM, description="most recent tokens always kept")

    def min_budget(self) -> int:
        return self.recent_tokens + 1


@ops.fused("h2o_observe_columns")
def h2o_observe_columns(A: torch.Tensor, acc: torch.Tensor, G: int) -> torch.Tensor:
    """Add this step's queries' attention summed per key (``A [N, H_q]``, packed rows), group-mean
    over each KV head's query heads, to every key's accumulator ``acc [N, H_kv]``, in place
    (returned)."""
    return acc.add_(columns_group_mean(A, G))


def h2o_observe(view: KVView, A: torch.Tensor) -> None:
    """:func:`h2o_observe_columns` of one view (``A [H_q, n]``; the accumulator ``[H_kv, n]``)."""
    h2o_observe_columns(A.T, view.state[STATE].T, view.G)


def h2o_columns(acc: torch.Tensor, pos: torch.Tensor | PagedKeys, L: torch.Tensor, recent: int) -> torch.Tensor:
    """``[N, H_kv]``: the accumulators (``acc`` itself where nothing is protected: scores are only
    read), the ``recent`` newest positions of each row (its length ``L [N]`` per token) protected."""
    s = acc.float()
    return s.masked_fill(in_window(pos, L, recent), float("inf")) if recent else s


class H2O(Policy[H2OParams]):
    name = "h2o"
    Params = H2OParams
    needs = Needs(queries="step", attention=True, state={STATE: (torch.float32, 0.0)}, decode=True)

    def observe(self, view: KVView) -> None:
        h2o_observe(view, self.attention(view))

    def observe_columns(self, x: Packed, cols: Columns) -> None:
        h2o_observe_columns(x.A, x.state[STATE], cols.G)

    def score(self, view: KVView) -> torch.Tensor:
        L = torch.full((view.pos.shape[1],), view.length, device=view.pos.device)
        return h2o_columns(view.state[STATE].T, view.pos.T, L, self.params.recent_tokens).T

    def score_columns(self, x: Packed, cols: Columns) -> torch.Tensor:
        if not self.params.recent_tokens:  # the accumulators themselves (read only)
            return x.state[STATE].float()
        return h2o_columns(x.state[STATE], x.pos, cols.L[cols.row], self.params.recent_tokens)
