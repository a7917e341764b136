# SPDX-License-Identifier: Apache-2.0
"""``none``: keep everything. With this policy the backend behaves exactly like vLLM's own."""

from __future__ import annotations

import torch

from vllm_kvevict.policies.base import KVView, Policy


class NoEviction(Policy):
    name = "none"

    def score(self, view: KVView) -> torch.Tensor:
        return torch.full(view.pos.shape, float("inf"), device=view.K.device)
