# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism: which KV heads this worker holds, and what its ranks agree on every step.

Written against vLLM 0.32.0 (``distributed/parallel_state.py``, ``model_executor/layers/linear.py``
``QKVParallelLinear``); the same in 0.33.0. Rank ``r`` of ``tp`` holds ``H / tp`` consecutive KV
heads, ``[r H / tp, (r + 1) H / tp)``, when the model has ``H >= tp`` of them; otherwise every KV
head is replicated on ``tp / H`` ranks and rank ``r`` holds head ``r // (tp / H)``. Query heads
and the rows of the output projection ``W_O`` are split the same way, so every quantity a policy
computes per KV head is computed on the rank that holds the head, from that rank's tensors alone.
What one rank alone learns (a policy that failed there) the ranks share once per step
(:func:`union_over_ranks`).
"""

from __future__ import annotations


def tensor_parallel() -> tuple[int, int]:
    """``(rank, world size)`` of this worker's tensor-parallel group (``(0, 1)`` outside one)."""
    try:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (AssertionError, RuntimeError):  # no distributed state (unit tests, tools)
        return 0, 1


def kv_heads_of_rank(rank: int, world: int, total_kv_heads: int) -> list[int]:
    """The model's KV head indices this rank holds, in the order of its cache."""
    if total_kv_heads >= world:
        n = total_kv_heads // world
        return list(range(rank * n, (rank + 1) * n))
    return [rank // (world // total_kv_heads)]


def union_over_ranks(items: frozenset[str]) -> frozenset[str]:
    """The union of ``items`` over this worker's tensor-parallel group, called by every rank at the
    same point of each step (``items`` itself without a group). One all-reduce of a flag on the
    group's CPU communicator, and only when some rank has an item, one all-gather of the items:
    host memory only, nothing the device waits for. vLLM 0.32/0.33: ``get_tp_group().cpu_group``
    (a gloo group beside the device one)."""
    rank, world = tensor_parallel()
    if world == 1:
        return items
    import torch
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group().cpu_group
    flag = torch.tensor([1 if items else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag[0]):
        return items
    gathered: list[list[str] | None] = [None] * world
    dist.all_gather_object(gathered, sorted(items), group=group)
    return frozenset(x for part in gathered for x in part or ())
