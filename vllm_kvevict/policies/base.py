"""The interface every eviction policy implements (ALGORITHMS.md section 6.2).

Policies work on plain tensors of one (sequence, layer) and know nothing of vLLM: the attention
backend gathers a :class:`KVView`, asks the policy for scores and lets :meth:`Policy.select` pick the
kept slots per KV head. Higher score = keep. Every KV head keeps the same number of tokens (one
block table serves all heads of a layer), but heads may keep different tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict


class PolicyParams(BaseModel):
    """Per-policy parameters. Unknown keys are an error, as everywhere in the config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def min_budget(self) -> int:
        """Smallest budget this policy can honour (its protected sink/recent tokens, plus one)."""
        return 1


@dataclass
class KVView:
    """What a policy sees of one (sequence, layer) at a trigger point.

    ``K``/``V``: ``[H_kv, n, d]`` keys (post-RoPE, as stored) and values, cached + newly appended.
    ``pos``: ``[H_kv, n]`` absolute token position of each slot (heads diverge after compaction).
    ``is_new``: ``[H_kv, n]`` True for slots written by the current chunk/step.
    """

    K: torch.Tensor
    V: torch.Tensor
    pos: torch.Tensor
    is_new: torch.Tensor | None = None
    layer: int = 0
    G: int = 1
    Q: torch.Tensor | None = None
    state: dict[str, Any] = field(default_factory=dict)


class Policy:
    """Base class: subclasses set ``name``, ``Params`` and implement :meth:`score`."""

    name: ClassVar[str]
    Params: ClassVar[type[PolicyParams]] = PolicyParams
    #: the policy also compacts while decoding (every block_size generated tokens)
    evicts_during_decode: ClassVar[bool] = False

    def __init__(self, params: PolicyParams | None = None):
        self.params = params if params is not None else self.Params()

    def score(self, view: KVView) -> torch.Tensor:  # pragma: no cover - abstract
        """``[H_kv, n]`` float32 scores, higher = keep; ``+inf`` marks protected slots."""
        raise NotImplementedError

    def select(self, scores: torch.Tensor, keep: int, view: KVView) -> torch.Tensor:
        """Indices ``[H_kv, keep]`` of the kept slots, in ascending slot order per head.

        Deterministic tie rule (ALGORITHMS.md 6.5 #21): among equal scores the newer token
        (larger position) is kept.
        """
        n = scores.shape[-1]
        if keep >= n:
            return torch.arange(n, device=scores.device).expand(scores.shape[0], n).clone()
        # Sort by (score desc, position desc): sort by position first, then a stable sort by score.
        by_pos = torch.argsort(view.pos, dim=-1, descending=True, stable=True)
        s = torch.gather(scores.float(), -1, by_pos)
        order = torch.argsort(s, dim=-1, descending=True, stable=True)
        kept = torch.gather(by_pos, -1, order[:, :keep])
        return torch.sort(kept, dim=-1).values
