# SPDX-License-Identifier: Apache-2.0
"""The interface every eviction policy implements (docs/architecture.md, "Adding a policy").

Policies work on plain tensors of one (sequence, layer) and know nothing of vLLM. A policy is its
parameters (a pydantic :class:`PolicyParams`), what it reads (one frozen :class:`Needs`), and its
equation:

* :meth:`Policy.score` ``(view) -> [H_kv, n]``: higher = keep, ``+inf`` = protected; the engine
  keeps the top ``keep`` per KV head (ties to the newer token). A policy that reads only the keys
  and positions writes :meth:`Policy.score_ragged` instead (many rows at once), and ``score`` is
  derived from it;
* :meth:`Policy.observe` ``(view)``, for policies with per-slot state (``Needs.state``): every
  step, updates ``view.state`` in place (H2O's accumulator, LSH-E's codes); a policy that reads
  its queries' attention writes :meth:`Policy.score_columns` (and :meth:`Policy.observe_columns`)
  over many rows' packed tokens instead;
* :meth:`Policy.merge_columns` ``(x, cols)``, for merging policies (``Needs.merges``) instead of
  ``score``: the kept slots and their new K/V.

The attention backend (or the transformers reference, vllm_kvevict/testing/hf_reference.py)
gathers a :class:`KVView` holding what :class:`Needs` asked for and calls :meth:`Policy.evict`.
Every KV head keeps the same number of tokens (one block table serves all heads of a layer), but
heads may keep different tokens. Slot order within a head is position order, always.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, NamedTuple, TypeVar

import torch
from pydantic import BaseModel, ConfigDict

from vllm_kvevict.kernels import ops
from vllm_kvevict.kernels.torch_ops import PagedKeys, Ragged, dense_positions, on_device

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


Queries = Literal["none", "newest", "step", "window"]


@dataclass(frozen=True)
class Needs:
    """What a policy reads besides the window's keys, values and positions, and when it runs; the
    engine provides exactly this.

    ``queries``: which queries ``view.Q`` holds: ``newest`` (the step's last), ``step`` (every query
    of the step), ``window`` (the sequence's last ``window`` queries, kept by the engine across
    steps). ``attention``: ``view.attn`` is the softmax attention of those queries, summed per slot.
    ``w_o``: ``view.W_O``, the layer's output projection. ``state``: per-slot tensors ``{name:
    (dtype, initial value)}`` kept beside the KV cache and moved with the tokens (the policy then
    observes every step). ``decode``: it compacts while decoding too. ``trigger``: when it compacts
    if the configuration does not say (``chunked``: every prefill chunk; ``once``: at prompt end).
    ``merges``: it rewrites the kept K/V (:meth:`Policy.merge`) instead of scoring."""

    queries: Queries = "none"
    window: int = 0
    attention: bool = False
    w_o: bool = False
    state: dict[str, tuple[torch.dtype, float]] = field(default_factory=dict, hash=False)
    decode: bool = False
    trigger: Literal["chunked", "once"] = "chunked"
    merges: bool = False

    def __post_init__(self) -> None:
        if (self.queries == "window") != (self.window > 0):
            raise ValueError("a query window is the window queries' length: window > 0 exactly with queries='window'")
        if self.attention and self.queries == "none":
            raise ValueError("attention is the attention of the policy's queries: name them")

    @property
    def observes(self) -> bool:
        """Whether :meth:`Policy.observe` runs every step (a policy with per-slot state)."""
        return bool(self.state)

    @property
    def query_window(self) -> int:
        """How many of the sequence's latest queries the engine keeps for the policy (0: none)."""
        return self.window


