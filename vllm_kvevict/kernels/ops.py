# SPDX-License-Identifier: Apache-2.0
"""The batched eviction operations, dispatched by device: Triton kernels for CUDA tensors (when
Triton imports), the vectorised torch implementations otherwise (the CPU engine).

``KVEVICT_KERNELS=torch`` forces the torch path everywhere (debugging, A/B timing);
``KVEVICT_KERNELS=triton`` forces Triton (CPU tensors then need ``TRITON_INTERPRET=1``);
``KVEVICT_KERNELS=cuda`` takes the CUDA C++ extension (``csrc/``, :mod:`.cuda_ops`, built on first
use) for CUDA tensors in the operations it implements (:data:`CUDA_OPS`), Triton for the rest. Auto
does not pick it: it has not been measured against Triton on a GPU yet.
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import torch

from vllm_kvevict import envs
from vllm_kvevict.kernels import torch_ops

OPS = (
    "gather_paged",
    "keydiff_scores",
    "key_norms",
    "select_topk",
    "scatter_paged",
    "column_sums",
    "lshe_victims",
    "simhash_codes",
    "hamming_distances",
    "projected_value_norms",
)


#: the operations ``csrc/`` implements
CUDA_OPS = ("gather_paged", "scatter_paged", "keydiff_scores", "key_norms")


@cache
def _cuda() -> ModuleType:
    from vllm_kvevict.kernels import cuda_ops

    cuda_ops.build()  # raises with the compiler's message when it cannot be built
    return cuda_ops


@cache
def _triton() -> ModuleType | None:
    try:
        from vllm_kvevict.kernels import triton_ops
    except ImportError:
        return None
    return triton_ops


def backend_for(t: torch.Tensor, op: str | None = None) -> ModuleType:
    """The module whose function ``op`` runs on ``t``'s device."""
    choice = envs.KVEVICT_KERNELS
    if choice == "torch":
        return torch_ops
    if choice == "cuda" and t.is_cuda and op in CUDA_OPS:
        return _cuda()
    if choice == "triton" or t.is_cuda:
        mod = _triton()
        if mod is not None:
            return mod
        if choice == "triton":
            raise RuntimeError("kvevict: KVEVICT_KERNELS=triton but Triton does not import")
    return torch_ops


def gather_paged(k_cache, v_cache, block_table, rows, starts, ends):
    return backend_for(k_cache, "gather_paged").gather_paged(k_cache, v_cache, block_table, rows, starts, ends)


def keydiff_scores(K, cu):
    return backend_for(K, "keydiff_scores").keydiff_scores(K, cu)


def key_norms(K):
    return backend_for(K, "key_norms").key_norms(K)


def select_topk(scores, pos, cu, keep):
    return backend_for(scores, "select_topk").select_topk(scores, pos, cu, keep)


def scatter_paged(dst, src, idx, cu, cu_keep, block_table, rows, dst_start):
    return backend_for(dst, "scatter_paged").scatter_paged(dst, src, idx, cu, cu_keep, block_table, rows, dst_start)


def column_sums(Q, K, q_pos, k_pos, cu_q, cu_k, G, scale, softcap=None):
    return backend_for(K).column_sums(Q, K, q_pos, k_pos, cu_q, cu_k, G, scale, softcap)


def lshe_victims(dist, pos, victim, q_pos, budget, sinks, recent):
    return backend_for(pos).lshe_victims(dist, pos, victim, q_pos, budget, sinks, recent)


def simhash_codes(x, R):
    return backend_for(x).simhash_codes(x, R)


def hamming_distances(q_codes, k_codes, G):
    return backend_for(k_codes).hamming_distances(q_codes, k_codes, G)


def projected_value_norms(V, W_O, G):
    return backend_for(V).projected_value_norms(V, W_O, G)
