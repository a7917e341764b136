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

from vllm_kvevict.policies.attention import group_mean, pool1d
from vllm_kvevict.policies.base import KVView, Needs, Policy, PolicyParams

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


def window_slots(view: KVView, p: SnapKVParams) -> int:
    """How many of the view's slots hold the observation window: its last, in every head (the
    newest tokens, kept by every compaction), so known on the host, not counted on the device."""
    return min(p.window, view.length, view.pos.shape[1])


def snapkv_scores(view: KVView, A: torch.Tensor, p: SnapKVParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Finite scores ``[H_kv, n]`` (prefix: pooled window attention; window: its raw mean
    attention) and the mask of the protected window slots; ``A [H_q, n]``: the window's attention
    summed per key."""
    A = A / view.queries()[0].shape[1]  # mean over the window
    kpos = view.pos.repeat_interleave(view.G, dim=0)
    in_win = kpos >= view.length - p.window
    n_pre = A.shape[1] - window_slots(view, p)
    pooled = torch.cat([pool1d(A[:, :n_pre], p.kernel, p.pooling), A[:, n_pre:]], dim=1)
    return group_mean(pooled, view.G), in_win[:: view.G]


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
        s, protected = snapkv_scores(view, self.attention(view), self.params)
        return s.masked_fill(protected, float("inf"))
