# SPDX-License-Identifier: Apache-2.0
"""KVMerger: merge runs of similar adjacent keys into their pivot (KVMerger
paper Alg. 1 and 2, Eqs. 5-8).

    protected  = the most recent  floor(recent_ratio * n)  tokens
               + the top          floor(heavy_ratio * n)   by accumulated attention a (H2O sums)
    links      = adjacent unprotected pairs with cos(k_{i-1}, k_i) > threshold    (chain, 6.5 #8)
    per set S  (a maximal run of links):
        p      = argmax_{j in S} a_j                               pivot
        w_j    = g_pj / sum_S g,   g_pj = exp(-||k_p - k_j||^2 / (2 sigma^2))
        k_M    = sum_S w_j k_j,    v_M = |S| * sum_S w_j v_j       stored in the pivot's slot

Defaults: threshold 0.75, sigma 5 (fixed, 6.5 #7), ratios 0.17 / 0.12 of the sequence (the 50%
budget's, 6.5 #9), value scaling by |S| (``value_scale: none`` to turn it off). Runs once, when
the prompt is complete (``trigger: once``); the accumulated attention is the H2O column sums of
every prompt query, kept per slot.

Adaptation to a uniform count per head (one block table serves all heads): the paper's lengths
vary by head. Here each head keeps exactly ``keep`` entries: if merging every link would leave
fewer, only the ``n - keep`` most similar links are merged (sets stay contiguous); if it leaves
more, the unprotected entries (merged sets and singletons) with the lowest pivot attention are
evicted, H2O-style. If the protected share exceeds ``keep``, both ratios shrink in proportion.

Every row of a step merges at once (:meth:`KVMerger.merge_columns`, the packed tokens of all its
requests, every head); one view's :meth:`~vllm_kvevict.policies.base.Policy.merge` is its one row.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import torch
from pydantic import Field

from vllm_kvevict.kernels.torch_ops import PagedKeys, Ragged, dense_positions, on_device
from vllm_kvevict.policies.base import Columns, KVView, Merge, Packed, Policy, PolicyParams
from vllm_kvevict.policies.h2o import H2O, h2o_observe, h2o_observe_columns
from vllm_kvevict.policies.h2o import STATE as H2O_STATE

#: The float64 set sums of one merge call cover this many bytes at most (its other transients a
#: few times that): the rows and heads are merged a few at a time where a step's tokens are many
#: (prompts ending together), a row longer than that one head at a time.
MERGE_CHUNK_BYTES = 1 << 26


class KVMergerParams(PolicyParams):
    threshold: float = Field(0.75, ge=-1.0, le=1.0, description="cosine above which adjacent keys merge")
    sigma: float = Field(5.0, ge=1e-3, le=1e6, description="Gaussian kernel width on key distances")
    recent_ratio: float = Field(0.17, ge=0.0, le=1.0, description="share of the sequence kept as recent tokens")
    heavy_ratio: float = Field(0.12, ge=0.0, le=1.0, description="share kept as heavy hitters (not merged)")
    value_scale: Literal["set_size", "none"] = Field("set_size", description="multiply merged values by |S|")


class KVMerger(Policy[KVMergerParams]):
    name = "kvmerger"
    Params = KVMergerParams
    # H2O's accumulated attention, once at prompt end, merging what it drops
    needs = replace(H2O.needs, decode=False, trigger="once", merges=True)

    def observe(self, view: KVView) -> None:
        h2o_observe(view, self.attention(view))

    def observe_columns(self, x: Packed, cols: Columns) -> None:
        h2o_observe_columns(x.A, x.state[H2O_STATE], cols.G)

    def merge_columns(self, x: Packed, cols: Columns) -> Merge:
        """Every compacting row's sets, in shapes fixed by the packed tokens: nothing read back. The
        rows and heads are merged a few at a time, so a merge's float64 sums stay within
        :data:`MERGE_CHUNK_BYTES` however many prompts end in the step; a row's merge does not
        depend on the rows beside it (its sums are its sets'). A row that does not compact in the
        step (``keep`` 0) is not merged: every token ``-inf``, its K/V as they are."""
        assert x.K is not None, "a merging policy reads the keys"
        K, V = _tokens(x.K, x.tok), _tokens(x.V, x.tok)
        a, pos = x.state[H2O_STATE].float(), dense_positions(x.pos)
        parts = []
        for sl, sub in _row_batches(cols, K.shape[-1]):
            if sub is None:  # rows that do not compact in this step: nothing merged, never kept
                parts.append(Merge(torch.full_like(a[sl], float("-inf")), K[sl], V[sl]))
            else:
                score, Km, Vm = self._merge_rows(K[sl], V[sl], a[sl], pos[sl], sub)
                parts.append(Merge(score, Km.to(K.dtype), Vm.to(V.dtype)))
        return _joined(parts, 0)

    def _merge_rows(self, K, V, a, pos, cols: Columns) -> Merge:
        """Some consecutive rows' sets (``cols``: those rows), their heads a few at a time; the
        recent tokens and the heavy hitters (ties to the newer) protected."""
        n_recent, n_heavy, links = self._row_counts(cols)
        recent = pos >= cols.L[cols.row, None] - n_recent
        prot = recent | (_row_ranks(a.masked_fill(recent, float("-inf")), pos, cols) < n_heavy)
        N, H, d = K.shape
        step = max(1, MERGE_CHUNK_BYTES // max(1, 8 * N * d))
        parts = []
        for h in range(0, H, step):
            hs = slice(h, h + step)
            parts.append(
                _merge_heads(K[:, hs].float(), V[:, hs].float(), a[:, hs], prot[:, hs], cols, links, self.params)
            )
        return _joined(parts, 1)

    def _row_counts(self, cols: Columns) -> torch.Tensor:
        """``[3, N, 1]``: each token's row's counts of protected recent tokens and heavy hitters and
        of links that may merge (``n - keep``), made on the host from the rows' lengths and kept
        counts and copied in one."""
        counts = [(*self._protected_counts(n, k), n - k) for n, k in zip(cols.ragged.lengths, cols.keep)]
        per_row = on_device([c[i] for i in range(3) for c in counts], cols.L.device).view(3, -1)
        return per_row[:, cols.row, None]

    def _protected_counts(self, n: int, keep: int) -> tuple[int, int]:
        """``(recent, heavy)`` of a row of ``n`` tokens that keeps ``keep``: both shrink in
        proportion where they exceed ``keep``."""
        p = self.params
        n_recent, n_heavy = int(p.recent_ratio * n), int(p.heavy_ratio * n)
        if n_recent + n_heavy > keep:
            shrink = keep / (n_recent + n_heavy)
            n_recent, n_heavy = int(n_recent * shrink), int(n_heavy * shrink)
        return n_recent, n_heavy


def _merge_heads(K, V, a, prot, cols: Columns, n_links: torch.Tensor, p: KVMergerParams) -> Merge:
    """The sets of some heads (``K``, ``V`` float32 ``[N, h, d]``; ``a``, ``prot`` ``[N, h]``):
    each token's score (its set's pivot attention at the pivot, ``+inf`` protected, ``-inf``
    elsewhere) and its set's merged K/V. Sets are numbered by token across the rows; a row's last
    token links to nothing, so no set crosses a row."""
    N, dev = K.shape[0], K.device
    idx = torch.arange(N, device=dev)[:, None].expand_as(a)
    cos = torch.nn.functional.cosine_similarity(K[1:], K[:-1], dim=-1, eps=1e-8)  # link i: (i, i+1)
    same_row = (cols.row[1:] == cols.row[:-1])[:, None]
    can = torch.nn.functional.pad((cos > p.threshold) & ~prot[1:] & ~prot[:-1] & same_row, (0, 0, 0, 1))
    # At most n - keep links of a row merge, the most similar (ties to the earlier): all that can when fewer can.
    cos = torch.nn.functional.pad(cos, (0, 0, 0, 1)).masked_fill(~can, float("-inf"))
    link = can & (_row_ranks(cos, -idx, cols) < n_links)
    # Sets: maximal runs joined by links; set id of token i = number of non-links before it.
    sid = torch.nn.functional.pad(torch.cumsum(~link[:-1], 0), (0, 0, 1, 0))
    # Pivot of each set: largest accumulated attention, ties to the newer (later) token.
    top = torch.full_like(a, float("-inf")).scatter_reduce(0, sid, a, "amax")
    best = torch.full_like(idx, -1).scatter_reduce(0, sid, torch.where(a == top.gather(0, sid), idx, -1), "amax")
    pivot = best.gather(0, sid)  # [N, h] each token's pivot
    g = torch.exp(-((_rows(K, pivot) - K) ** 2).sum(-1) / (2 * p.sigma**2))
    size = torch.zeros_like(idx).scatter_add_(0, sid, torch.ones_like(idx))  # 0: an empty set (numbered last)
    w = g / _run_sums(g, size).gather(0, sid)
    Km = _run_sums(w[..., None] * K, size)
    Vm = _run_sums(w[..., None] * V, size)
    if p.value_scale == "set_size":
        Vm *= size[..., None].float()
    score = torch.where(pivot == idx, a.masked_fill(prot, float("inf")), float("-inf"))
    return Merge(score, _rows(Km, sid), _rows(Vm, sid))


def _joined(parts: list[Merge], dim: int) -> Merge:
    """The parts' merges joined along ``dim`` (a single part as it is: nothing copied)."""
    return parts[0] if len(parts) == 1 else Merge(*(torch.cat(p, dim=dim) for p in zip(*parts)))


