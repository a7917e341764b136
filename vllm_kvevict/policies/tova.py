"""TOVA: keep the tokens the latest query attends to most (ALGORITHMS.md 0.2; Oren et al. 2024).

    phi(A) = A[-1, :]       attention of the last query of the chunk/step to every key

GQA: averaged over the query group (KeyDiff App. B.2). No protected tokens. The paper evicts one
token per step; here the window's eviction runs every chunk and every ``block_size`` generated
tokens, scored by the query of the step that moves the window.
"""

from __future__ import annotations

import torch

from vllm_kvevict.policies.attention import column_sums, group_mean
from vllm_kvevict.policies.base import KVView, Policy


def tova_scores(view: KVView) -> torch.Tensor:
    """``[H_kv, n]``: group-mean attention of the newest query."""
    return group_mean(column_sums(view, view.Q[:, -1:], view.q_pos[-1:]), view.G)


class TOVA(Policy):
    name = "tova"
    evicts_during_decode = True

    @property
    def needs_queries(self) -> bool:
        return True

    def score(self, view: KVView) -> torch.Tensor:
        return tova_scores(view)
