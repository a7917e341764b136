# SPDX-License-Identifier: Apache-2.0
"""SnapKV: observation-window attention, pooled (Li et al. 2024).

    A     = softmax(Q_win K^T * scale)        Q_win = the last ``window`` queries (default 32)
    s     = pool( mean_w A )                  over the prefix; kernel 7
    keep  = the window's own tokens (always) + topk(s) of the prefix

``pooling``: ``avg`` is the KeyDiff/CAOTE harness's SnapKV (average smoothing), ``max`` the
CriticalKV/AdaKV version (Alg. 2, max-pooling). The window is the last ``window`` positions; it is
always kept and counts toward the budget. GQA: pooled rows averaged over the query group. Every
prefill chunk and, in the KeyDiff harness, every decode step: the window is a rolling buffer of
the sequence's latest queries, kept per request by the backend.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, field_validator

from vllm_kvevict.kernels import ops
from vllm_kvevict.kernels.torch_ops import PagedKeys
from vllm_kvevict.policies.attention import columns_group_mean, in_window, pool_segments
from vllm_kvevict.policies.base import Columns, KVView, Needs, Packed, Policy, PolicyParams

#: Longest observation window. The backend keeps each request's last ``window`` queries per layer
#: (``[H_q, window, d]``), so this bounds that buffer: 128 x 32 heads x 128 x 2 bytes = 1 MiB per
#: layer and request for Llama-3.1-8B in bf16. The papers use 16-64.
MAX_QUERY_WINDOW = 128
#: Widest pooling kernel (the papers use 5-7).
MAX_KERNEL = 63


class SnapKVParams(PolicyParams):
    window: int = Field(
        32, ge=1, le=MAX_QUERY_WINDOW, description="observation window: the last queries scored with, always kept"
    )
    kernel: int = Field(7, ge=1, le=MAX_KERNEL, description="pooling kernel along the tokens (odd)")
    pooling: Literal["avg", "max"] = Field("avg", description="avg (KeyDiff/CAOTE harness) or max (CriticalKV)")

    @field_validator("kernel")
    @classmethod
    def _odd(cls, v: int) -> int:
        if v % 2 == 0:
            raise ValueError("must be odd")
        return v

    def min_budget(self) -> int:
        return self.window + 1


def snapkv_columns(A: torch.Tensor, pos: torch.Tensor | PagedKeys, cols: Columns, p: SnapKVParams, protect: bool):
    """SnapKV's scores ``[N, H_kv]`` of packed rows (:func:`snapkv_scores`); ``protect``: ``+inf``
    at the window's positions (else finite: policies that build on them take the window's mask
    from :func:`~vllm_kvevict.policies.attention.in_window`)."""
    return snapkv_scores(A, pos, cols.row, cols.cu, cols.m, cols.L, cols.G, p.window, p.kernel, p.pooling, protect)


@ops.fused("snapkv_scores")
def snapkv_scores(
    A: torch.Tensor,
    pos: torch.Tensor | PagedKeys,
    row: torch.Tensor,
    cu: torch.Tensor,
    m: torch.Tensor,
    L: torch.Tensor,
    G: int,
    window: int,
    kernel: int,
    pooling: str,
    protect: bool,
) -> torch.Tensor:
    """SnapKV's formula over packed rows (row ``r``: tokens ``[cu[r], cu[r + 1])``, ``L[r]`` long,
    ``m[r]`` queries; ``row``: each token's): ``[N, H_kv]``, each row's prefix its window's mean
    attention pooled within the prefix, its window slots that mean raw, averaged over each KV
    head's query group; ``protect``: ``+inf`` at the window's positions (``>= L - window``).
    ``A [N, H_q]``: the window's attention summed per key."""
    A = A / m[row][:, None]  # mean over each row's window
    pre_end = (cu[1:] - torch.minimum(L.clamp(max=window), cu[1:] - cu[:-1]))[row]  # window slots last
    pooled = pool_segments(A, cu[:-1][row], pre_end, kernel, pooling)
    A = torch.where((torch.arange(A.shape[0], device=A.device) < pre_end)[:, None], pooled, A)
    s = columns_group_mean(A, G)
    if protect:
        s = s.masked_fill(in_window(pos, L[row], window), float("inf"))
    return s


def snapkv_needs(p: SnapKVParams) -> Needs:
    """The observation window's attention; every chunk and while decoding."""
    return Needs(queries="window", window=p.window, attention=True, decode=True)


class SnapKV(Policy[SnapKVParams]):
    name = "snapkv"
    Params = SnapKVParams

    def __init__(self, params: SnapKVParams | None = None):
        super().__init__(params)
        self.needs = snapkv_needs(self.params)

    def score(self, view: KVView) -> torch.Tensor:
        return self.score_one_row(view)

    def score_columns(self, x: Packed, cols: Columns) -> torch.Tensor:
        return snapkv_columns(x.A, x.pos, cols, self.params, True)
