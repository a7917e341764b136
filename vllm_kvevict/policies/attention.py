# SPDX-License-Identifier: Apache-2.0
"""Helpers for the attention-based policies (the attention probabilities SnapKV, TOVA, H2O and their users read).

The engine's kernels do not return probabilities, so the policies that need them recompute the
few rows they read (TOVA 1, SnapKV 32, H2O every query of the step) from the queries and the
window's keys, with the model's scaling and soft-capping (:meth:`Policy.attention
<vllm_kvevict.policies.base.Policy.attention>`; the engine computes every request's at once).
Masking is causal by *position*: a query at position p sees the keys at positions <= p, whatever
slots they moved to. GQA: each query head reads its KV head's keys (``G`` query heads per KV
head); :func:`columns_group_mean` averages the group's columns onto the KV head, as the KeyDiff harness does
(KeyDiff App. B.2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_kvevict.kernels import ops
from vllm_kvevict.kernels.torch_ops import PagedKeys, dense_positions


def columns_group_mean(A: torch.Tensor, G: int) -> torch.Tensor:
    """``[N, H_q]`` -> ``[N, H_kv]``: packed column sums averaged over each KV head's G query heads
    (KeyDiff App. B.2)."""
    return A.reshape(A.shape[0], A.shape[1] // G, G).mean(-1)


def in_window(pos: torch.Tensor | PagedKeys, L: torch.Tensor, window: int) -> torch.Tensor:
    """``[N, H_kv]``: whether each token's position is among its row's last ``window`` (``L [N]``:
    each token's row length; ``pos`` packed or read where they are)."""
    return dense_positions(pos) >= (L - window)[:, None]


def pool1d(x: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """SnapKV's smoothing along the token axis of ``[H, n]`` (stride 1, same length): ``avg`` as
    ``F.avg_pool1d`` (zero padding counted), ``max`` as ``F.max_pool1d``."""
    if kernel <= 1 or x.shape[-1] == 0:
        return x
    pad = kernel // 2
    if mode == "avg":
        return F.avg_pool1d(x[:, None], kernel, stride=1, padding=pad)[:, 0]
    return F.max_pool1d(x[:, None], kernel, stride=1, padding=pad)[:, 0]


@ops.fused("pool_segments")
def pool_segments(x: torch.Tensor, start: torch.Tensor, end: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """:func:`pool1d` of packed tokens ``x [N, C]``, each token pooled over its own segment
    ``[start[i], end[i])`` of the packed axis (its row's prefix): neighbours outside it count as
    the padding (zero for ``avg``, whose divisor stays ``kernel``; ignored for ``max``). The
    neighbours are added in a fixed order, so a token's value does not depend on the other rows."""
    if kernel <= 1 or x.shape[0] == 0:
        return x
    pad, n = kernel // 2, x.shape[0]
    fill = 0.0 if mode == "avg" else float("-inf")
    padded = F.pad(x, (0, 0, pad, pad), value=fill)
    at = torch.arange(n, device=x.device)
    out: torch.Tensor | None = None
    for o in range(-pad, pad + 1):
        j = at + o
        v = padded[pad + o : pad + o + n].masked_fill(((j < start) | (j >= end))[:, None], fill)
        out = v if out is None else (out + v if mode == "avg" else torch.maximum(out, v))
    assert out is not None
    return out / kernel if mode == "avg" else out