@dataclass(kw_only=True)
class RowInputs:
    """What the engine knows of a row besides its KV (the :class:`KVView` fields the backend
    prepares per row, before the step reads the KV; None: not given)."""

    L: int | None = None
    budget: int | None = None
    scale: float | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    Q: torch.Tensor | None = None
    q_pos: torch.Tensor | None = None
    W_O: torch.Tensor | None = None

    def inputs(self) -> dict[str, Any]:
        """These fields by name (what a :class:`KVView` of the row takes from them)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(RowInputs)}


@dataclass(kw_only=True)
class KVView(RowInputs):
    """What a policy sees of one (sequence, layer) at a step: its KV and the row's inputs.

    ``K``/``V``: ``[H_kv, n, d]`` keys (post-RoPE, as stored) and values of the window: cached +
    written by this step. ``pos``: ``[H_kv, n]`` absolute token position of each slot (heads
    diverge after compaction). ``layer``: the layer's index. ``G``: query heads per KV head.
    ``L``: tokens computed so far (every position is ``< L``). ``Q``/``q_pos``: ``[H_q, m, d]``
    the queries (post-RoPE) the policy's :attr:`Needs.queries` names, and their positions ``[m]``.
    ``scale``/``softcap``: the model's attention scaling; ``sinks``: ``[H_q]`` its learned attention
    sinks (gpt-oss: a logit per query head in every softmax's denominator), if any. ``W_O``: ``[H_q, d, D]`` this layer's
    output projection per query head. ``budget``: the configured budget; ``keep``: the count kept
    at this compaction (at least the budget, less than a block more). ``state``: per-slot tensors
    ``[H_kv, n]`` named by :attr:`Needs.state`. ``attn``: ``[H_q, n]``, the attention of ``Q``
    summed per slot, when the engine has computed it for every row of the step at once.
    """

    K: torch.Tensor
    V: torch.Tensor
    pos: torch.Tensor
    layer: int = 0
    G: int = 1
    keep: int | None = None
    state: dict[str, Any] = field(default_factory=dict)
    attn: torch.Tensor | None = None

    @property
    def num_heads(self) -> int:
        return self.K.shape[0]

    def queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``Q`` and ``q_pos`` (a policy that names its queries in :attr:`Needs.queries`)."""
        if self.Q is None or self.q_pos is None:
            raise ValueError("this policy reads queries (view.Q, view.q_pos); none were given")
        return self.Q, self.q_pos

    def output_projection(self) -> torch.Tensor:
        """``W_O`` (a policy that declares ``Needs.w_o``)."""
        if self.W_O is None:
            raise ValueError("this policy reads the layer's output projection (view.W_O); none was given")
        return self.W_O

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


def step_queries(needs: Needs, Q: torch.Tensor, q_pos: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What ``view.Q``/``q_pos`` hold of a step's queries ``Q [H_q, m, d]`` for a policy whose
    :attr:`Needs.queries` is ``newest`` or ``step`` (None, None: it reads none of them)."""
    if needs.queries == "step":
        return Q, q_pos
    if needs.queries == "newest":
        return Q[:, -1:], q_pos[-1:]
    return None, None


@dataclass(frozen=True)
class Columns:
    """The rows of packed attention column sums (:meth:`Policy.score_columns`): row ``r`` is the
    packed tokens ``[cu[r], cu[r + 1])`` (``ragged``: those offsets on the host and the device);
    ``row``: each token's row; ``L``: each row's tokens computed so far; ``m``: how many queries
    each row's sums add up; ``G``: query heads per KV head. Device tensors, made once per step; on
    the host: ``lens`` (each row's L) and ``keep`` (how many tokens each row keeps: 0 for a row
    that does not compact). ``queries``: the offsets of the rows' ``m`` queries, packed;
    ``budget``: each row's configured budget (``[R]``, a policy that reads it)."""

    row: torch.Tensor
    L: torch.Tensor
    m: torch.Tensor
    G: int
    ragged: Ragged
    lens: tuple[int, ...]
    keep: tuple[int, ...]
    queries: Ragged | None = None
    budget: torch.Tensor | None = None

    @functools.cached_property
    def newest(self) -> torch.Tensor:
        """``[sum m]`` int64: the packed tokens of each row's queries, its last ``m`` (this step's),
        made on the host once per step."""
        assert self.queries is not None, "the rows' queries were not given"
        cu, cq = self.ragged.host, self.queries.host
        last = [j for r in range(len(cu) - 1) for j in range(cu[r + 1] - (cq[r + 1] - cq[r]), cu[r + 1])]
        return on_device(last, self.L.device)

    @classmethod
    def of_view(cls, view: KVView, m: int) -> Columns:
        """The one row of ``view``, its sums over ``m`` queries."""
        dev, n = view.K.device, view.K.shape[1]
        row = torch.zeros(n, dtype=torch.long, device=dev)
        cu, L = Ragged.of([n], dev), view.length
        keep = view.keep if view.keep is not None else view.budget or 0
        return cls(row, on_device([L], dev), on_device([m], dev), view.G, cu, (L,), (keep,))

    @property
    def cu(self) -> torch.Tensor:
        """``[R + 1]``: the rows' offsets on the device."""
        return self.ragged.dev


@dataclass
class Packed:
    """What a columnar policy reads of its rows' packed tokens at a step (:meth:`Policy.score_columns`):
    ``A [N, H_q]`` the attention each token receives, summed over its row's queries; ``pos`` int64
    ``[N, H_kv]``, or read where they are (through
    :func:`~vllm_kvevict.kernels.torch_ops.dense_positions`); ``state``: ``{name: [N, H_kv]}`` the
    per-slot state (observed this step); the values ``V[tok]`` (``[N, H_kv, d]``, packed or read
    where they are: read only by a policy that asks); ``W_O``: the layer's output projection ``[H_q, d, D]`` (a
    policy with ``Needs.w_o``). A policy that reads its queries but not their attention (``attn``
    None) gets the keys (``K[tok]``, like ``V``), its queries ``Q [M, H_q, d]`` at positions
    ``q_pos [M]`` (packed by row: ``Columns.queries``) and the layer's index."""

    attn: torch.Tensor | None
    pos: torch.Tensor | PagedKeys
    state: dict[str, torch.Tensor]
    V: torch.Tensor | PagedKeys
    tok: torch.Tensor | slice = field(default_factory=lambda: slice(None))
    W_O: torch.Tensor | None = None
    K: torch.Tensor | PagedKeys | None = None
    Q: torch.Tensor | None = None
    q_pos: torch.Tensor | None = None
    layer: int = 0

    @property
    def A(self) -> torch.Tensor:
        """``[N, H_q]``: the attention each token receives (a policy that reads it)."""
        if self.attn is None:
            raise ValueError("this policy reads its queries' attention; none was computed")
        return self.attn


class Merge(NamedTuple):
    """What a merging policy makes of its rows' packed tokens (:meth:`Policy.merge_columns`):
    ``score [N, H_kv]`` selects the kept tokens as any score does (``-inf``: never kept while the
    row has ``keep`` others); ``K``, ``V`` ``[N, H_kv, d]``: what a kept token's slot then holds."""

    score: torch.Tensor
    K: torch.Tensor
    V: torch.Tensor


P = TypeVar("P", bound=PolicyParams)


class Policy(Generic[P]):
    """Base class: subclasses set ``name``, ``Params``, ``needs`` and implement :meth:`score`
    (or :meth:`score_ragged`; merging policies :meth:`merge_columns`)."""

    name: ClassVar[str]
    Params: ClassVar[type[PolicyParams]] = PolicyParams
    #: what the policy reads and when it runs; a policy whose needs depend on its parameters sets
    #: it in ``__init__``
    needs: Needs = Needs()

    def __init__(self, params: P | None = None):
        self.params: P = params if params is not None else self.Params()  # type: ignore[assignment]

    def score(self, view: KVView) -> torch.Tensor:
        """``[H_kv, n]`` float32 scores, higher = keep; ``+inf`` marks protected slots.

        Policies that score from the keys and positions alone state their formula once, in
        :meth:`score_ragged`; this derives the one-row form from it (the row is the whole view)."""
        if type(self).score_ragged is Policy.score_ragged:  # pragma: no cover - abstract
            raise NotImplementedError(f"{type(self).__name__} implements neither score nor score_ragged")
        dev = view.K.device
        cu, L = on_device([0, view.K.shape[1]], dev), on_device([view.length], dev)
        return self.score_ragged(view.K.transpose(0, 1), view.pos.transpose(0, 1), cu, L, view.layer).transpose(0, 1)

    def score_columns(self, x: Packed, cols: Columns) -> torch.Tensor:
        """The score of a policy that reads only its queries' attention, the positions, its
        per-slot state and the values, for the packed tokens of many rows at once (``x``; rows
        and lengths in ``cols``): ``[N, H_kv]``. Such a policy writes its formula here once; its
        :meth:`score` calls it with the view's one row (:meth:`score_one_row`)."""
        raise NotImplementedError(f"{type(self).__name__} scores row by row (score), not score_columns")

    def observe_columns(self, x: Packed, cols: Columns) -> None:
        """:meth:`observe` of many rows at once, from their queries' attention (``x.A``): updates
        the packed per-slot state ``x.state`` in place. A columnar policy with per-slot state
        writes it; its rows that do not compact in a step observe here too."""
        raise NotImplementedError(f"{type(self).__name__} observes row by row (observe), not observe_columns")

    def score_one_row(self, view: KVView) -> torch.Tensor:
        """:meth:`score_columns` of the view's one row: ``[H_kv, n]``."""
        cols = Columns.of_view(view, view.queries()[0].shape[1])
        state = {k: v.T for k, v in view.state.items()}
        x = Packed(self.attention(view).T, view.pos.T, state, view.V.transpose(0, 1), W_O=view.W_O)
        return self.score_columns(x, cols).T

    @property
    def columnar(self) -> bool:
        """Whether the engine may score (and observe) this policy's rows together, through
        :meth:`score_columns` (and :meth:`observe_columns`) from one ragged column sum for every
        row: it reads its queries' attention, the positions and its per-slot state only."""
        n, cls = self.needs, type(self)
        observes = not n.state or cls.observe_columns is not Policy.observe_columns
        if n.merges:
            return cls.merge_columns is not Policy.merge_columns and observes
        return cls.score_columns is not Policy.score_columns and observes

    def score_ragged(
        self, K: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor, L: torch.Tensor, layer: int
    ) -> torch.Tensor:
        """The score of a policy that reads only the keys and positions, for the packed tokens of
        many rows at once (``K [N, H, d]``, ``pos [N, H]``, row ``r`` = ``[cu[r], cu[r+1])``, its
        length ``L[r]``): ``[N, H]``. Such a policy writes only this (its formula, once);
        :meth:`score` is derived from it."""
        raise NotImplementedError(f"{type(self).__name__} scores row by row (score), not score_ragged")

    def score_paged(
        self, keys: PagedKeys, pos: torch.Tensor | PagedKeys, cu: torch.Tensor, L: torch.Tensor, layer: int
    ) -> torch.Tensor:
        """:meth:`score_ragged` of keys read where they are in the cache (the engine's in-place step:
        nothing else of the window is copied). By default the keys are gathered; a policy with a
        kernel that reads the cache itself overrides this. ``pos``: int64 ``[N, H]``, or the slot
        positions read where they are (:func:`~vllm_kvevict.kernels.torch_ops.dense_positions`)."""
        return self.score_ragged(keys.gather(), dense_positions(pos), cu, L, layer)

    def observe(self, view: KVView) -> None:
        """Update ``view.state`` with this step's tokens, in place (policies with ``Needs.state``)."""

    def merge_columns(self, x: Packed, cols: Columns) -> Merge:
        """Merging policies (``Needs.merges``): the rows' scores and new K/V (:class:`Merge`), for
        the packed tokens of many rows at once (``x``: the keys ``x.K`` and values ``x.V`` at
        ``x.tok``, the positions and per-slot state; ``cols.keep``: each row's kept count). Such
        a policy writes its rule here once; :meth:`merge` is its one row."""
        raise NotImplementedError(f"{self.name} does not merge")

    def merge(self, view: KVView, keep: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """:meth:`merge_columns` of the view's one row: the kept slots ``[H_kv, keep]`` (ascending
        per head) and their new ``(K, V)`` ``[H_kv, keep, d]`` (None: all kept, unchanged)."""
        n = view.pos.shape[1]
        if keep >= n:
            return torch.arange(n, device=view.pos.device).expand(view.num_heads, n).clone(), None
        cols = dataclasses.replace(Columns.of_view(view, 0), keep=(keep,))
        state = {k: v.T for k, v in view.state.items()}
        x = Packed(None, view.pos.T, state, view.V.transpose(0, 1), K=view.K.transpose(0, 1), layer=view.layer)
        m = self.merge_columns(x, cols)
        kept = topk_newer(m.score.T, keep, view.pos)
        at = kept[..., None].expand(-1, -1, view.K.shape[-1])
        return kept, (m.K.transpose(0, 1).gather(1, at), m.V.transpose(0, 1).gather(1, at))

    # What the engine calls; not overridden.
    @property
    def ragged(self) -> bool:
        """Whether the engine may score this policy's rows together, through :meth:`score_ragged`
        (:func:`vllm_kvevict.backends.evict.evict_step`): it reads keys and positions only."""
        n = self.needs
        return type(self).score_ragged is not Policy.score_ragged and n.queries == "none" and not (n.state or n.merges)

    def attention(self, view: KVView) -> torch.Tensor:
        """``[H_q, n]`` float32: the softmax attention each slot receives from ``view.Q``, scaled
        and soft-capped as the model does (its attention sinks in each softmax), causal by position,
        summed over the queries; query head
        ``h`` reads KV head ``h // G``. ``view.attn`` when the engine has computed it (one ragged
        :func:`~vllm_kvevict.kernels.ops.column_sums` for every row of the step); computed here
        otherwise (the transformers reference, tests), never as ``[H_q, m, n]``."""
        if view.attn is not None:
            return view.attn
        Q, q_pos = view.queries()
        dev = view.K.device
        return ops.column_sums(
            Q.transpose(0, 1),
            view.K.transpose(0, 1),
            q_pos.to(dev),
            view.pos.T,
            Ragged.of([Q.shape[1]], dev),  # a single row
            Ragged.of([view.K.shape[1]], dev),
            view.G,
            view.attn_scale,
            view.softcap,
            view.sinks,
        ).T

    def evict(self, view: KVView, keep: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Kept slot indices ``[H_kv, keep]`` (ascending per head) and, for merging policies, their
        new K/V; otherwise the top ``keep`` of :meth:`score` (ties to the newer, docs/policies.md)."""
        view.keep = keep
        if self.needs.merges:
            return self.merge(view, keep)
        return topk_newer(self.score(view), keep, view.pos), None


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
