"""The batched eviction operations, in torch: the specification the Triton kernels are tested against,
and the implementation the CPU engine runs.

Every operation works on a *ragged set* of rows at once (every request that compacts in a step):
row ``r`` owns the packed tokens ``[cu[r], cu[r + 1])`` of ``[N, H, ...]`` tensors, one entry per
token and KV head. Nothing loops over rows in Python.

* :func:`gather_paged`: K and V of logical tokens ``[starts[r], ends[r])`` of each row, read through
  vLLM's block table from the FlashAttention views ``[num_blocks, block_size, H, D]``.
* :func:`keydiff_scores`: ``-cos(k_i, mu)`` with ``mu`` the mean of the row's normalised keys, per
  KV head (KeyDiff Eq. 8).
* :func:`key_norms`: ``||k_i||_2``.
* :func:`select_topk`: the ``keep[r]`` best tokens of each row and head, ties to the larger
  position (ALGORITHMS.md 6.5 #21), as row-local indices in ascending order, packed ``[sum keep, H]``.
* :func:`column_sums`: the softmax attention each key receives from a set of queries, causal by
  position, summed over the queries (SnapKV, TOVA, H2O, CAOTE and CriticalKV read it).
* :func:`lshe_victims`: LSH-E's victim choice (Alg. 1 line 1), token by token, per KV head.
* :func:`scatter_paged`: write packed per-head rows into logical tokens ``[dst_start[r],
  dst_start[r] + keep[r])`` through the block table (the right-aligned compaction), any
  ``[slots, H, D]`` or ``[slots, H]`` destination addressed by (block, offset, head).
"""

from __future__ import annotations

import numpy as np
import torch

EPS = 1e-8
#: query rows per matmul in :func:`column_sums`: bounds the transient [H_q, rows, n] tensor
ROW_CHUNK = 256


def row_ids(cu: torch.Tensor) -> torch.Tensor:
    """``[N]``: the row of each packed token."""
    lens = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens)


def cu_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths.long(), 0), (1, 0))


