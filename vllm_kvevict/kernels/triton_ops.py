# SPDX-License-Identifier: Apache-2.0
"""Triton kernels for the batched eviction operations; same signatures and semantics as
:mod:`vllm_kvevict.kernels.torch_ops` (the specification, see its docstring). They also run on CPU
tensors under ``TRITON_INTERPRET=1``, which is how CI tests them.

Grids: ``gather_paged`` and ``scatter_paged`` run one program per (row, tile of tokens, KV head);
``keydiff_scores`` and ``select_topk`` one per (row, KV head), looping over the row's tokens in
tiles, so no ``[H, n, n]`` or per-row padding is ever materialised. ``select_topk`` finds the
``keep``-th largest (score, position) key exactly by building it bit by bit (63 counting passes
over the row), then writes the kept indices in token order with a running prefix sum: exact and
deterministic, whatever the row length.

``column_sums`` (attention rows for SnapKV, TOVA, H2O, CAOTE, CriticalKV) takes every row of a step
in two launches with grids (query head, row, tile): per-query log-sum-exp, then per-key sums.

The policy kernels: ``simhash_codes`` one program per tile of vectors, a loop over the bits;
``lshe_victims_ragged`` one per (KV head, row), the Hamming distances (XOR and a bit-trick
popcount on the packed codes) summed over the group on the fly; ``projected_value_norms`` one per
(KV head, tile of tokens), looping over the group's heads and over ``D`` in tiles, only per-token
sums leaving the program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_kvevict.kernels.torch_ops import EPS, ONE_MINUS_MIN, PagedKeys, Ragged, cu_from_lengths, keep_counts, ragged

TILE = 128


@triton.jit
def _row_range(cu_ptr, r):
    """Row ``r``'s first packed index and its length, from ``cu``."""
    lo = tl.load(cu_ptr + r)
    return lo, tl.load(cu_ptr + r + 1) - lo


@triton.jit
def _key_offsets(blk_ptr, off_ptr, tok, m, h, d, s_b, s_o, s_h, s_d, PAGED: tl.constexpr):
    """Element offsets ``[tokens, d]`` of packed tokens ``tok`` at head ``h``: in a packed
    ``[N, H, D]`` tensor (token stride ``s_b``), or, ``PAGED``, in a cache view
    ``[blocks, block_size, H, D]`` at the tokens' blocks and offsets (:class:`PagedKeys`)."""
    if PAGED:
        b = tl.load(blk_ptr + tok, mask=m, other=0).to(tl.int64)
        o = tl.load(off_ptr + tok, mask=m, other=0).to(tl.int64)
        row = b * s_b + o * s_o
    else:
        row = tok.to(tl.int64) * s_b
    return row[:, None] + h * s_h + d[None, :] * s_d


@triton.jit
def _pos_at(p_ptr, blk_ptr, off_ptr, tok, m, h, p_b, p_o, p_h, PAGED: tl.constexpr):
    """The positions of packed tokens ``tok`` at head ``h``: in a packed ``[N, H]`` tensor (token
    stride ``p_b``), or, ``PAGED``, in the slot positions viewed ``[blocks, block_size, H]``."""
    if PAGED:
        b = tl.load(blk_ptr + tok, mask=m, other=0).to(tl.int64)
        o = tl.load(off_ptr + tok, mask=m, other=0).to(tl.int64)
        at = b * p_b + o * p_o + h * p_h
    else:
        at = tok.to(tl.int64) * p_b + h * p_h
    return tl.load(p_ptr + at, mask=m, other=0)


