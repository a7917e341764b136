# SPDX-License-Identifier: Apache-2.0
"""Token-level reads and writes of the FLASH_ATTN / TRITON_ATTN KV cache layout.

vLLM 0.32.0 and 0.33.0 bind each layer's cache as ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``
(LBHNC); FlashAttention views it as ``K, V = cache.transpose(1, 2).split(head_dim, -1)``, i.e.
plain ``[num_blocks, block_size, H, D]`` strided views, so a token is one index away.
"""

from __future__ import annotations

import torch


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as ``[num_blocks, block_size, H, D]`` views (what the block-table kernels take)."""
    D = kv_cache.shape[-1] // 2
    return kv_cache.transpose(1, 2).split(D, dim=-1)


_views = cache_views


def gather_tokens(kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor):
    """K and V ``[n, H, D]`` of the tokens at (``blocks[i]``, ``offsets[i]``)."""
    K, V = _views(kv_cache)
    b, o = blocks.long(), offsets.long()
    return K[b, o], V[b, o]


def write_tokens(kv_cache: torch.Tensor, slots: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> None:
    """Write ``K``/``V`` ``[n, H, D]`` into physical ``slots`` (block * block_size + offset)."""
    Kc, Vc = _views(kv_cache)
    bs = kv_cache.shape[2]
    b, o = slots.long() // bs, slots.long() % bs
    Kc[b, o] = K.to(Kc.dtype)
    Vc[b, o] = V.to(Vc.dtype)


class FlashLayout:
    """:class:`~vllm_kvevict.backends.layout.CacheLayout` of the ``[num_blocks, H, block_size, 2 D]``
    cache of FLASH_ATTN and TRITON_ATTN."""

    def gather(self, kv_cache, blocks, offsets):
        return gather_tokens(kv_cache, blocks, offsets)

    def write(self, kv_cache, slots, K, V):
        write_tokens(kv_cache, slots, K, V)

    def views(self, kv_cache):
        return cache_views(kv_cache)


FLASH_LAYOUT = FlashLayout()
