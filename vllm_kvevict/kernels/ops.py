"""The batched eviction operations, dispatched by device: Triton kernels for CUDA tensors (when
Triton imports), the vectorised torch implementations otherwise (the CPU engine).

``KVEVICT_KERNELS=torch`` forces the torch path everywhere (debugging, A/B timing);
``KVEVICT_KERNELS=triton`` forces Triton (CPU tensors then need ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
from functools import cache
from types import ModuleType

import torch

from vllm_kvevict.kernels import reference

OPS = ("gather_paged", "keydiff_scores", "key_norms", "select_topk", "scatter_paged", "column_sums",
       "lshe_victims", "simhash_codes", "hamming_distances", "projected_value_norms")


@cache
def _triton() -> ModuleType | None:
    try:
        from vllm_kvevict.kernels import triton_ops
    except ImportError:
        return None
    return triton_ops


def backend_for(t: torch.Tensor) -> ModuleType:
    """The module whose functions run on ``t``'s device."""
    choice = os.environ.get("KVEVICT_KERNELS", "auto")
    if choice == "torch":
        return reference
    if choice == "triton" or t.is_cuda:
        mod = _triton()
        if mod is not None:
            return mod
        if choice == "triton":
            raise RuntimeError("kvevict: KVEVICT_KERNELS=triton but Triton does not import")
    return reference


def gather_paged(k_cache, v_cache, block_table, rows, starts, ends):
    return backend_for(k_cache).gather_paged(k_cache, v_cache, block_table, rows, starts, ends)


def keydiff_scores(K, cu):
    return backend_for(K).keydiff_scores(K, cu)


def key_norms(K):
    return backend_for(K).key_norms(K)


def select_topk(scores, pos, cu, keep):
    return backend_for(scores).select_topk(scores, pos, cu, keep)


def scatter_paged(dst, src, idx, cu, cu_keep, block_table, rows, dst_start):
    return backend_for(dst).scatter_paged(dst, src, idx, cu, cu_keep, block_table, rows, dst_start)


def column_sums(Q, K, q_pos, k_pos, G, scale, softcap=None):
    return backend_for(K).column_sums(Q, K, q_pos, k_pos, G, scale, softcap)


def lshe_victims(dist, pos, victim, q_pos, budget, sinks, recent):
    return backend_for(pos).lshe_victims(dist, pos, victim, q_pos, budget, sinks, recent)


def simhash_codes(x, R):
    return backend_for(x).simhash_codes(x, R)


def hamming_distances(q_codes, k_codes, G):
    return backend_for(k_codes).hamming_distances(q_codes, k_codes, G)


def projected_value_norms(V, W_O, G):
    return backend_for(V).projected_value_norms(V, W_O, G)
