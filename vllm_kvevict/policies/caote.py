# SPDX-License-Identifier: Apache-2.0
"""CAOTE and FastCAOTE: the closed-form attention-output error of evicting each token
(CAOTE paper Sec. 3, Eqs. 8, 21, 23).

    h^norm = h / sum_i h_i                             base scores (H2O, TOVA or SnapKV), sum 1
    X      = V^T h^norm           (CAOTE, Eq. 21)      or  mean_i v_i  (FastCAOTE, Eq. 23)
    c_j    = h_j^norm / (1 - h_j^norm) * || X - v_j ||_2
    keep   = topk(c)                                   evict the tokens whose removal moves X least

Per KV head: the base scores are group means over the query heads (the KeyDiff harness; 6.5 #18)
and ``V`` is the KV head's values. Tokens the base protects (SnapKV's window) stay protected.
Runs after every prefill chunk and during decoding. Deviation (6.5 #19): the chunk attends
before its evictions (KeyDiff's order) instead of over the kept entries only (Eq. 7).
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar, Literal, TypeVar

import torch
from pydantic import Field

from vllm_kvevict.kernels import ops
from vllm_kvevict.kernels.torch_ops import ONE_MINUS_MIN, PagedKeys
from vllm_kvevict.policies.attention import in_window
from vllm_kvevict.policies.base import Columns, KVView, Needs, Packed, Policy, PolicyParams
from vllm_kvevict.policies.h2o import H2O, h2o_observe, h2o_observe_columns
from vllm_kvevict.policies.h2o import STATE as H2O_STATE
from vllm_kvevict.policies.snapkv import SnapKVParams, snapkv_columns, snapkv_needs
from vllm_kvevict.policies.tova import TOVA, tova_columns

Base = Literal["h2o", "tova", "snapkv"]


class BaseScoreParams(PolicyParams):
    """An attention-based base score, as CAOTE and CriticalKV take one."""

    base: Base = Field("h2o", description="base score: h2o (accumulated), tova (last query), snapkv (window)")
    snapkv: SnapKVParams = Field(default_factory=SnapKVParams, description="the snapkv base's window and pooling")

    def min_budget(self) -> int:
        return self.snapkv.min_budget() if self.base == "snapkv" else 1


BP = TypeVar("BP", bound=BaseScoreParams)


class BaseScorePolicy(Policy[BP]):
    """A policy on top of a base score: reads what the base reads (its queries, attention and
    state; its own class says when it runs) and computes it."""

    def __init__(self, params: BP | None = None):
        super().__init__(params)
        p = self.params
        base = {"h2o": H2O.needs, "tova": TOVA.needs, "snapkv": snapkv_needs(p.snapkv)}[p.base]
        own = type(self).needs
        self.needs = replace(base, decode=own.decode, trigger=own.trigger, w_o=own.w_o)

    def observe(self, view: KVView) -> None:
        if self.params.base == "h2o":
            h2o_observe(view, self.attention(view))

    def observe_columns(self, x: Packed, cols: Columns) -> None:
        if self.params.base == "h2o":
            h2o_observe_columns(x.A, x.state[H2O_STATE], cols.G)

    def base_columns(self, x: Packed, cols: Columns) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Non-negative finite base scores of packed rows ``[N, H_kv]`` and the protected mask (or None)."""
        if self.params.base == "h2o":
            return x.state[H2O_STATE].float(), None
        if self.params.base == "tova":
            return tova_columns(x.A, cols.G), None
        p = self.params.snapkv
        return snapkv_columns(x.A, x.pos, cols, p, False), in_window(x.pos, cols.L[cols.row], p.window)

    def protected_base(self, x: Packed, cols: Columns) -> torch.Tensor:
        """The base scores of packed rows ``[N, H_kv]``, ``+inf`` where the base protects."""
        if self.params.base == "snapkv":
            return snapkv_columns(x.A, x.pos, cols, self.params.snapkv, True)
        return self.base_columns(x, cols)[0]

    def protected_count(self, L: int, n: int) -> int:
        """How many slots per head the base protects in a row of ``n`` slots and length ``L``
        (SnapKV's window; the others none)."""
        return min(self.params.snapkv.window, L, n) if self.params.base == "snapkv" else 0


@ops.fused("caote_scores")
def caote_scores(
    h: torch.Tensor, V: torch.Tensor | PagedKeys, cu: torch.Tensor, row: torch.Tensor, fast: bool
) -> torch.Tensor:
    """Eq. 21 (``fast``: Eq. 23) of packed rows (row ``r``: tokens ``[cu[r], cu[r + 1])``;
    ``row``: each token's): ``[N, H]``. Each row's sums are segmented sums, not ``index_add_``
    (atomics on CUDA): the same bits on every run and whichever rows share the call."""
    V = V.gather() if isinstance(V, PagedKeys) else V
    lens = cu[1:] - cu[:-1]
    total = torch.segment_reduce(h, "sum", lengths=lens, axis=0)[row]  # [N, H]: the row's
    n = lens[row].to(h.dtype)[:, None]
    hn = torch.where(total > 0, h / total.clamp_min(torch.finfo(h.dtype).tiny), 1.0 / n)
    V = V.float()
    if fast:
        X = torch.segment_reduce(V, "sum", lengths=lens, axis=0) / lens.clamp_min(1).float()[:, None, None]
    else:
        X = torch.segment_reduce(hn[..., None] * V, "sum", lengths=lens, axis=0)
    return hn / (1 - hn).clamp_min(ONE_MINUS_MIN) * (X[row] - V).norm(dim=-1)


class CAOTE(BaseScorePolicy[BaseScoreParams]):
    name = "caote"
    Params = BaseScoreParams
    needs = Needs(decode=True)
    fast: ClassVar[bool] = False

    def score(self, view: KVView) -> torch.Tensor:
        return self.score_one_row(view)

    def score_columns(self, x: Packed, cols: Columns) -> torch.Tensor:
        h, protected = self.base_columns(x, cols)
        c = caote_scores(h.float(), x.V[x.tok], cols.cu, cols.row, self.fast)
        return c if protected is None else c.masked_fill(protected, float("inf"))


class FastCAOTE(CAOTE):
    name = "fastcaote"
    fast = True
