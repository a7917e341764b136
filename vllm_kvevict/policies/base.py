# SPDX-License-Identifier: Apache-2.0
"""The interface every eviction policy implements (docs/policies.md).

Policies work on plain tensors of one (sequence, layer) and know nothing of vLLM: the attention
backend (or the transformers reference, vllm_kvevict/testing/hf_reference.py) gathers a
:class:`KVView` and

* every step, for policies with per-slot state (H2O accumulators, LSH codes), calls
  :meth:`Policy.observe`, which updates ``view.state`` in place;
* when the window moves, asks for scores and lets :meth:`Policy.select` pick the kept slots per KV
  head (and :meth:`Policy.merge` rewrite them, for merging policies).

Higher score = keep. Every KV head keeps the same number of tokens (one block table serves all
heads of a layer), but heads may keep different tokens. Slot order within a head is position
order, always: compaction keeps the kept slots in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict

from vllm_kvevict.kernels import ops

#: Upper bound of token-count parameters (sink/recent tokens): far above any budget a server runs
#: with, far below what overflows the int32 positions and the index arithmetic.
MAX_TOKENS_PARAM = 1 << 20
#: Seeds are 31-bit: ``random``'s hash and LSH-E's generator seed stay inside int64 with them.
MAX_SEED = (1 << 31) - 1


class PolicyParams(BaseModel):
    """Per-policy parameters. Unknown keys are an error, as everywhere in the config.

    Strict and bounded: an integer must be a JSON integer (not a bool, float or string), a float a
    finite number; every field states its range, so no accepted value can overflow or divide by
    zero inside the kernels (docs/configuration.md, "Bounds").
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    def min_budget(self) -> int:
        """Smallest budget this policy can honour (its protected sink/recent tokens, plus one)."""
        return 1


@dataclass
class KVView:
    """What a policy sees of one (sequence, layer) at a trigger point.

    ``K``/``V``: ``[H_kv, n, d]`` keys (post-RoPE, as stored) and values of the window: cached +
    written by this step. ``pos``: ``[H_kv, n]`` absolute token position of each slot (heads
    diverge after compaction). ``L``: tokens computed so far (every position is ``< L``).
    ``Q``/``q_pos``: ``[H_q, m, d]`` queries (post-RoPE) of the tokens of this step, and their
    positions ``[m]``; ``Q_window``/``w_pos``: the last ``query_window`` queries of the sequence
    (this step's included). ``scale``/``softcap``: the model's attention scaling. ``W_O``:
    ``[H_q, d, D]`` this layer's output projection per query head. ``state``: per-slot tensors
    ``[H_kv, n]`` named by :attr:`Policy.slot_state`, moved with the tokens. ``budget``: the
    configured budget; ``keep``: the count kept at this compaction (at least the budget, less than
    a block more). ``attn``: ``[H_q, n]``, the attention of :meth:`Policy.attention_queries` summed
    per slot, when the engine has computed it for every row of the step at once.
    """

    K: torch.Tensor
    V: torch.Tensor
    pos: torch.Tensor
    layer: int = 0
    G: int = 1
    L: int | None = None
    Q: torch.Tensor | None = None
    q_pos: torch.Tensor | None = None
    Q_window: torch.Tensor | None = None
    w_pos: torch.Tensor | None = None
    scale: float | None = None
    softcap: float | None = None
    W_O: torch.Tensor | None = None
    budget: int | None = None
    keep: int | None = None
    state: dict[str, Any] = field(default_factory=dict)
    attn: torch.Tensor | None = None

    @property
    def num_heads(self) -> int:
        return self.K.shape[0]

    def queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``Q`` and ``q_pos``: this step's queries (a policy that declares ``needs_queries``)."""
        if self.Q is None or self.q_pos is None:
            raise ValueError("this policy reads the step's queries (view.Q, view.q_pos); none were given")
        return self.Q, self.q_pos

    def window_queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``Q_window`` and ``w_pos``: the sequence's latest queries (a policy with a ``query_window``)."""
        if self.Q_window is None or self.w_pos is None:
            raise ValueError("this policy reads the latest queries (view.Q_window, view.w_pos); none were given")
        return self.Q_window, self.w_pos

    @property
    def kept(self) -> int:
        """How many tokens per KV head this compaction keeps (``keep``, else the ``budget``)."""
        n = self.keep if self.keep is not None else self.budget
        if n is None:
            raise ValueError("the view has neither keep nor budget")
        return n

    @property
    def attn_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.K.shape[-1])

    @property
    def length(self) -> int:
        if self.L is not None:
            return self.L
        return int(self.pos.max()) + 1 if self.pos.numel() else 0


P = TypeVar("P", bound=PolicyParams)


