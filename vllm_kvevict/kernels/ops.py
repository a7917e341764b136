# SPDX-License-Identifier: Apache-2.0
"""The batched eviction operations, dispatched by device: Triton kernels for CUDA tensors (when
Triton imports), the vectorised torch implementations otherwise (the CPU engine). Measured on an
H100 (docs/kernels.md, "On a GPU"), two operations default to torch on a GPU too: ``column_sums``
(:data:`TORCH_ON_CUDA`: the Triton kernel was 10-40x slower than torch's) and ``select_topk`` for
sets whose longest row exceeds :data:`SELECT_TRITON_MAX_ROW` tokens (the Triton kernel runs one
program per row and head).

``KVEVICT_KERNELS=torch`` forces the torch path everywhere (debugging, A/B timing);
``KVEVICT_KERNELS=triton`` forces Triton (CPU tensors then need ``TRITON_INTERPRET=1``);
``KVEVICT_KERNELS=cuda`` takes the CUDA C++ extension (``csrc/``, :mod:`.cuda_ops`, built on first
use) for CUDA tensors in the operations it implements (:data:`CUDA_OPS`), auto's choice for the rest. Auto
does not pick it: faster than Triton for ``scatter_paged`` only, about equal for ``gather_paged`` on
the H100, and it compiles with nvcc at first use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import cache
from types import ModuleType
from typing import TypeVar

import torch

from vllm_kvevict import envs
from vllm_kvevict.kernels import torch_ops
from vllm_kvevict.kernels.torch_ops import PagedKeys, Ragged

OPS = (
    "record_slots",
    "gather_paged",
    "take_paged",
    "select_topk",
    "select_split",
    "promote_topk",
    "scatter_paged",
    "scatter_kv_paged",
    "column_sums",
    "simhash_codes",
)


#: the operations ``csrc/`` implements
CUDA_OPS = ("gather_paged", "scatter_paged", "keydiff_scores")
#: operations whose torch implementation ``auto`` runs on a GPU as well (faster there than Triton's)
TORCH_ON_CUDA = ("column_sums",)
#: ``select_topk`` on a GPU under ``auto`` (and ``cuda``, which has none): Triton's for sets whose rows are all at most this long,
#: torch's (a sort) beyond
SELECT_TRITON_MAX_ROW = 4096


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
    if choice in ("auto", "cuda") and t.is_cuda and op in TORCH_ON_CUDA:
        return torch_ops
    if choice == "triton" or t.is_cuda:
        mod = _triton()
        if mod is not None:
            return mod
        if choice == "triton":
            raise RuntimeError("kvevict: KVEVICT_KERNELS=triton but Triton does not import")
    return torch_ops


F = TypeVar("F", bound=Callable[..., torch.Tensor])
#: the policies' scores with fused kernels: op name -> the torch statement (in the policy's file)
FUSED: dict[str, Callable[..., torch.Tensor]] = {}


def fused(op: str) -> Callable[[F], F]:
    """Register a policy's score, stated in torch in its own file, as the specification of the
    fused kernels named ``op`` (``triton_ops.<op>``; ``cuda_ops.<op>`` where :data:`CUDA_OPS` lists
    it): the decorated function dispatches by device like every operation here, and runs the
    statement itself on the torch path (the CPU engine). Tests compare every kernel with
    :data:`FUSED` ``[op]``."""

    def register(statement: F) -> F:
        FUSED[op] = statement

        @functools.wraps(statement)
        def dispatch(*args):
            mod = backend_for(args[0], op)
            return statement(*args) if mod is torch_ops else getattr(mod, op)(*args)

        return dispatch  # type: ignore[return-value]

    return register


def fused_paged(op: str, fn: Callable[..., torch.Tensor], keys: PagedKeys, *args) -> torch.Tensor:
    """The fused ``op`` (``fn``, its dispatching function) of keys read where they are in the cache:
    the kernel module's ``<op>_paged`` reads them through their blocks where it has one (Triton);
    elsewhere they are gathered first."""
    paged = getattr(backend_for(keys.cache, op), f"{op}_paged", None)
    return paged(keys, *args) if paged is not None else fn(keys.gather(), *args)


# ``cu`` arguments: a :class:`~vllm_kvevict.kernels.torch_ops.Ragged` (offsets on the host and the
# device: nothing waits on the device to size an output or a grid, as in the eviction step) or a
# tensor (read from the device once: tests, benchmarks).


def gather_paged(k_cache, v_cache, block_table, rows, starts, ends, cu: Ragged | None = None):
    mod = backend_for(k_cache, "gather_paged")
    if mod.__name__.endswith("cuda_ops"):  # the extension sizes its output itself
        return mod.gather_paged(k_cache, v_cache, block_table, rows, starts, ends)
    return mod.gather_paged(k_cache, v_cache, block_table, rows, starts, ends, cu)


def take_paged(k_cache, v_cache, pos_cache, blocks, offsets, idx, extra=()):
    """``(K, V, positions, *extra)`` of the packed tokens ``idx``; ``extra``: packed ``[N, H]``
    columns taken with them (Triton: two in the same launch)."""
    return backend_for(k_cache, "take_paged").take_paged(k_cache, v_cache, pos_cache, blocks, offsets, idx, extra)


def _selector(scores, cu: Ragged) -> ModuleType:
    """Triton's selection, or torch's (a sort) on a GPU for sets with rows past
    :data:`SELECT_TRITON_MAX_ROW` under ``auto``."""
    mod = backend_for(scores, "select_topk")
    long = cu.longest > SELECT_TRITON_MAX_ROW and envs.KVEVICT_KERNELS in ("auto", "cuda")
    return torch_ops if mod is not torch_ops and scores.is_cuda and long else mod


def select_topk(scores, pos, cu: Ragged | torch.Tensor, keep, packed_offset: int | None = None):
    cu = torch_ops.ragged(cu)
    return _selector(scores, cu).select_topk(scores, pos, cu, keep, packed_offset)


def select_split(scores, pos, cu: Ragged | torch.Tensor, keep, packed_offset: int = 0):
    """:func:`select_topk` into the packed tokens, with the tokens each row drops, ``[N - sum keep,
    H]`` (one launch with Triton: the selection writes both)."""
    cu = torch_ops.ragged(cu)
    return _selector(scores, cu).select_split(scores, pos, cu, keep, packed_offset)


def promote_topk(target, scores, pos, cu: Ragged | torch.Tensor, keep):
    """``target`` set to ``+inf`` at each row's top ``keep`` by ``scores`` (a selection that marks
    its winners instead of listing them: one launch with Triton)."""
    cu = torch_ops.ragged(cu)
    return _selector(scores, cu).promote_topk(target, scores, pos, cu, keep)


def scatter_paged(dst, src, idx, cu, cu_keep, block_table, rows, dst_start):
    mod = backend_for(dst, "scatter_paged")
    if mod.__name__.endswith("cuda_ops"):  # the extension takes tensors
        cu, cu_keep = (c.dev if isinstance(c, Ragged) else c for c in (cu, cu_keep))
    return mod.scatter_paged(dst, src, idx, cu, cu_keep, block_table, rows, dst_start)


def scatter_kv_paged(
    k_cache, v_cache, pos_cache, src, idx_kv, idx_pos, cu_keep, block_table, rows, dst_start, state=None
):
    """``state``: a :class:`~.torch_ops.StateWrite`, a per-slot state written with the kept tokens."""
    mod = backend_for(k_cache, "scatter_paged")
    if mod.__name__.endswith("cuda_ops"):  # the extension's scatter, once per cache
        zero = torch.zeros(rows.numel() + 1, dtype=torch.long, device=k_cache.device)
        writes = [(k_cache, src[0], idx_kv), (v_cache, src[1], idx_kv), (pos_cache, src[2], idx_pos)]
        writes += [(dst, state.src, state.idx) for dst in state.dsts] if state is not None else []
        for dst, x, idx in writes:
            scatter_paged(dst, x, idx, zero, cu_keep, block_table, rows, dst_start)
        return
    mod = backend_for(k_cache, "scatter_kv_paged")
    mod.scatter_kv_paged(
        k_cache, v_cache, pos_cache, src, idx_kv, idx_pos, cu_keep, block_table, rows, dst_start, state
    )


def record_slots(slot_pos, slots, positions, states=()):
    """A step's written slots' positions, and each per-slot state ``(t, init)`` reset (one launch
    with Triton for the positions and the first state)."""
    return backend_for(slot_pos, "record_slots").record_slots(slot_pos, slots, positions, list(states))


def column_sums(Q, K, q_pos, k_pos, cu_q, cu_k, G, scale, softcap=None, sinks=None):
    """``K`` and ``k_pos`` may be read where they are (:class:`~.torch_ops.PagedKeys`, both):
    Triton's kernels read them so; elsewhere they are gathered first."""
    mod = backend_for(K.cache if isinstance(K, PagedKeys) else K, "column_sums")
    if isinstance(K, PagedKeys) and not hasattr(mod, "column_sums_reads_pages"):
        K, k_pos = K.gather(), torch_ops.dense_positions(k_pos)
    return mod.column_sums(Q, K, q_pos, k_pos, cu_q, cu_k, G, scale, softcap, sinks)


def simhash_codes(x, R):
    return backend_for(x).simhash_codes(x, R)
