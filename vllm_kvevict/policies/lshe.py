# SPDX-License-Identifier: Apache-2.0
"""LSH-E: evict the cached key whose SimHash is farthest from the query's (LSH-E
paper Sec. 3, Alg. 1).

    h(x) = [R x >= 0] in {0,1}^c           R in R^{c x d}, N(0, 1), fixed per layer (seeded)
    e_t  = argmax_j  sum_{g in group} d_H(h(q_t^g), h(k_j))      over the unprotected cached keys
    d_H(a, b) = popcount(a xor b)          on the bit-packed codes

One token per new token: before token t joins, if the cache already holds ``budget`` tokens, the
cached key with the largest Hamming distance to t's query (summed over the query group, 6.5 #14;
ties: the oldest, #17) becomes t's victim. The first ``sink_tokens`` and the ``recent_tokens``
most recent tokens are protected. Prompt chunks are processed token by token (the paper's prompt
stage), and so is decoding.

Per-slot state moved with the tokens: ``lsh_code`` (the key's c-bit code, packed) and
``lsh_victim`` (the position of the token that chose it as victim, -1 if none). Deviation: a
victim is dropped at the window's next compaction (every chunk, every ``block_size`` generated
tokens), not at once, so it stays visible to attention until then. ``hash: key`` reproduces the
public code, which hashes the incoming key instead of the query.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Literal

import torch
from pydantic import Field

from vllm_kvevict.kernels import ops, torch_ops
from vllm_kvevict.kernels.torch_ops import PagedKeys, Ragged, dense_positions, on_device, ragged
from vllm_kvevict.policies.base import (
    MAX_SEED,
    MAX_TOKENS_PARAM,
    Columns,
    KVView,
    Needs,
    Packed,
    Policy,
    PolicyParams,
)

CODE, VICTIM = "lsh_code", "lsh_victim"


class LSHEParams(PolicyParams):
    bits: int = Field(16, ge=1, le=62, description="hash length c in bits")
    sink_tokens: int = Field(4, ge=0, le=MAX_TOKENS_PARAM, description="initial tokens never evicted")
    recent_tokens: int = Field(10, ge=0, le=MAX_TOKENS_PARAM, description="most recent tokens never evicted")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seed of the per-layer random projections")
    hash: Literal["query", "key"] = Field("query", description="query (paper) or key (public code) hashing")

    def min_budget(self) -> int:
        return self.sink_tokens + self.recent_tokens + 1


@lru_cache(maxsize=4096)
def _projection(seed: int, layer: int, bits: int, d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    return torch.randn(bits, d, generator=g, dtype=torch.float32)


def simhash(x: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """Packed codes ``[...]`` int64 of vectors ``x [..., d]``: bit b = [R_b . x >= 0]."""
    return ops.simhash_codes(x.reshape(-1, x.shape[-1]), R.to(x.device)).view(x.shape[:-1])


#: tokens whose distances to the window are computed at once (bounds an [H, rows, n] tensor)
ROW_CHUNK = 256


@ops.fused("lshe_victims_ragged")
def lshe_victims_ragged(
    q_codes: torch.Tensor,
    k_codes: torch.Tensor,
    pos: torch.Tensor | PagedKeys,
    victim: torch.Tensor,
    q_pos: torch.Tensor,
    cu_q,
    cu_k,
    budget: torch.Tensor,
    sinks: int,
    recent: int,
    G: int,
) -> torch.Tensor:
    """Alg. 1 line 1 for packed rows: row ``r``'s tokens ``[cu_q[r], cu_q[r + 1])`` in order (their
    query codes ``q_codes [M, H_q]`` at positions ``q_pos [M]``; or their key codes ``[M, H]`` with
    ``G = 1``) choose victims among its window ``[cu_k[r], cu_k[r + 1])`` (codes ``k_codes
    [N, H]``, positions ``pos``, victims ``victim [N, H]``, updated in place and returned), once
    it holds ``budget[r]`` tokens."""
    pos, cq, ck = dense_positions(pos), ragged(cu_q).host, ragged(cu_k).host
    for r, b in enumerate(budget.tolist()):
        keys = slice(ck[r], ck[r + 1])
        for c0 in range(cq[r], cq[r + 1], ROW_CHUNK):  # in order: a chunk sees the victims before it
            rows = slice(c0, min(cq[r + 1], c0 + ROW_CHUNK))
            dist = torch_ops.hamming_distances(q_codes[rows].T, k_codes[keys].T, G)
            torch_ops.lshe_victims(dist, pos[keys].T, victim[keys].T, q_pos[rows], b, sinks, recent)
    return victim


class LSHE(Policy[LSHEParams]):
    name = "lshe"
    Params = LSHEParams
    needs = Needs(queries="step", state={CODE: (torch.int64, 0), VICTIM: (torch.int64, -1)}, decode=True)

    def observe(self, view: KVView) -> None:
        """:meth:`observe_columns` of the view's one row."""
        if view.budget is None:
            raise ValueError("lshe chooses victims once the window holds its budget: view.budget is needed")
        Q, q_pos = view.queries()
        dev, m = view.K.device, q_pos.shape[0]
        cols = Columns.of_view(view, m)
        cols = replace(cols, queries=Ragged.of([m], dev), budget=on_device([view.budget], dev))
        state = {k: view.state[k].T.contiguous() for k in (CODE, VICTIM)}
        x = Packed(None, view.pos.T, state, view.V.transpose(0, 1), K=view.K.transpose(0, 1), layer=view.layer)
        x.Q, x.q_pos = Q.transpose(0, 1), q_pos.to(dev)
        self.observe_columns(x, cols)
        for k, t in state.items():
            view.state[k].copy_(t.T)

    def observe_columns(self, x: Packed, cols: Columns) -> None:
        """:meth:`observe` of packed rows: every row's new keys hashed at once, its queries too, and
        one pass choosing every row's victims (:func:`lshe_victims_ragged`)."""
        p = self.params
        if x.K is None or x.Q is None or x.q_pos is None or cols.queries is None or cols.budget is None:
            raise ValueError("lshe observes its rows from their keys, queries and budgets; some were not given")
        keys = x.K[x.tok][cols.newest]  # this step's tokens: each row's last m
        keys = keys.gather() if isinstance(keys, PagedKeys) else keys
        R = _projection(p.seed, x.layer, p.bits, keys.shape[-1])
        code, victim = x.state[CODE], x.state[VICTIM]
        new = simhash(keys, R)  # [M, H]
        code[cols.newest] = new
        q_codes, G = (simhash(x.Q, R), cols.G) if p.hash == "query" else (new, 1)
        args = (x.q_pos, cols.queries, cols.ragged, cols.budget, p.sink_tokens, p.recent_tokens, G)
        lshe_victims_ragged(q_codes, code, x.pos, victim, *args)

    def score(self, view: KVView) -> torch.Tensor:
        return victim_scores(view.state[VICTIM])

    def score_columns(self, x: Packed, cols: Columns) -> torch.Tensor:
        return victim_scores(x.state[VICTIM])


def victim_scores(v: torch.Tensor) -> torch.Tensor:
    """Non-victims first; among victims the latest-chosen are kept longest."""
    return torch.where(v < 0, torch.full_like(v, 2**40), v).float()