def _row_batches(cols: Columns, d: int) -> list[tuple[slice, Columns | None]]:
    """Consecutive rows of ``cols`` in batches of at most ``MERGE_CHUNK_BYTES / 8 d`` tokens (a
    longer row alone), each batch's packed tokens and its rows (made on the host); the rows that
    do not compact (``keep`` 0) in batches of their own, with no rows (None): nothing to merge."""
    cap, keep, cu = max(1, MERGE_CHUNK_BYTES // (8 * d)), cols.keep, cols.ragged.host
    bounds, start = [], 0
    for r in range(1, len(keep) + 1):
        if r == len(keep) or (keep[r] > 0) != (keep[start] > 0) or (keep[r] and cu[r + 1] - cu[start] > cap):
            bounds.append((start, r))
            start = r
    if bounds == [(0, len(keep))] and keep[0]:
        return [(slice(None), cols)]
    return [(slice(cu[a], cu[b]), _rows_of(cols, a, b) if keep[a] else None) for a, b in bounds]


def _rows_of(cols: Columns, a: int, b: int) -> Columns:
    """Rows ``[a, b)`` of ``cols``, their tokens renumbered from 0."""
    cu = cols.ragged.host
    ragged = Ragged.of(cols.ragged.lengths[a:b], cols.L.device)
    row = cols.row[cu[a] : cu[b]] - a
    return Columns(row, cols.L[a:b], cols.m[a:b], cols.G, ragged, cols.lens[a:b], cols.keep[a:b])


def _row_ranks(score: torch.Tensor, tie: torch.Tensor, cols: Columns) -> torch.Tensor:
    """``[N, H]``: each token's rank in its row, per head, by ``score`` descending, ties to the
    larger ``tie`` (stable sorts: the tie's order, then the score's, then the row's)."""
    order = torch.argsort(tie, dim=0, descending=True, stable=True)
    order = order.gather(0, torch.argsort(score.gather(0, order), dim=0, descending=True, stable=True))
    order = order.gather(0, torch.argsort(cols.row[order], dim=0, stable=True))
    at = torch.arange(order.shape[0], device=order.device) - cols.cu[cols.row]  # place in its row
    return torch.empty_like(order).scatter_(0, order, at[:, None].expand_as(order))


def _rows(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``x [N, h, d]`` at ``i [N, h]`` per head: ``out[j, h] = x[i[j, h], h]``."""
    return x.gather(0, i[..., None].expand(-1, -1, x.shape[-1]))


def _tokens(t: torch.Tensor | PagedKeys, tok: torch.Tensor | slice) -> torch.Tensor:
    """The packed tokens ``tok`` of ``t``, copied where they are read in place."""
    s = t[tok]
    return s.gather() if isinstance(s, PagedKeys) else s


def _run_sums(x: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """``[n, h, ...]``: the sum of ``x [n, h, ...]`` over each set of each head, ``size [n, h]``
    consecutive tokens (0: an empty set), the sets in token order. A segmented sum in float64
    (``segment_reduce``: no atomics), each set's own: the same bits on every run, whichever
    device and whichever rows share the call, and no set count read back."""
    n, h = size.shape
    flat = x.double().transpose(0, 1).reshape(n * h, *x.shape[2:])  # every head's sets back to back
    sums = torch.segment_reduce(flat, "sum", lengths=size.T.reshape(-1), axis=0)
    return sums.view(h, n, *x.shape[2:]).transpose(0, 1).to(x.dtype)
