# SPDX-License-Identifier: Apache-2.0
"""TOVA: keep the tokens the latest query attends to most (Oren et al. 2024).

    phi(A) = A[-1, :]       attention of the last query of the chunk/step to every key

GQA: averaged over the query group (KeyDiff App. B.2). No protected tokens. The paper evicts one
token per step; here the window's eviction runs every chunk and every ``block_size`` generated
tokens, scored by the query of the step that moves the window.
"""

from __future__ import annotations

import torch

from vllm_kvevict.policies.attention import columns_group_mean
from vllm_kvevict.policies.base import Columns, KVView, Needs, Packed, Policy


def tova_columns(A: torch.Tensor, G: int) -> torch.Tensor:
    """``[N, H_kv]``: group mean of ``A [N, H_q]``, the newest query's attention (packed rows)."""
    return columns_group_mean(A, G)


class TOVA(Policy):
    name = "tova"
    needs = Needs(queries="newest", attention=True, decode=True)

    def score(self, view: KVView) -> torch.Tensor:
        return self.score_one_row(view)

    def score_columns(self, x: Packed, cols: Columns) -> torch.Tensor:
        return tova_columns(x.A, cols.G)
