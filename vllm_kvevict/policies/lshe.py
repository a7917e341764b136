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

from functools import lru_cache
from typing import Literal

import torch
from pydantic import Field

from vllm_kvevict.kernels import ops
from vllm_kvevict.policies.base import MAX_SEED, MAX_TOKENS_PARAM, KVView, Needs, Policy, PolicyParams

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


#: tokens whose distances to the window are computed at once (bounds an [H_q, rows, n] tensor)
ROW_CHUNK = 256


class LSHE(Policy[LSHEParams]):
    name = "lshe"
    Params = LSHEParams
    needs = Needs(queries="step", state={CODE: (torch.int64, 0), VICTIM: (torch.int64, -1)}, decode=True)

    def observe(self, view: KVView) -> None:
        p = self.params
        R = _projection(p.seed, view.layer, p.bits, view.K.shape[-1])
        code, victim = view.state[CODE], view.state[VICTIM]
        Q, q_pos = view.queries()
        if view.budget is None:
            raise ValueError("lshe chooses victims once the window holds its budget: view.budget is needed")
        m, n = q_pos.shape[0], view.pos.shape[1]
        # This step's tokens are the window's last m slots, in order; hash their keys.
        code[:, n - m :] = simhash(view.K[:, n - m :], R)
        G = view.G
        for c0 in range(0, m, ROW_CHUNK):
            c1 = min(m, c0 + ROW_CHUNK)
            if p.hash == "query":  # sum over the group's query heads of d_H(h(q_t^g), h(k_j))
                dist = ops.hamming_distances(simhash(Q[:, c0:c1], R), code, G)  # [H, rows, n]
            else:  # d_H(h(k_t), h(k_j)), per KV head
                dist = ops.hamming_distances(code[:, n - m + c0 : n - m + c1], code, 1)
            ops.lshe_victims(dist, view.pos, victim, q_pos[c0:c1], view.budget, p.sink_tokens, p.recent_tokens)

    def score(self, view: KVView) -> torch.Tensor:
        # Non-victims first; among victims the latest-chosen are kept longest.
        v = view.state[VICTIM]
        return torch.where(v < 0, torch.full_like(v, 2**40), v).float()
