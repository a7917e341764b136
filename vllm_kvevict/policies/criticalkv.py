# SPDX-License-Identifier: Apache-2.0
"""CriticalKV: two-stage selection that bounds the output perturbation (CriticalKV
paper Alg. 1 and 2, Thm. 3.5).

    A_bar  = base score (SnapKV window attention, max-pooled, by default)
    Vp_i   = mean_{g in group} || v_i W_O^g ||_1      projected values (kvpress's GQA rule)
    b      = keep - |window|                          the window is always kept (SnapKV convention)
    S1     = topk(A_bar, floor(alpha * b))            stage 1: attention alone
    S2     = topk((A_bar + eps) * Vp, b - |S1|)       stage 2: over the rest
    keep   = window + S1 + S2

``W_O^g`` is query head g's slice of the layer's output projection, ``[d, D]`` (the backend reads
it from the model once; under tensor parallelism each rank holds its own heads). alpha = 0.5 (the
experiments' value; the Alg. 1 box says 0.25, 6.5 #4), eps = 1e-4. As published it runs once,
when the prompt is complete, and generated tokens are appended (``trigger: once``). Uniform
budget per head: the AdaKV-allocated variant (per-head budgets) is not provided, because one block
table serves all heads of a layer and vLLM's attention kernels cannot mask per head.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from vllm_kvevict.kernels import ops
from vllm_kvevict.kernels.torch_ops import PagedKeys
from vllm_kvevict.policies.base import Columns, KVView, Needs, Packed
from vllm_kvevict.policies.caote import Base, BaseScoreParams, BaseScorePolicy
from vllm_kvevict.policies.snapkv import SnapKVParams

#: elements of the transient ``[H_q, tokens, D]`` product in :func:`projected_value_norms`
PROJ_CHUNK = 1 << 23


@ops.fused("projected_value_norms")
def projected_value_norms(V: torch.Tensor, W_O: torch.Tensor, G: int) -> torch.Tensor:
    """``Vp [H_kv, n]`` float32 of the values ``V [H_kv, n, d]`` and the output projections
    ``W_O [H_q, d, D]``, ``PROJ_CHUNK / (H_q D)`` tokens at a time (bounded whatever ``n``)."""
    H, n, d = V.shape
    Hq, _, D = W_O.shape
    W = W_O.to(device=V.device, dtype=torch.float32).reshape(H, G, d, D)  # KV head h's G query heads
    out = torch.empty(H, n, dtype=torch.float32, device=V.device)
    step = max(1, PROJ_CHUNK // max(1, Hq * D))
    for t0 in range(0, n, step):
        Vt = V[:, t0 : t0 + step].float()[:, None]  # [H, 1, T, d], shared by the group
        out[:, t0 : t0 + step] = torch.matmul(Vt, W).abs_().sum(dim=-1).mean(dim=1)
    return out


@ops.fused("criticalkv_scores")
def criticalkv_scores(
    A: torch.Tensor, V: torch.Tensor | PagedKeys, W_O: torch.Tensor, G: int, eps: float
) -> torch.Tensor:
    """Stage 2's criterion ``(A + eps) * Vp`` of packed tokens ``[N, H_kv]`` (``A``: their base
    scores; ``V [N, H_kv, d]``: their values, packed or read where they are)."""
    V = V.gather() if isinstance(V, PagedKeys) else V
    return (A + eps) * projected_value_norms(V.transpose(0, 1), W_O, G).T


class CriticalSnapKVParams(SnapKVParams):
    pooling: Literal["avg", "max"] = Field("max", description="max (CriticalKV Alg. 2) or avg")


class CriticalKVParams(BaseScoreParams):
    base: Base = Field("snapkv", description="base score: snapkv (default), tova or h2o")
    snapkv: CriticalSnapKVParams = Field(
        default_factory=CriticalSnapKVParams, description="the snapkv base (max-pooling, Alg. 2)"
    )
    alpha: float = Field(0.5, ge=0.0, le=1.0, description="share of the budget chosen by attention alone")
    eps: float = Field(1e-4, ge=0.0, le=1.0, description="added to the attention in stage 2")


class CriticalKV(BaseScorePolicy[CriticalKVParams]):
    name = "criticalkv"
    Params = CriticalKVParams
    needs = Needs(w_o=True, trigger="once")

    def score(self, view: KVView) -> torch.Tensor:
        return self.score_one_row(view)

    def score_columns(self, x: Packed, cols: Columns) -> torch.Tensor:
        """Stage-1 winners (and the window) score ``+inf``; the rest their stage-2 criterion."""
        if x.W_O is None:
            raise ValueError("criticalkv reads the layer's output projection (W_O); none was given")
        A = self.protected_base(x, cols)  # the window at +inf
        # Stage 1: the window and the top floor(alpha b) by attention, b = keep - |window|. A row's
        # window holds at most ``w`` of its tokens per head (distinct positions in [L - window, L)),
        # so every one is among the first chosen.
        win = [self.protected_count(L, n) for L, n in zip(cols.lens, cols.ragged.lengths)]
        first = [w + math.floor(self.params.alpha * (k - w)) if k else 0 for w, k in zip(win, cols.keep)]
        # Stage 2: the rest of the budget by attention times the projected value norm (where ``A``
        # is +inf the criterion is not finite: those tokens are stage 1's, set to +inf with its others).
        s2 = criticalkv_scores(A, x.V[x.tok], x.W_O, cols.G, self.params.eps)
        return ops.promote_topk(s2, A, x.pos, cols.ragged, first)
