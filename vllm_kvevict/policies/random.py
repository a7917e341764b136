# SPDX-License-Identifier: Apache-2.0
"""Random eviction, seeded: the floor any policy must beat.

Each token's score is a hash of (seed, layer, KV head, position), uniform in [0, 1): the same
token gets the same score at every compaction, in every batch and on every device, so the kept set
is reproducible for a seed.
"""

from __future__ import annotations

import torch
from pydantic import Field

from vllm_kvevict.policies.base import MAX_SEED, Needs, Policy, PolicyParams

_M31 = 0x7FFFFFFF


class RandomParams(PolicyParams):
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seed of the per-token scores")


def _mix(x: torch.Tensor) -> torch.Tensor:
    # A few rounds of a 31-bit LCG and xor-shift: stays inside int64 without overflow.
    for _ in range(3):
        x = (x * 1103515245 + 12345) & _M31
        x = x ^ (x >> 13)
    return x


def hash_scores(seed: int, layer: int, pos: torch.Tensor) -> torch.Tensor:
    """``[N, H]`` scores of the tokens at positions ``pos [N, H]`` (KV head = column)."""
    H = pos.shape[1]
    head = torch.arange(H, device=pos.device, dtype=torch.int64)[None, :]
    x = _mix(_mix(_mix(torch.full_like(pos, seed, dtype=torch.int64) + layer) + head) + pos.long())
    return x.to(torch.float64).div(_M31 + 1).to(torch.float32)


class Random(Policy[RandomParams]):
    name = "random"
    Params = RandomParams
    needs = Needs(decode=True)

    def score_ragged(self, K, pos, cu, L, layer):
        return hash_scores(self.params.seed, layer, pos)
