# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism: which KV heads this worker holds.

Written against vLLM 0.32.0 (``distributed/parallel_state.py``, ``model_executor/layers/linear.py``
``QKVParallelLinear``); the same in 0.33.0. Rank ``r`` of ``tp`` holds ``H / tp`` consecutive KV
heads, ``[r H / tp, (r + 1) H / tp)``, when the model has ``H >= tp`` of them; otherwise every KV
head is replicated on ``tp / H`` ranks and rank ``r`` holds head ``r // (tp / H)``. Query heads
and the rows of the output projection ``W_O`` are split the same way, so every quantity a policy
computes per KV head is computed on the rank that holds the head, from that rank's tensors alone.
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