class Policy(Generic[P]):
    """Base class: subclasses set ``name``, ``Params`` and implement :meth:`score`."""

    name: ClassVar[str]
    Params: ClassVar[type[PolicyParams]] = PolicyParams
    #: the policy also compacts while decoding (every block_size generated tokens)
    evicts_during_decode: ClassVar[bool] = False
    #: trigger when the configuration leaves it unset: "chunked" (every step) or "once" (prompt end)
    default_trigger: ClassVar[Literal["chunked", "once"]] = "chunked"
    #: the policy needs ``W_O`` (the backend finds the layer's output projection once)
    needs_w_o: ClassVar[bool] = False

    def __init__(self, params: P | None = None):
        self.params: P = params if params is not None else self.Params()  # type: ignore[assignment]

    # What the backend must provide; instance-level because they may depend on the parameters.
    @property
    def query_window(self) -> int:
        """How many of the latest queries the policy reads (``view.Q_window``); 0 = none."""
        return 0

    @property
    def needs_queries(self) -> bool:
        """Whether ``view.Q`` (this step's queries) is read."""
        return self.query_window > 0 or self.observes

    @property
    def slot_state(self) -> dict[str, tuple[torch.dtype, float]]:
        """Per-slot state ``{name: (dtype, initial value)}``, kept beside the KV cache."""
        return {}

    @property
    def observes(self) -> bool:
        """Whether :meth:`observe` must run every step (not only when compacting)."""
        return bool(self.slot_state)

    def observe(self, view: KVView) -> None:
        """Update ``view.state`` with this step's tokens (``view.Q``/``q_pos``); in place."""

    def attention_queries(self, view: KVView) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The queries ``[H_q, m, d]`` and their positions ``[m]`` whose attention to the window the
        policy reads in a step (in :meth:`observe` if it observes, else in :meth:`score`); None:
        it reads none. One set per step, so the engine computes every row's in one call."""
        return None

    def attention(self, view: KVView) -> torch.Tensor:
        """``[H_q, n]`` float32: the softmax attention each slot receives from
        :meth:`attention_queries`, scaled and soft-capped as the model does, causal by position
        (SnapKV, TOVA, H2O), summed over the queries; query head ``h`` reads KV head ``h // G``.
        ``view.attn`` when the engine has computed it (one ragged
        :func:`~vllm_kvevict.kernels.ops.column_sums` for every row of the step); computed here
        otherwise (the transformers reference, tests), never as ``[H_q, m, n]``."""
        if view.attn is not None:
            return view.attn
        queries = self.attention_queries(view)
        if queries is None:
            raise ValueError(f"{self.name} reads no attention")
        Q, q_pos = queries
        one = lambda n: torch.tensor([0, n], device=view.K.device)  # noqa: E731 - a single row
        return ops.column_sums(
            Q.transpose(0, 1),
            view.K.transpose(0, 1),
            q_pos.to(view.K.device),
            view.pos.T,
            one(Q.shape[1]),
            one(view.K.shape[1]),
            view.G,
            view.attn_scale,
            view.softcap,
        ).T

    def score(self, view: KVView) -> torch.Tensor:
        """``[H_kv, n]`` float32 scores, higher = keep; ``+inf`` marks protected slots.

        Policies that score from the keys and positions alone state their formula once, in
        :meth:`score_ragged`; this derives the one-row form from it (the row is the whole view)."""
        if type(self).score_ragged is Policy.score_ragged:  # pragma: no cover - abstract
            raise NotImplementedError(f"{type(self).__name__} implements neither score nor score_ragged")
        n = view.K.shape[1]
        cu = torch.tensor([0, n], device=view.K.device)
        L = torch.tensor([view.length])
        return self.score_ragged(view.K.transpose(0, 1), view.pos.transpose(0, 1), cu, L, view.layer).transpose(0, 1)

    def score_ragged(
        self, K: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor, L: torch.Tensor, layer: int
    ) -> torch.Tensor:
        """The score of a policy that reads only the keys and positions, for the packed tokens of
        many rows at once (``K [N, H, d]``, ``pos [N, H]``, row ``r`` = ``[cu[r], cu[r+1])``, its
        length ``L[r]``): ``[N, H]``. Such a policy writes only this (its formula, once);
        :meth:`score` is derived from it. A policy that does not define it scores row by row
        (:meth:`score`)."""
        raise NotImplementedError(f"{type(self).__name__} scores row by row (score), not score_ragged")

    @property
    def default_selection(self) -> bool:
        """Whether the kept set is the plain top-k of :meth:`score` (no own selection or merging):
        the engine then selects this policy's rows together with every other such row."""
        cls = type(self)
        return cls.select is Policy.select and cls.merge is Policy.merge and cls.evict is Policy.evict

    @property
    def batched(self) -> bool:
        """Whether the engine may score this policy's rows together
        (:func:`vllm_kvevict.backends.evict.evict_step`): it has :meth:`score_ragged` and uses the
        default selection, no state, queries or merging."""
        cls = type(self)
        return (
            cls.score_ragged is not Policy.score_ragged
            and self.default_selection
            and not self.needs_queries
            and not self.observes
        )

    def select(self, scores: torch.Tensor, keep: int, view: KVView) -> torch.Tensor:
        """Indices ``[H_kv, keep]`` of the kept slots, in ascending slot order per head.

        Deterministic tie rule (docs/policies.md, "Ties"): among equal scores the newer token
        (larger position) is kept.
        """
        return topk_newer(scores, keep, view.pos)

    def merge(self, view: KVView, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Merging policies: new ``(K, V)`` ``[H_kv, keep, d]`` for the kept slots; None = unchanged."""
        return None

    def evict(self, view: KVView, keep: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Kept slot indices ``[H_kv, keep]`` and, for merging policies, their new K/V."""
        view.keep = keep
        kept = self.select(self.score(view), keep, view)
        return kept, self.merge(view, kept)


def topk_newer(scores: torch.Tensor, keep: int, pos: torch.Tensor) -> torch.Tensor:
    """The ``keep`` best slots per row, ties to the larger position, returned in slot order."""
    n = scores.shape[-1]
    if keep >= n:
        return torch.arange(n, device=scores.device).expand(scores.shape[0], n).clone()
    # Sort by (score desc, position desc): sort by position first, then a stable sort by score.
    by_pos = torch.argsort(pos, dim=-1, descending=True, stable=True)
    s = torch.gather(scores.float(), -1, by_pos)
    order = torch.argsort(s, dim=-1, descending=True, stable=True)
    kept = torch.gather(by_pos, -1, order[:, :keep])
    return torch.sort(kept, dim=-1).values