def logical_tokens(block_table: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(physical block, offset) of every logical token ``[starts[r], ends[r])`` of each row, packed;
    and ``cu``."""
    lens = (ends - starts).long()
    cu = cu_from_lengths(lens)
    rid = row_ids(cu)
    tok = starts.long()[rid] + torch.arange(int(cu[-1]), device=cu.device) - cu[:-1][rid]
    blocks = block_table[rows.long()[rid], tok // block_size].long()
    return blocks, tok % block_size, cu


def gather_paged(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, rows: torch.Tensor,
                 starts: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``K, V [N, H, D]`` and ``cu [R + 1]`` of each row's logical tokens ``[starts[r], ends[r])``;
    ``k_cache``/``v_cache``: ``[num_blocks, block_size, H, D]`` (views are fine)."""
    blocks, offs, cu = logical_tokens(block_table, rows, starts, ends, k_cache.shape[1])
    return k_cache[blocks, offs], v_cache[blocks, offs], cu


def keydiff_scores(K: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """``[N, H]`` float32: ``-cos(k_i, mu_r)``, ``mu_r`` the mean normalised key of row ``r`` (per head)."""
    Kf = K.float()
    norm = Kf.norm(dim=-1)  # [N, H]
    k_hat = Kf / norm.clamp_min(EPS)[..., None]
    rid = row_ids(cu)
    R = cu.numel() - 1
    mu = torch.zeros(R, *K.shape[1:], dtype=torch.float32, device=K.device).index_add_(0, rid, k_hat)
    mu = mu / (cu[1:] - cu[:-1]).clamp_min(1)[:, None, None].float()
    mu_t = mu[rid]  # [N, H, D]
    return -((Kf * mu_t).sum(-1) / (mu_t.norm(dim=-1) * norm).clamp_min(EPS))


def key_norms(K: torch.Tensor) -> torch.Tensor:
    """``[N, H]`` float32 L2 norms of the keys."""
    return K.float().norm(dim=-1)


def sort_keys(scores: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``int64`` keys ordering (score, position) lexicographically, both ascending: the float's bits
    made order-preserving (``-0.0`` as ``+0.0``) in the high 32 bits, the position in the low 31."""
    bits = (scores.float() + 0.0).view(torch.int32).long()
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + (1 << 31)  # [0, 2^32), same order as the floats
    return (ordered << 31) | pos.long()


def select_topk(scores: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor, keep: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor]:
    """The ``keep[r]`` highest-scoring tokens of each row, per head, ties to the larger position.

    Returns ``(idx, cu_keep)``: ``idx [sum keep, H]`` row-local indices, ascending within each row
    and head; rows ``[cu_keep[r], cu_keep[r + 1])``. ``keep[r] >= n_r`` keeps the whole row.
    """
    N, H = scores.shape
    lens = cu[1:] - cu[:-1]
    keep = torch.minimum(keep.long().to(cu.device), lens)
    rid = row_ids(cu)
    key = sort_keys(scores, pos)
    order = torch.argsort(key, dim=0, descending=True, stable=True)  # best first, per head
    order = torch.gather(order, 0, torch.argsort(rid[order], dim=0, stable=True))  # grouped by row
    rank = torch.arange(N, device=cu.device)[:, None] - cu[:-1][rid][:, None]  # rank within its row
    kept = torch.zeros(N, H, dtype=torch.bool, device=scores.device)
    kept.scatter_(0, order, (rank < keep[rid][:, None]).expand(N, H))
    local = torch.arange(N, device=cu.device) - cu[:-1][rid]
    first = torch.argsort((~kept).to(torch.int8), dim=0, stable=True)[: int(keep.sum())]  # kept, in token order
    return local[first], cu_from_lengths(keep)


def scatter_paged(dst: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, cu: torch.Tensor, cu_keep: torch.Tensor,
                  block_table: torch.Tensor, rows: torch.Tensor, dst_start: torch.Tensor) -> None:
    """``dst[block, offset, h] = src[cu[r] + idx[j, h], h]`` for the ``j``-th kept token of row ``r``,
    written at logical token ``dst_start[r] + j``. ``dst``: ``[num_blocks, block_size, H(, D)]``
    (a view of the cache, or a per-slot state reshaped so); ``src``: ``[N, H(, D)]``."""
    R = rows.numel()
    keep = cu_keep[1:] - cu_keep[:-1]
    blocks, offs, _ = logical_tokens(block_table, rows, dst_start.long(), dst_start.long() + keep, dst.shape[1])
    rid = row_ids(cu_keep)
    h = torch.arange(src.shape[1], device=src.device)[None, :]
    assert R == cu.numel() - 1
    dst[blocks[:, None], offs[:, None], h] = src[cu[:-1][rid][:, None] + idx, h].to(dst.dtype)


def attention_probs(Q: torch.Tensor, K: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, G: int,
                    scale: float, softcap: float | None = None) -> torch.Tensor:
    """``[H_q, m, n]`` float32 probabilities of queries ``Q [H_q, m, d]`` at positions ``q_pos [m]``
    over keys ``K [H_kv, n, d]`` at ``k_pos [H_kv, n]``: scaled, soft-capped, causal by position;
    query head ``h`` reads KV head ``h // G`` (each KV head's G query heads in one matmul, K never
    repeated); a query that sees no key has probabilities 0."""
    Hq, m, d = Q.shape
    H, n = K.shape[:2]
    s = torch.matmul(Q.float().reshape(H, G * m, d), K.float().transpose(1, 2)).view(H, G, m, n)
    s.mul_(scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    q_pos = q_pos.to(k_pos.device)
    hidden = k_pos[:, None, :] > q_pos[None, :, None]  # [H_kv, m, n], shared by the group
    s.masked_fill_(hidden[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    if n == 0 or bool((q_pos[None, :] < k_pos.min(dim=1, keepdim=True).values).any()):
        p = p.nan_to_num_(0.0)  # some query sees no key: its row is 0, not NaN
    return p.view(Hq, m, n)


def column_sums(Q: torch.Tensor, K: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, G: int, scale: float,
                softcap: float | None = None) -> torch.Tensor:
    """``[H_q, n]``: :func:`attention_probs` summed over the queries, ``ROW_CHUNK`` rows at a time."""
    out = torch.zeros(Q.shape[0], K.shape[1], dtype=torch.float32, device=K.device)
    for i in range(0, Q.shape[1], ROW_CHUNK):
        out += attention_probs(Q[:, i:i + ROW_CHUNK], K, q_pos[i:i + ROW_CHUNK], k_pos, G, scale, softcap).sum(dim=1)
    return out


def lshe_victims(dist, pos, victim, q_pos, budget: int, sinks: int, recent: int) -> None:
    """Alg. 1 line 1 for each token t of ``q_pos`` in order: once the non-victim tokens before t
    number ``budget``, the eligible one with the largest ``dist[:, i]`` (then the oldest) becomes
    t's victim. ``victim`` ``[H, n]`` is updated in place. A sequential loop: numpy on the host
    (the per-token work is a few vector ops over the window)."""
    H = pos.shape[0]
    key = ((dist.long() << 32) - pos[:, None, :]).cpu().numpy()  # [H, rows, n]: distance, then oldest
    posn = pos.cpu().numpy()
    vic = victim.cpu().numpy().copy()
    dead = (vic >= 0) | (posn < sinks)  # sinks are never eligible; victims are gone
    rows = np.arange(H)
    for i, t in enumerate(q_pos.tolist()):
        before = posn < t
        full = (before & (vic < 0)).sum(axis=1) >= budget
        if not full.any():
            continue
        blocked = dead | ~before | (posn >= t - recent)
        k = np.where(blocked, np.iinfo(np.int64).min, key[:, i])
        j = k.argmax(axis=1)
        ok = full & ~blocked[rows, j]
        vic[rows[ok], j[ok]] = t
        dead[rows[ok], j[ok]] = True
    victim.copy_(torch.from_numpy(vic).to(victim.device))