@triton.jit
def _logical_slots(bt_ptr, rows_ptr, start_ptr, r, j, m, s_bt, bs):
    """Block and offset of row ``r``'s logical tokens ``start[r] + j``, through its block table."""
    tok = tl.load(start_ptr + r).to(tl.int64) + j
    row = tl.load(rows_ptr + r).to(tl.int64)
    return tl.load(bt_ptr + row * s_bt + tok // bs, mask=m, other=0).to(tl.int64), tok % bs


@triton.jit
def _gather_kernel(
    k_ptr,
    v_ptr,
    bt_ptr,
    rows_ptr,
    starts_ptr,
    cu_ptr,
    ok_ptr,
    ov_ptr,
    s_b,
    s_o,
    s_h,
    s_d,
    s_bt,
    bs,
    D: tl.constexpr,
    TILE_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    H: tl.constexpr,
):
    r = tl.program_id(0)
    t = tl.program_id(1) * TILE_T + tl.arange(0, TILE_T)
    h = tl.program_id(2)
    lo, n = _row_range(cu_ptr, r)
    m = t < n
    blk, off = _logical_slots(bt_ptr, rows_ptr, starts_ptr, r, t, m, s_bt, bs)
    d = tl.arange(0, BLOCK_D)
    md = m[:, None] & (d[None, :] < D)
    src = blk[:, None] * s_b + off[:, None] * s_o + h * s_h + d[None, :] * s_d
    dst = ((lo + t)[:, None] * H + h) * D + d[None, :]
    tl.store(ok_ptr + dst, tl.load(k_ptr + src, mask=md), mask=md)
    tl.store(ov_ptr + dst, tl.load(v_ptr + src, mask=md), mask=md)


@triton.jit
def _take_kernel(
    k_ptr,
    v_ptr,
    p_ptr,
    blk_ptr,
    off_ptr,
    idx_ptr,
    ok_ptr,
    ov_ptr,
    op_ptr,
    x1_ptr,
    x2_ptr,
    o1_ptr,
    o2_ptr,
    M,
    s_b,
    s_o,
    s_h,
    s_d,
    p_b,
    p_o,
    p_h,
    H: tl.constexpr,
    D: tl.constexpr,
    TILE_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EXTRA: tl.constexpr,
):
    """Grid (tile, head): K, V and the position of tokens ``idx[j, h]`` (packed indices read
    through their blocks and offsets) into ``[M, H, D]`` and ``[M, H]``, and ``EXTRA`` (0-2)
    packed ``[N, H]`` columns at the same indices."""
    j = (tl.program_id(0) * TILE_T + tl.arange(0, TILE_T)).to(tl.int64)
    h = tl.program_id(1)
    m = j < M
    tok = tl.load(idx_ptr + j * H + h, mask=m, other=0)
    d = tl.arange(0, BLOCK_D)
    src = _key_offsets(blk_ptr, off_ptr, tok, m, h, d, s_b, s_o, s_h, s_d, True)
    md = m[:, None] & (d[None, :] < D)
    dst = (j[:, None] * H + h) * D + d[None, :]
    tl.store(ok_ptr + dst, tl.load(k_ptr + src, mask=md), mask=md)
    tl.store(ov_ptr + dst, tl.load(v_ptr + src, mask=md), mask=md)
    p = _pos_at(p_ptr, blk_ptr, off_ptr, tok, m, h, p_b, p_o, p_h, True)
    tl.store(op_ptr + j * H + h, p.to(op_ptr.dtype.element_ty), mask=m)
    if EXTRA > 0:
        tl.store(o1_ptr + j * H + h, tl.load(x1_ptr + tok * H + h, mask=m), mask=m)
        if EXTRA > 1:
            tl.store(o2_ptr + j * H + h, tl.load(x2_ptr + tok * H + h, mask=m), mask=m)


def take_paged(k_cache, v_cache, pos_cache, blocks, offsets, idx, extra=()):
    assert k_cache.stride() == v_cache.stride()
    M, H = idx.shape
    D = k_cache.shape[-1]
    K = torch.empty(M, H, D, dtype=k_cache.dtype, device=k_cache.device)
    V = torch.empty_like(K)
    pos = torch.empty(M, H, dtype=torch.int64, device=pos_cache.device)
    xs = [x.contiguous() for x in extra[:2]]
    outs = [torch.empty(M, H, dtype=x.dtype, device=x.device) for x in xs]
    rest = [x[idx, torch.arange(H, device=idx.device)] for x in extra[2:]]
    if M:
        grid = (triton.cdiv(M, TILE), H)
        _take_kernel[grid](
            k_cache,
            v_cache,
            pos_cache,
            blocks,
            offsets,
            idx.contiguous(),
            K,
            V,
            pos,
            *(xs + [pos, pos])[:2],
            *(outs + [pos, pos])[:2],
            M,
            *k_cache.stride(),
            *pos_cache.stride(),
            H=H,
            D=D,
            TILE_T=TILE,
            BLOCK_D=triton.next_power_of_2(D),
            EXTRA=len(xs),
        )
    return (K, V, pos, *outs, *rest)


def gather_paged(k_cache, v_cache, block_table, rows, starts, ends, cu: Ragged | None = None):
    assert k_cache.stride() == v_cache.stride()
    nb, bs, H, D = k_cache.shape
    rc = cu if cu is not None else ragged(cu_from_lengths((ends - starts).long()))
    offsets, N = rc.dev, rc.total
    K = torch.empty(N, H, D, dtype=k_cache.dtype, device=k_cache.device)
    V = torch.empty_like(K)
    R = rows.numel()
    if N == 0:
        return K, V, offsets
    grid = (R, triton.cdiv(rc.longest, TILE), H)
    _gather_kernel[grid](
        k_cache,
        v_cache,
        block_table,
        rows,
        starts,
        offsets,
        K,
        V,
        *k_cache.stride(),
        block_table.stride(0),
        bs,
        D=D,
        TILE_T=TILE,
        BLOCK_D=triton.next_power_of_2(D),
        H=H,
    )
    return K, V, offsets


#: keydiff (and K-norm): tokens per row chunk, on average over the set, and at most this many chunks per row (as
#: csrc/): a long row is scored by many programs, not one per (row, head)
KEYDIFF_CHUNK, KEYDIFF_MAX_SPLITS = 2048, 32


def _splits(N: int) -> int:
    """How many programs share each row of a set of ``N`` tokens (:data:`KEYDIFF_CHUNK`)."""
    return max(1, min(KEYDIFF_MAX_SPLITS, triton.cdiv(N, KEYDIFF_CHUNK)))


@triton.jit
def _keydiff_partial_kernel(
    k_ptr,
    blk_ptr,
    off_ptr,
    s_b,
    s_o,
    s_h,
    s_d,
    cu_ptr,
    part_ptr,
    S,
    D: tl.constexpr,
    TILE_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EPS_: tl.constexpr,
    PAGED: tl.constexpr,
):
    """Pass 1, grid (row, head, chunk): the chunk's sum of normalised keys into ``part[r, h, s]``."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    lo, n = _row_range(cu_ptr, r)
    chunk = (n + S - 1) // S
    t0 = s * chunk
    t1 = tl.minimum(n, t0 + chunk)
    d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in tl.range(t0, t1, TILE_T):
        t = start + tl.arange(0, TILE_T)
        m = (t < t1)[:, None] & (d[None, :] < D)
        at = _key_offsets(blk_ptr, off_ptr, lo + t, t < t1, h, d, s_b, s_o, s_h, s_d, PAGED)
        k = tl.load(k_ptr + at, mask=m, other=0.0).to(tl.float32)
        norm = tl.sqrt(tl.sum(k * k, axis=1))
        acc += tl.sum(k / tl.maximum(norm, EPS_)[:, None], axis=0)
    tl.store(part_ptr + ((r * tl.num_programs(1) + h) * S + s) * BLOCK_D + d, acc)


@triton.jit
def _keydiff_cos_kernel(
    k_ptr,
    blk_ptr,
    off_ptr,
    s_b,
    s_o,
    s_h,
    s_d,
    cu_ptr,
    part_ptr,
    out_ptr,
    S,
    D: tl.constexpr,
    TILE_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EPS_: tl.constexpr,
    PAGED: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Pass 2, grid (row, head, chunk): the anchor ``mu`` (the row's partial sums over ``n``), then
    ``-cos(k, mu)`` for the chunk's tokens."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    H = tl.num_programs(1)
    lo, n = _row_range(cu_ptr, r)
    d = tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_S)
    part = tl.load(part_ptr + ((r * H + h) * S + j)[:, None] * BLOCK_D + d[None, :], mask=(j < S)[:, None], other=0.0)
    mu = tl.sum(part, axis=0) / tl.where(n > 0, n, 1).to(tl.float32)
    mu_norm = tl.sqrt(tl.sum(mu * mu, axis=0))
    chunk = (n + S - 1) // S
    t0 = s * chunk
    t1 = tl.minimum(n, t0 + chunk)
    for start in tl.range(t0, t1, TILE_T):
        t = start + tl.arange(0, TILE_T)
        mt = t < t1
        m = mt[:, None] & (d[None, :] < D)
        at = _key_offsets(blk_ptr, off_ptr, lo + t, mt, h, d, s_b, s_o, s_h, s_d, PAGED)
        k = tl.load(k_ptr + at, mask=m, other=0.0).to(tl.float32)
        norm = tl.sqrt(tl.sum(k * k, axis=1))
        cos = tl.sum(k * mu[None, :], axis=1) / tl.maximum(mu_norm * norm, EPS_)
        tl.store(out_ptr + (lo + t) * H + h, -cos, mask=mt)


def _keydiff(k, blk, off, strides, N: int, H: int, D: int, cu, paged: bool) -> torch.Tensor:
    out = torch.empty(N, H, dtype=torch.float32, device=k.device)
    if N:
        R, S, BD = cu.numel() - 1, _splits(N), triton.next_power_of_2(D)
        part = torch.empty(R, H, S, BD, dtype=torch.float32, device=k.device)
        meta = dict(D=D, TILE_T=TILE, BLOCK_D=BD, EPS_=EPS, PAGED=paged)
        _keydiff_partial_kernel[(R, H, S)](k, blk, off, *strides, cu, part, S, **meta)
        _keydiff_cos_kernel[(R, H, S)](
            k, blk, off, *strides, cu, part, out, S, BLOCK_S=triton.next_power_of_2(S), **meta
        )
    return out


def keydiff_scores(K, cu):
    N, H, D = K.shape
    K = K.contiguous()
    return _keydiff(K, K, K, (H * D, 0, D, 1), N, H, D, cu, paged=False)


def keydiff_scores_paged(keys: PagedKeys, cu):
    """:func:`keydiff_scores` of keys read in place through their blocks: no gathered copy."""
    _, _, H, D = keys.cache.shape
    return _keydiff(keys.cache, keys.blocks, keys.offsets, keys.cache.stride(), keys.blocks.numel(), H, D, cu, True)


@triton.jit
def _knorm_kernel(
    k_ptr,
    blk_ptr,
    off_ptr,
    s_b,
    s_o,
    s_h,
    s_d,
    p_ptr,
    pblk_ptr,
    poff_ptr,
    p_b,
    p_o,
    p_h,
    cu_ptr,
    L_ptr,
    out_ptr,
    S,
    SINK,
    RECENT,
    D: tl.constexpr,
    TILE_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr,
):
    """Grid (row, head, chunk): ``-||k||`` of the chunk's tokens, ``+inf`` at positions below
    ``SINK`` or among the row's last ``RECENT``; keys and positions packed or read in place."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    lo, n = _row_range(cu_ptr, r)
    L = tl.load(L_ptr + r)
    chunk = (n + S - 1) // S
    t0 = tl.program_id(2) * chunk
    t1 = tl.minimum(n, t0 + chunk)
    d = tl.arange(0, BLOCK_D)
    for start in tl.range(t0, t1, TILE_T):
        t = start + tl.arange(0, TILE_T)
        mt = t < t1
        at = _key_offsets(blk_ptr, off_ptr, lo + t, mt, h, d, s_b, s_o, s_h, s_d, PAGED)
        k = tl.load(k_ptr + at, mask=mt[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
        p = _pos_at(p_ptr, pblk_ptr, poff_ptr, lo + t, mt, h, p_b, p_o, p_h, PAGED)
        s = -tl.sqrt(tl.sum(k * k, axis=1))
        s = tl.where((p < SINK) | (p >= L - RECENT), float("inf"), s)
        tl.store(out_ptr + (lo + t) * H + h, s, mask=mt)


def _knorm(k, blk, off, strides, pos, p_strides, N: int, H: int, D: int, cu, L, sink: int, recent: int):
    out = torch.empty(N, H, dtype=torch.float32, device=k.device)
    if N:
        R, S = cu.numel() - 1, _splits(N)
        meta = dict(D=D, TILE_T=TILE, BLOCK_D=triton.next_power_of_2(D), PAGED=isinstance(pos, PagedKeys))
        p = (pos.cache, pos.blocks, pos.offsets) if isinstance(pos, PagedKeys) else (pos, pos, pos)
        _knorm_kernel[(R, H, S)](
            k, blk, off, *strides, *p, *p_strides, cu, L.long().contiguous(), out, S, sink, recent, **meta
        )
    return out


def knorm_scores(K, pos, cu, L, sink: int, recent: int):
    N, H, D = K.shape
    K, pos = K.contiguous(), pos.contiguous()
    return _knorm(K, K, K, (H * D, 0, D, 1), pos, (pos.stride(0), 0, pos.stride(1)), N, H, D, cu, L, sink, recent)


def knorm_scores_paged(keys: PagedKeys, pos, cu, L, sink: int, recent: int):
    """:func:`knorm_scores` of keys and positions read in place through their blocks: no gathered
    copy (``pos``: the positions' :class:`PagedKeys`)."""
    _, _, H, D = keys.cache.shape
    N = keys.blocks.numel()
    p_strides = pos.cache.stride()[:3]
    return _knorm(
        keys.cache, keys.blocks, keys.offsets, keys.cache.stride(), pos, p_strides, N, H, D, cu, L, sink, recent
    )


@triton.jit
def _pool_kernel(x_ptr, s_ptr, e_ptr, out_ptr, N, C, PAD: tl.constexpr, AVG: tl.constexpr, TILE_T: tl.constexpr):
    """Grid (token tile, column): each token pooled over its segment, the neighbours added (or
    maxed) in the statement's order, so the bits are the torch statement's."""
    i = (tl.program_id(0) * TILE_T + tl.arange(0, TILE_T)).to(tl.int64)
    c = tl.program_id(1)
    m = i < N
    start = tl.load(s_ptr + i, mask=m, other=0)
    end = tl.load(e_ptr + i, mask=m, other=0)
    fill = 0.0 if AVG else float("-inf")
    j = i - PAD
    acc = tl.load(x_ptr + j * C + c, mask=m & (j >= start) & (j < end) & (j >= 0), other=fill)
    for o in tl.static_range(1, 2 * PAD + 1):
        j = i - PAD + o
        v = tl.load(x_ptr + j * C + c, mask=m & (j >= start) & (j < end) & (j >= 0), other=fill)
        acc = acc + v if AVG else tl.maximum(acc, v)
    if AVG:
        acc = acc / (2 * PAD + 1)
    tl.store(out_ptr + i * C + c, acc, mask=m)


def pool_segments(x, start, end, kernel: int, mode: str):
    if kernel <= 1 or x.shape[0] == 0:
        return x
    N, C = x.shape
    x = x.float().contiguous()
    out = torch.empty_like(x)
    _pool_kernel[(triton.cdiv(N, TILE), C)](
        x, start.contiguous(), end.contiguous(), out, N, C, PAD=kernel // 2, AVG=mode == "avg", TILE_T=TILE
    )
    return out


@triton.jit
def _snapkv_kernel(
    a_ptr,
    row_ptr,
    cu_ptr,
    m_ptr,
    L_ptr,
    p_ptr,
    blk_ptr,
    off_ptr,
    out_ptr,
    N,
    p_b,
    p_o,
    p_h,
    HQ: tl.constexpr,
    G: tl.constexpr,
    WINDOW: tl.constexpr,
    PAD: tl.constexpr,
    AVG: tl.constexpr,
    PROTECT: tl.constexpr,
    PAGED: tl.constexpr,
    TILE_T: tl.constexpr,
):
    """Grid (token tile, KV head): each token's mean over its query window, pooled within its
    row's prefix (raw in the row's last ``WINDOW`` slots), averaged over the head's query group;
    ``PROTECT``: ``+inf`` where its position is among the row's last ``WINDOW``."""
    i = (tl.program_id(0) * TILE_T + tl.arange(0, TILE_T)).to(tl.int64)
    h = tl.program_id(1)
    ok = i < N
    r = tl.load(row_ptr + i, mask=ok, other=0)
    start = tl.load(cu_ptr + r, mask=ok, other=0)
    end = tl.load(cu_ptr + r + 1, mask=ok, other=0)
    L = tl.load(L_ptr + r, mask=ok, other=0)
    m = tl.load(m_ptr + r, mask=ok, other=1).to(tl.float32)
    pre_end = end - tl.minimum(tl.minimum(L, WINDOW), end - start)
    in_pre = i < pre_end
    fill = 0.0 if AVG else float("-inf")
    total = tl.zeros([TILE_T], dtype=tl.float32)
    for g in tl.static_range(G):
        c = h * G + g
        own = tl.load(a_ptr + i * HQ + c, mask=ok, other=0.0) / m
        j = i - PAD
        acc = tl.load(a_ptr + j * HQ + c, mask=ok & in_pre & (j >= start) & (j < pre_end), other=fill) / m
        for o in tl.static_range(1, 2 * PAD + 1):
            j = i - PAD + o
            v = tl.load(a_ptr + j * HQ + c, mask=ok & in_pre & (j >= start) & (j < pre_end), other=fill) / m
            acc = acc + v if AVG else tl.maximum(acc, v)
        if AVG:
            acc = acc / (2 * PAD + 1)
        total += tl.where(in_pre, acc, own)
    s = total / G
    if PROTECT:
        p = _pos_at(p_ptr, blk_ptr, off_ptr, i, ok, h, p_b, p_o, p_h, PAGED)
        s = tl.where(p >= L - WINDOW, float("inf"), s)
    tl.store(out_ptr + i * (HQ // G) + h, s, mask=ok)


def snapkv_scores(A, pos, row, cu, m, L, G: int, window: int, kernel: int, pooling: str, protect: bool):
    N, Hq = A.shape
    H = Hq // G
    out = torch.empty(N, H, dtype=torch.float32, device=A.device)
    if N == 0:
        return out
    paged = isinstance(pos, PagedKeys)
    if paged:
        p, blk, off = pos.cache, pos.blocks, pos.offsets
        strides = pos.cache.stride()[:3]
    else:
        p = pos.contiguous()
        blk = off = p
        strides = (p.stride(0), 0, p.stride(1))
    _snapkv_kernel[(triton.cdiv(N, TILE), H)](
        A.float().contiguous(),
        row.long().contiguous(),
        cu.long().contiguous(),
        m.contiguous(),
        L.long().contiguous(),
        p,
        blk,
        off,
        out,
        N,
        *strides,
        HQ=Hq,
        G=G,
        WINDOW=window,
        PAD=kernel // 2,
        AVG=pooling == "avg",
        PROTECT=protect,
        PAGED=paged,
        TILE_T=TILE,
    )
    return out


@triton.jit
def _h2o_observe_kernel(a_ptr, acc_ptr, N, a_t, a_c, c_t, c_h, G: tl.constexpr, TILE_T: tl.constexpr):
    """Grid (token tile, KV head): the group's attention sums averaged, added to the accumulators."""
    i = (tl.program_id(0) * TILE_T + tl.arange(0, TILE_T)).to(tl.int64)
    h = tl.program_id(1)
    ok = i < N
    total = tl.zeros([TILE_T], dtype=tl.float32)
    for g in tl.static_range(G):
        total += tl.load(a_ptr + i * a_t + (h * G + g) * a_c, mask=ok, other=0.0).to(tl.float32)
    at = acc_ptr + i * c_t + h * c_h
    tl.store(at, tl.load(at, mask=ok, other=0.0) + total / G, mask=ok)


def h2o_observe_columns(A, acc, G: int):
    N, H = acc.shape
    if N:
        _h2o_observe_kernel[(triton.cdiv(N, TILE), H)](A, acc, N, *A.stride(), *acc.stride(), G=G, TILE_T=TILE)
    return acc


@triton.jit
def _sort_key(s, p):
    """int64 key ordering (score, position); see torch_ops.sort_keys."""
    bits = (s + 0.0).to(tl.int32, bitcast=True).to(tl.int64)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + 2147483648
    return (ordered << 31) | p.to(tl.int64)


@triton.jit
def _select_kernel(
    s_ptr,
    p_ptr,
    blk_ptr,
    off_ptr,
    cu_ptr,
    cuk_ptr,
    out_ptr,
    drop_ptr,
    offset,
    p_b,
    p_o,
    p_h,
    H: tl.constexpr,
    TILE_T: tl.constexpr,
    PACKED: tl.constexpr,
    PAGED: tl.constexpr,
    DROP: tl.constexpr,
    MARK: tl.constexpr,
):
    """Grid (row, head): the row's kept tokens (at most its length, ``cu_keep``), as row-local
    indices (``PACKED``: packed ones plus ``offset``); positions read where they are (``PAGED``);
    ``DROP``: the others too, at ``drop_ptr`` (the row's from ``cu[r] - cu_keep[r]``); ``MARK``: no
    indices, ``out_ptr`` (packed ``[N, H]`` scores) set to ``+inf`` at the kept tokens instead."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    lo, n = _row_range(cu_ptr, r)
    out0, keep = _row_range(cuk_ptr, r)
    keep = keep.to(tl.int64)
    shift = (lo + offset).to(tl.int64) if PACKED else tl.zeros([], dtype=tl.int64)
    # The keep-th largest key, built from the top bit down: the largest T with count(key >= T) >= keep.
    T = tl.zeros([], dtype=tl.int64)
    if keep < n:
        for i in tl.range(0, 63):
            cand = T | (tl.full([], 1, tl.int64) << (62 - i))
            cnt = tl.zeros([], dtype=tl.int64)
            for start in tl.range(0, n, TILE_T):
                t = start + tl.arange(0, TILE_T)
                m = t < n
                s = tl.load(s_ptr + (lo + t) * H + h, mask=m, other=0.0)
                p = _pos_at(p_ptr, blk_ptr, off_ptr, lo + t, m, h, p_b, p_o, p_h, PAGED)
                cnt += tl.sum(((_sort_key(s, p) >= cand) & m).to(tl.int64), axis=0)
            T = tl.where(cnt >= keep, cand, T)
    base = tl.zeros([], dtype=tl.int64)
    for start in tl.range(0, n, TILE_T):  # kept indices in token order (and the dropped ones)
        t = start + tl.arange(0, TILE_T)
        m = t < n
        s = tl.load(s_ptr + (lo + t) * H + h, mask=m, other=0.0)
        p = _pos_at(p_ptr, blk_ptr, off_ptr, lo + t, m, h, p_b, p_o, p_h, PAGED)
        k = ((_sort_key(s, p) >= T) & m).to(tl.int64)
        at = base + tl.cumsum(k, axis=0) - 1
        if MARK:
            tl.store(out_ptr + (lo + t) * H + h, float("inf"), mask=k > 0)
        else:
            tl.store(out_ptr + (out0 + at) * H + h, t.to(tl.int64) + shift, mask=k > 0)
        if DROP:  # token t is the (t - kept before it)-th dropped
            gone = (lo - out0) + t - at - 1
            tl.store(drop_ptr + gone * H + h, t.to(tl.int64) + shift, mask=m & (k == 0))
        base += tl.sum(k, axis=0)


def select_topk(scores, pos, cu, keep, packed_offset: int | None = None):
    out, kept, _ = _select(scores, pos, cu, keep, packed_offset, False)
    return out, kept


def select_split(scores, pos, cu, keep, packed_offset: int = 0):
    out, _, drop = _select(scores, pos, cu, keep, packed_offset, True)
    return out, drop


def promote_topk(target, scores, pos, cu, keep):
    assert target.shape == scores.shape and target.dtype == torch.float32
    marked = target if target.is_contiguous() else target.contiguous()
    _select(scores, pos, cu, keep, None, False, marked)
    return target if marked is target else target.copy_(marked)


def _select(scores, pos, cu, keep, packed_offset: int | None, split: bool, mark=None):
    N, H = scores.shape
    cu = ragged(cu)
    kept = Ragged.of(keep_counts(cu, keep), scores.device)
    out = mark if mark is not None else torch.empty(kept.total, H, dtype=torch.int64, device=scores.device)
    drop = torch.empty(N - kept.total if split else 0, H, dtype=torch.int64, device=scores.device)
    if N:
        if isinstance(pos, PagedKeys):  # the slot positions, viewed [blocks, block_size, H]
            p, blk, off, strides = pos.cache, pos.blocks, pos.offsets, pos.cache.stride()
        else:
            p = pos.contiguous()
            blk, off, strides = p, p, (H, 0, 1)
        _select_kernel[(cu.rows, H)](
            scores.float().contiguous(),
            p,
            blk,
            off,
            cu.dev,
            kept.dev,
            out,
            drop,
            packed_offset or 0,
            *strides,
            H=H,
            TILE_T=TILE,
            PACKED=packed_offset is not None,
            PAGED=isinstance(pos, PagedKeys),
            DROP=split,
            MARK=mark is not None,
        )
    return out, kept.dev, drop


@triton.jit
def _scatter_kernel(
    dst_ptr,
    src_ptr,
    idx_ptr,
    cu_ptr,
    cuk_ptr,
    bt_ptr,
    rows_ptr,
    dstart_ptr,
    s_b,
    s_o,
    s_h,
    s_d,
    s_bt,
    bs,
    H: tl.constexpr,
    D: tl.constexpr,
    TILE_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0)
    j = tl.program_id(1) * TILE_T + tl.arange(0, TILE_T)
    h = tl.program_id(2)
    k0, n_keep = _row_range(cuk_ptr, r)
    m = j < n_keep
    i = tl.load(idx_ptr + (k0 + j) * H + h, mask=m, other=0)
    src_tok = tl.load(cu_ptr + r) + i
    blk, off = _logical_slots(bt_ptr, rows_ptr, dstart_ptr, r, j, m, s_bt, bs)
    d = tl.arange(0, BLOCK_D)
    md = m[:, None] & (d[None, :] < D)
    val = tl.load(src_ptr + (src_tok[:, None] * H + h) * D + d[None, :], mask=md)
    dst = blk[:, None] * s_b + off[:, None] * s_o + h * s_h + d[None, :] * s_d
    tl.store(dst_ptr + dst, val.to(dst_ptr.dtype.element_ty), mask=md)


def scatter_paged(dst, src, idx, cu, cu_keep, block_table, rows, dst_start):
    nb, bs, H = dst.shape[:3]
    D = dst.shape[3] if dst.dim() == 4 else 1
    strides = list(dst.stride()) + ([0] if dst.dim() == 3 else [])
    src = src.reshape(src.shape[0], H, D).contiguous()
    kept = ragged(cu_keep)
    if kept.total == 0:
        return
    grid = (rows.numel(), triton.cdiv(kept.longest, TILE), H)
    _scatter_kernel[grid](
        dst,
        src,
        idx.contiguous(),
        cu.dev if isinstance(cu, Ragged) else cu,
        kept.dev,
        block_table,
        rows,
        dst_start,
        *strides,
        block_table.stride(0),
        bs,
        H=H,
        D=D,
        TILE_T=TILE,
        BLOCK_D=triton.next_power_of_2(D),
    )


@triton.jit
def _record_kernel(
    sp_ptr,
    slots_ptr,
    pos_ptr,
    st_ptr,
    n,
    init,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TILE_T: tl.constexpr,
    STATE: tl.constexpr,
):
    """Grid (tile): each written slot's position in every head, and a state's initial value."""
    t = (tl.program_id(0) * TILE_T + tl.arange(0, TILE_T)).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    m = (t < n)[:, None] & (h < H)[None, :]
    at = tl.load(slots_ptr + t, mask=t < n, other=0).to(tl.int64)[:, None] * H + h[None, :]
    p = tl.load(pos_ptr + t, mask=t < n, other=0)
    tl.store(sp_ptr + at, tl.broadcast_to(p[:, None], (TILE_T, BLOCK_H)).to(sp_ptr.dtype.element_ty), mask=m)
    if STATE:
        tl.store(st_ptr + at, tl.full((TILE_T, BLOCK_H), init, tl.float32).to(st_ptr.dtype.element_ty), mask=m)


def record_slots(slot_pos, slots, positions, states):
    n, H = slots.numel(), slot_pos.shape[1]
    assert slot_pos.is_contiguous() and all(t.is_contiguous() and t.shape == slot_pos.shape for t, _ in states)
    if n:
        st, init = states[0] if states else (slot_pos, 0)
        grid = (triton.cdiv(n, TILE),)
        args = (slot_pos, slots.contiguous(), positions.contiguous(), st, n, float(init))
        _record_kernel[grid](*args, H=H, BLOCK_H=triton.next_power_of_2(H), TILE_T=TILE, STATE=bool(states))
        for t, init in states[1:]:
            t[slots] = init


@triton.jit
def _put_column(dst_ptr, src_ptr, idx_ptr, at, m, h, H: tl.constexpr, where):
    """``src[idx[at], h]`` of a packed ``[N, H]`` column stored at ``dst + where``; returned."""
    x = tl.load(src_ptr + tl.load(idx_ptr + at, mask=m, other=0).to(tl.int64) * H + h, mask=m)
    tl.store(dst_ptr + where, x.to(dst_ptr.dtype.element_ty), mask=m)
    return x


@triton.jit
def _scatter_kv_kernel(
    k_ptr,
    v_ptr,
    p_ptr,
    ks_ptr,
    vs_ptr,
    ps_ptr,
    ikv_ptr,
    ipos_ptr,
    st_ptr,
    ist_ptr,
    d1_ptr,
    d2_ptr,
    cuk_ptr,
    bt_ptr,
    rows_ptr,
    dstart_ptr,
    s_b,
    s_o,
    s_h,
    s_d,
    p_b,
    p_o,
    p_h,
    q_b,
    q_o,
    q_h,
    s_bt,
    bs,
    H: tl.constexpr,
    D: tl.constexpr,
    TILE_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STATES: tl.constexpr,
):
    """Grid (row, tile, head): the row's kept K, V (packed sources at ``idx_kv``) and positions
    (at ``idx_pos``) written at its logical tokens from ``dst_start``, and a per-slot state (at its
    own indices) to ``STATES`` stores (0-2); each slot found once."""
    r = tl.program_id(0)
    j = tl.program_id(1) * TILE_T + tl.arange(0, TILE_T)
    h = tl.program_id(2)
    k0, n_keep = _row_range(cuk_ptr, r)
    m = j < n_keep
    at = (k0 + j).to(tl.int64) * H + h
    i = tl.load(ikv_ptr + at, mask=m, other=0).to(tl.int64)
    blk, off = _logical_slots(bt_ptr, rows_ptr, dstart_ptr, r, j, m, s_bt, bs)
    d = tl.arange(0, BLOCK_D)
    md = m[:, None] & (d[None, :] < D)
    src = (i[:, None] * H + h) * D + d[None, :]
    dst = blk[:, None] * s_b + off[:, None] * s_o + h * s_h + d[None, :] * s_d
    tl.store(k_ptr + dst, tl.load(ks_ptr + src, mask=md).to(k_ptr.dtype.element_ty), mask=md)
    tl.store(v_ptr + dst, tl.load(vs_ptr + src, mask=md).to(v_ptr.dtype.element_ty), mask=md)
    _put_column(p_ptr, ps_ptr, ipos_ptr, at, m, h, H, blk * p_b + off * p_o + h * p_h)
    if STATES > 0:
        q = blk * q_b + off * q_o + h * q_h
        x = _put_column(d1_ptr, st_ptr, ist_ptr, at, m, h, H, q)
        if STATES > 1:
            tl.store(d2_ptr + q, x.to(d2_ptr.dtype.element_ty), mask=m)


def scatter_kv_paged(
    k_cache, v_cache, pos_cache, src, idx_kv, idx_pos, cu_keep, block_table, rows, dst_start, state=None
):
    assert k_cache.stride() == v_cache.stride()
    nb, bs, H, D = k_cache.shape
    K, V, pos = (x.contiguous() for x in src)
    kept = ragged(cu_keep)
    if kept.total == 0:
        return
    dsts: tuple[torch.Tensor, ...] = state.dsts if state is not None else ()
    assert len(dsts) <= 2 and all(d.stride() == dsts[0].stride() and d.dtype == dsts[0].dtype for d in dsts)
    st, ist = (state.src.contiguous(), state.idx.contiguous()) if state is not None else (pos, idx_pos)
    d1, d2 = (*dsts, pos_cache, pos_cache)[:2]
    grid = (rows.numel(), triton.cdiv(kept.longest, TILE), H)
    _scatter_kv_kernel[grid](
        k_cache,
        v_cache,
        pos_cache,
        K,
        V,
        pos,
        idx_kv.contiguous(),
        idx_pos.contiguous(),
        st,
        ist,
        d1,
        d2,
        kept.dev,
        block_table,
        rows,
        dst_start,
        *k_cache.stride(),
        *pos_cache.stride(),
        *d1.stride(),
        block_table.stride(0),
        bs,
        H=H,
        D=D,
        TILE_T=TILE,
        BLOCK_D=triton.next_power_of_2(D),
        STATES=len(dsts),
    )


@triton.jit
def _scores_tile(
    q_ptr,
    qp_ptr,
    keys,
    ks,
    ps,
    hq,
    q0,
    qi,
    m,
    k0,
    ki,
    n,
    HQ: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    scale,
    softcap,
    HAS_CAP: tl.constexpr,
    PAGED: tl.constexpr,
):
    """Scaled (soft-capped) logits of the row's queries ``qi`` x keys ``ki`` (row-local; the row
    starts at packed query ``q0`` and key ``k0``) of query head ``hq``, masked causally by position
    (-inf where the key is newer than the query or out of the row). ``keys``: the keys, their
    positions, blocks and offsets; read from packed ``[N, H(, D)]`` tensors, or, ``PAGED``, where
    they are (strides ``ks``, ``ps``)."""
    k_ptr, kp_ptr, blk_ptr, off_ptr = keys[0], keys[1], keys[2], keys[3]
    hk = hq // (HQ // H)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(
        q_ptr + ((q0 + qi)[:, None] * HQ + hq) * D + d[None, :], mask=(qi < m)[:, None] & (d[None, :] < D), other=0.0
    ).to(tl.float32)
    tok = (k0 + ki).to(tl.int64)
    at = _key_offsets(blk_ptr, off_ptr, tok, ki < n, hk, d, ks[0], ks[1], ks[2], ks[3], PAGED)
    k = tl.load(k_ptr + at, mask=(ki < n)[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    if HAS_CAP:
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # softcap * tanh(s / softcap)
    qp = tl.load(qp_ptr + q0 + qi, mask=qi < m, other=0)
    kp = _pos_at(kp_ptr, blk_ptr, off_ptr, tok, ki < n, hk, ps[0], ps[1], ps[2], PAGED)
    visible = (kp[None, :] <= qp[:, None]) & (ki < n)[None, :] & (qi < m)[:, None]
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _lse_kernel(
    q_ptr,
    qp_ptr,
    keys,
    ks,
    ps,
    cuq_ptr,
    cuk_ptr,
    lse_ptr,
    HQ: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BQ: tl.constexpr,
    BK: tl.constexpr,
    scale,
    softcap,
    HAS_CAP: tl.constexpr,
    PAGED: tl.constexpr,
):
    hq = tl.program_id(0)
    r = tl.program_id(1)
    q0, m = _row_range(cuq_ptr, r)
    k0, n = _row_range(cuk_ptr, r)
    qi = tl.program_id(2) * BQ + tl.arange(0, BQ)
    mx = tl.full([BQ], float("-inf"), tl.float32)
    acc = tl.zeros([BQ], dtype=tl.float32)
    n_loop = tl.where(tl.program_id(2) * BQ < m, n, 0)  # tiles past the row's queries skip the loop
    for start in tl.range(0, n_loop, BK):  # online log-sum-exp over the row's keys
        s = _scores_tile(
            q_ptr,
            qp_ptr,
            keys,
            ks,
            ps,
            hq,
            q0,
            qi,
            m,
            k0,
            start + tl.arange(0, BK),
            n,
            HQ,
            H,
            D,
            BLOCK_D,
            scale,
            softcap,
            HAS_CAP,
            PAGED,
        )
        new = tl.maximum(mx, tl.max(s, axis=1))
        safe = tl.where(new == float("-inf"), 0.0, new)
        acc = acc * tl.exp(mx - safe) + tl.sum(tl.exp(s - safe[:, None]), axis=1)
        mx = new
    lse = tl.where(mx == float("-inf"), float("inf"), mx + tl.log(acc))  # a query that sees nothing: p = 0
    tl.store(lse_ptr + (q0 + qi) * HQ + hq, lse, mask=qi < m)


@triton.jit
def _colsum_kernel(
    q_ptr,
    qp_ptr,
    keys,
    ks,
    ps,
    cuq_ptr,
    cuk_ptr,
    lse_ptr,
    out_ptr,
    HQ: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BQ: tl.constexpr,
    BK: tl.constexpr,
    scale,
    softcap,
    HAS_CAP: tl.constexpr,
    PAGED: tl.constexpr,
):
    hq = tl.program_id(0)
    r = tl.program_id(1)
    q0, m = _row_range(cuq_ptr, r)
    k0, n = _row_range(cuk_ptr, r)
    ki = tl.program_id(2) * BK + tl.arange(0, BK)
    acc = tl.zeros([BK], dtype=tl.float32)
    m_loop = tl.where(tl.program_id(2) * BK < n, m, 0)  # tiles past the row's keys skip the loop
    for start in tl.range(0, m_loop, BQ):
        qi = start + tl.arange(0, BQ)
        s = _scores_tile(
            q_ptr,
            qp_ptr,
            keys,
            ks,
            ps,
            hq,
            q0,
            qi,
            m,
            k0,
            ki,
            n,
            HQ,
            H,
            D,
            BLOCK_D,
            scale,
            softcap,
            HAS_CAP,
            PAGED,
        )
        lse = tl.load(lse_ptr + (q0 + qi) * HQ + hq, mask=qi < m, other=float("inf"))
        acc += tl.sum(tl.exp(s - lse[:, None]), axis=0)
    tl.store(out_ptr + (k0 + ki) * HQ + hq, acc, mask=ki < n)


#: :func:`column_sums` reads :class:`PagedKeys` itself
column_sums_reads_pages = True


def column_sums(Q, K, q_pos, k_pos, cu_q, cu_k, G: int, scale: float, softcap: float | None = None, sinks=None):
    """``[N, H_q]`` float32: for every key of every row, the softmax attention of its row's queries,
    causal by position, summed over the queries (the reference's semantics and layout). Every row
    in one launch per pass: grids (query head, row, tile); pass 1 writes each query's log-sum-exp,
    pass 2 sums ``exp(s - lse)`` per key tile, so at most a ``[BQ, BK]`` tile of probabilities
    exists; a row's tiles beyond its length do nothing. ``sinks`` ``[H_q]`` (learned attention
    sinks) join each query's log-sum-exp between the passes. ``K`` and ``k_pos`` may be read where
    they are (:class:`PagedKeys`, both)."""
    M, Hq, D = Q.shape
    paged = isinstance(K, PagedKeys)
    N, H = (K.blocks.numel(), K.cache.shape[2]) if paged else K.shape[:2]
    dev = Q.device
    rq, rk = ragged(cu_q), ragged(cu_k)
    R = rq.rows
    if M == 0 or N == 0 or R == 0 or rq.longest == 0 or rk.longest == 0:
        return torch.zeros(N, Hq, dtype=torch.float32, device=dev)
    out = torch.empty(N, Hq, dtype=torch.float32, device=dev)  # every key's column written by pass 2
    Q = Q.contiguous()
    if paged:
        k, kp, blk, off = K.cache, k_pos.cache, K.blocks, K.offsets
        strides = (*K.cache.stride(), *k_pos.cache.stride())
    else:
        k, kp = K.contiguous(), k_pos.long().contiguous()
        blk = off = kp
        strides = (H * D, 0, D, 1, H, 0, 1)
    qp = q_pos.long().contiguous()
    cu_q, cu_k = rq.dev.long().contiguous(), rk.dev.long().contiguous()
    lse = torch.empty(M, Hq, dtype=torch.float32, device=dev)
    BQ, BK = 32, 64
    cap = float(softcap) if softcap else 1.0
    common = dict(
        HQ=Hq,
        H=H,
        D=D,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        BQ=BQ,
        BK=BK,
        HAS_CAP=bool(softcap),
        PAGED=paged,
        scale=float(scale),
        softcap=cap,
    )
    args = (Q, qp, (k, kp, blk, off), tuple(strides[:4]), tuple(strides[4:]), cu_q, cu_k, lse)
    _lse_kernel[(Hq, R, triton.cdiv(rq.longest, BQ))](*args, **common)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(lse.device, torch.float32)[None, :])
        args = (*args[:-1], lse)
    _colsum_kernel[(Hq, R, triton.cdiv(rk.longest, BK))](*args, out, **common)
    return out


@triton.jit
def _lshe_ragged_kernel(
    qc_ptr,
    kc_ptr,
    p_ptr,
    blk_ptr,
    off_ptr,
    vic_ptr,
    qpos_ptr,
    cuq_ptr,
    cuk_ptr,
    b_ptr,
    sinks,
    recent,
    p_b,
    p_o,
    p_h,
    H: tl.constexpr,
    HQ: tl.constexpr,
    G: tl.constexpr,
    PAGED: tl.constexpr,
    TILE_T: tl.constexpr,
):
    """Grid (KV head, row): the row's tokens decided in order, as the reference loop does; each
    scans the row's window in tiles, its Hamming distances summed over the group on the fly."""
    h, r = tl.program_id(0), tl.program_id(1)
    q0, m = _row_range(cuq_ptr, r)
    k0, n = _row_range(cuk_ptr, r)
    budget = tl.load(b_ptr + r)
    MIN: tl.constexpr = -9223372036854775807 - 1
    for i in tl.range(0, m):
        t = tl.load(qpos_ptr + q0 + i).to(tl.int64)
        cnt = tl.zeros([], dtype=tl.int64)
        best = tl.full([], MIN, tl.int64)
        best_j = tl.full([], 0, tl.int64)
        for start in tl.range(0, n, TILE_T):
            j = start + tl.arange(0, TILE_T)
            mj = j < n
            p = _pos_at(p_ptr, blk_ptr, off_ptr, k0 + j, mj, h, p_b, p_o, p_h, PAGED).to(tl.int64)
            v = tl.load(vic_ptr + (k0 + j) * H + h, mask=mj, other=0)
            alive = (p < t) & (v < 0) & mj
            cnt += tl.sum(alive.to(tl.int64), axis=0)
            eligible = alive & (p >= sinks) & (p < t - recent)
            kc = tl.load(kc_ptr + (k0 + j) * H + h, mask=mj, other=0)
            d = tl.zeros([TILE_T], dtype=tl.int64)
            for g in tl.static_range(G):
                d += _popcount64(tl.load(qc_ptr + (q0 + i) * HQ + h * G + g) ^ kc)
            key = tl.where(eligible, (d << 32) - p, MIN)  # farthest, then oldest
            tb = tl.max(key, axis=0)
            upd = tb > best
            best_j = tl.where(upd, start + tl.argmax(key, axis=0).to(tl.int64), best_j)
            best = tl.where(upd, tb, best)
        if (cnt >= budget) & (best > MIN):
            tl.store(vic_ptr + (k0 + best_j) * H + h, t.to(vic_ptr.dtype.element_ty))
        tl.debug_barrier()


def lshe_victims_ragged(q_codes, k_codes, pos, victim, q_pos, cu_q, cu_k, budget, sinks: int, recent: int, G: int):
    """LSH-E's victims for packed rows (see policies.lshe.lshe_victims_ragged): one program per
    (KV head, row); ``victim [N, H]`` updated in place (returned)."""
    N, H = k_codes.shape
    rq, rk = ragged(cu_q), ragged(cu_k)
    if N == 0 or q_codes.shape[0] == 0 or rk.rows == 0:
        return victim
    assert victim.is_contiguous() and k_codes.is_contiguous()
    if isinstance(pos, PagedKeys):
        p, blk, off, strides = pos.cache, pos.blocks, pos.offsets, pos.cache.stride()
    else:
        p = pos.contiguous()
        blk, off, strides = p, p, (H, 0, 1)
    _lshe_ragged_kernel[(H, rk.rows)](
        q_codes.contiguous(),
        k_codes,
        p,
        blk,
        off,
        victim,
        q_pos.long().contiguous(),
        rq.dev,
        rk.dev,
        budget.long().contiguous(),
        int(sinks),
        int(recent),
        *strides,
        H=H,
        HQ=q_codes.shape[1],
        G=G,
        PAGED=isinstance(pos, PagedKeys),
        TILE_T=min(1024, triton.next_power_of_2(max(1, rk.longest))),
    )
    return victim


@triton.jit
def _simhash_kernel(
    x_ptr, r_ptr, out_ptr, M, s_xm, s_xd, C, D: tl.constexpr, TILE_M: tl.constexpr, BLOCK_D: tl.constexpr
):
    """torch_ops.simhash_codes: code |= [R_b . x >= 0] << b, the dot in float32 as an elementwise
    product and tl.sum (not tl.dot: no TF32, and the rounding stays that of an fp32 reduction)."""
    i = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
    d = tl.arange(0, BLOCK_D)
    mi = i < M
    x = tl.load(
        x_ptr + i[:, None].to(tl.int64) * s_xm + d[None, :] * s_xd, mask=mi[:, None] & (d[None, :] < D), other=0.0
    ).to(tl.float32)
    code = tl.zeros([TILE_M], dtype=tl.int64)
    for b in tl.range(0, C):
        r = tl.load(r_ptr + b * D + d, mask=d < D, other=0.0)
        dot = tl.sum(x * r[None, :], axis=1)
        code = code | ((dot >= 0).to(tl.int64) << b)
    tl.store(out_ptr + i, code, mask=mi)


def simhash_codes(x, R):
    """``[M]`` int64 SimHash codes of ``x [M, d]``: bit b = ``[R_b . x >= 0]`` (see
    torch_ops.simhash_codes for the tie rule)."""
    M, D = x.shape
    out = torch.empty(M, dtype=torch.int64, device=x.device)
    if M == 0:
        return out
    R = R.to(device=x.device, dtype=torch.float32).contiguous()
    TM = 32
    _simhash_kernel[(triton.cdiv(M, TM),)](
        x, R, out, M, *x.stride(), R.shape[0], D=D, TILE_M=TM, BLOCK_D=triton.next_power_of_2(D)
    )
    return out


@triton.jit
def _popcount64(x):
    """Set bits of each int64 (all 64, the sign bit included): SWAR sums in 2-, 4- and 8-bit fields,
    every intermediate non-negative (masks clear bit 63), so signed shifts are harmless."""
    x = (x & 0x5555555555555555) + ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    x = x + (x >> 32)
    return x & 0x7F


@triton.jit
def _proj_norm_kernel(
    v_ptr,
    blk_ptr,
    off_ptr,
    s_b,
    s_o,
    s_h,
    s_d,
    w_ptr,
    s_wh,
    s_wd,
    s_wc,
    Dout,
    a_ptr,
    a_t,
    a_h,
    out_ptr,
    o_t,
    o_h,
    n,
    eps,
    G: tl.constexpr,
    d: tl.constexpr,
    TILE_T: tl.constexpr,
    BLOCK_d: tl.constexpr,
    TILE_D: tl.constexpr,
    PREC: tl.constexpr,
    SCALE: tl.constexpr,
    PAGED: tl.constexpr,
):
    """Grid (KV head, token tile): per token, the mean over the group's heads of ``sum |v W_O^g|``
    (policies/criticalkv.py ``projected_value_norms``), a ``[TILE_T, TILE_D]`` tile of ``v W_O^g``
    at a time (``tl.dot`` over d), reduced in registers; ``SCALE``: times ``a + eps``
    (``criticalkv_scores``). Values packed or read in place (``PAGED``)."""
    h = tl.program_id(0)
    t = (tl.program_id(1) * TILE_T + tl.arange(0, TILE_T)).to(tl.int64)
    k = tl.arange(0, BLOCK_d)
    mk = k < d
    mt = t < n
    at = _key_offsets(blk_ptr, off_ptr, t, mt, h, k, s_b, s_o, s_h, s_d, PAGED)
    v = tl.load(v_ptr + at, mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
    acc = tl.zeros([TILE_T], dtype=tl.float32)
    for g in tl.range(0, G):
        w_head = w_ptr + (h * G + g).to(tl.int64) * s_wh
        for c0 in tl.range(0, Dout, TILE_D):
            c = c0 + tl.arange(0, TILE_D)
            w = tl.load(
                w_head + k[:, None] * s_wd + c[None, :] * s_wc, mask=mk[:, None] & (c < Dout)[None, :], other=0.0
            ).to(tl.float32)
            acc += tl.sum(tl.abs(tl.dot(v, w, input_precision=PREC)), axis=1)
    acc = acc / G
    if SCALE:
        acc = (tl.load(a_ptr + t * a_t + h * a_h, mask=mt, other=0.0) + eps) * acc
    tl.store(out_ptr + t * o_t + h * o_h, acc, mask=mt)


def _proj_norms(v, blk, off, strides, H: int, G: int, n: int, d: int, W_O, out, o_strides, a, eps: float, paged: bool):
    """:func:`_proj_norm_kernel` over ``n`` tokens of ``H`` KV heads into ``out`` (``o_strides``:
    its token and head strides); ``a``: the scores ``[n, H]`` to scale by (None: the norms alone)."""
    if n == 0:
        return out
    W_O = W_O.to(v.device)
    half = (torch.float16, torch.bfloat16)
    prec = "tf32" if v.dtype in half and W_O.dtype in half else "ieee"
    Bd = max(16, triton.next_power_of_2(d))
    TT = 64 if Bd <= 128 else 32
    a_args = (a, *a.stride()) if a is not None else (out, 0, 0)
    _proj_norm_kernel[(H, triton.cdiv(n, TT))](
        v, blk, off, *strides, W_O, *W_O.stride(), W_O.shape[-1], *a_args, out, *o_strides, n, eps,
        G=G, d=d, TILE_T=TT, BLOCK_d=Bd, TILE_D=64, PREC=prec, SCALE=a is not None, PAGED=paged,
    )  # fmt: skip
    return out


def projected_value_norms(V, W_O, G: int):
    """``[H_kv, n]`` float32: ``mean_g ||v_i W_O^g||_1`` (see policies/criticalkv.py projected_value_norms); no
    ``[n, D]`` product is ever written to memory. Products in float32: 16-bit inputs are exact in
    TF32, so they take the tensor cores at no loss; float32 inputs use IEEE fp32."""
    H, n, d = V.shape
    out = torch.empty(H, n, dtype=torch.float32, device=V.device)
    strides = (V.stride(1), 0, V.stride(0), V.stride(2))  # token, (offset), head, dim
    return _proj_norms(V, V, V, strides, H, G, n, d, W_O, out, (1, n), None, 0.0, False)


def criticalkv_scores(A, V, W_O, G: int, eps: float):
    """``(A + eps) * Vp`` ``[N, H_kv]`` with the projected value norms of :func:`projected_value_norms`;
    values packed ``[N, H_kv, d]`` or read in place (:class:`PagedKeys`)."""
    N, H = A.shape
    out = torch.empty(N, H, dtype=torch.float32, device=A.device)
    if isinstance(V, PagedKeys):
        d = V.cache.shape[-1]
        return _proj_norms(V.cache, V.blocks, V.offsets, V.cache.stride(), H, G, N, d, W_O, out, (H, 1), A, eps, True)
    d = V.shape[-1]
    strides = (V.stride(0), 0, V.stride(1), V.stride(2))
    return _proj_norms(V, V, V, strides, H, G, N, d, W_O, out, (H, 1), A, eps, False)


@triton.jit
def _caote_kernel(
    h_ptr,
    v_ptr,
    blk_ptr,
    off_ptr,
    cu_ptr,
    out_ptr,
    s_b,
    s_o,
    s_h,
    s_d,
    one_minus_min,
    tiny,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FAST: tl.constexpr,
    PAGED: tl.constexpr,
    TILE_T: tl.constexpr,
):
    """Grid (row, KV head): the row's base scores summed, then ``X`` (each value weighted by its
    normalised score as the statement weighs it, or their mean), then each token's error
    ``h^norm / (1 - h^norm) * ||X - v||``."""
    r = tl.program_id(0)
    hd = tl.program_id(1)
    t0, n = _row_range(cu_ptr, r)
    d = tl.arange(0, BLOCK_D)
    sh = tl.zeros([TILE_T], dtype=tl.float32)
    for start in tl.range(0, n, TILE_T):
        j = start + tl.arange(0, TILE_T)
        sh += tl.load(h_ptr + (t0 + j).to(tl.int64) * H + hd, mask=j < n, other=0.0)
    total = tl.sum(sh, axis=0)
    nf = tl.maximum(n, 1).to(tl.float32)
    X = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in tl.range(0, n, TILE_T):
        j = start + tl.arange(0, TILE_T)
        tok = (t0 + j).to(tl.int64)
        at = _key_offsets(blk_ptr, off_ptr, tok, j < n, hd, d, s_b, s_o, s_h, s_d, PAGED)
        v = tl.load(v_ptr + at, mask=(j < n)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
        if FAST:
            X += tl.sum(v, axis=0)
        else:
            hv = tl.load(h_ptr + tok * H + hd, mask=j < n, other=0.0)
            hn = tl.where(total > 0, hv / tl.maximum(total, tiny), 1.0 / nf)
            X += tl.sum(tl.where((j < n)[:, None], hn[:, None] * v, 0.0), axis=0)
    if FAST:
        X = X / nf
    for start in tl.range(0, n, TILE_T):
        j = start + tl.arange(0, TILE_T)
        tok = (t0 + j).to(tl.int64)
        hv = tl.load(h_ptr + tok * H + hd, mask=j < n, other=0.0)
        at = _key_offsets(blk_ptr, off_ptr, tok, j < n, hd, d, s_b, s_o, s_h, s_d, PAGED)
        v = tl.load(v_ptr + at, mask=(j < n)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
        hn = tl.where(total > 0, hv / tl.maximum(total, tiny), 1.0 / nf)
        diff = tl.where((d < D)[None, :], X[None, :] - v, 0.0)
        dist = tl.sqrt(tl.sum(diff * diff, axis=1))
        tl.store(out_ptr + tok * H + hd, hn / tl.maximum(1.0 - hn, one_minus_min) * dist, mask=j < n)


def caote_scores(h, V, cu, row, fast: bool):
    """:func:`vllm_kvevict.policies.caote.caote_scores` in one launch; ``V`` packed or read where
    it is (:class:`PagedKeys`)."""
    N, H = h.shape
    out = torch.empty(N, H, dtype=torch.float32, device=h.device)
    R = cu.shape[0] - 1
    if N == 0 or R == 0:
        return out
    if isinstance(V, PagedKeys):
        v, blk, off, strides, paged = V.cache, V.blocks, V.offsets, V.cache.stride(), True
        D = V.cache.shape[-1]
    else:
        v = V.contiguous()
        blk = off = cu
        D = v.shape[-1]
        strides, paged = (H * D, 0, D, 1), False
    _caote_kernel[(R, H)](
        h.float().contiguous(),
        v,
        blk,
        off,
        cu.long().contiguous(),
        out,
        *strides,
        ONE_MINUS_MIN,
        torch.finfo(torch.float32).tiny,
        H=H,
        D=D,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        FAST=fast,
        PAGED=paged,
        TILE_T=64,
    )
    return out
