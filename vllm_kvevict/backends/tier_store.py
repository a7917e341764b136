# SPDX-License-Identifier: Apache-2.0
"""The recall tier (``recall.py`` is what recall does with it): a request's evicted tokens per
layer, as entries never written once added, merged when read; and a worker's tiers of cached
windows (the engine core's side and the design: ``tier_cache.py``).

At every compaction point below its prompt's end, a request that shares its windows and keeps a
recall tier leaves a snapshot of each layer's tier here (:meth:`TierStore.take`: the tier's entries,
shared, nothing copied). The engine core's messages, applied before each step in the order it sent
them, decide what becomes of them: kept under the key of the window cached at that point, handed to
a request that starts on that window, dropped. The worker never decides: the core hits a window
only with its tier, so both must agree on which tiers exist.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from vllm_kvevict._logging import logger
from vllm_kvevict.kernels import ops
from vllm_kvevict.kernels.torch_ops import Ragged
from vllm_kvevict.tier_cache import Drop, End, Forget, Keep, Message, Start


@dataclass
class TierEntry:
    """One request's evicted tokens in one layer: ``[n, H, ...]`` (each KV head its own tokens)."""

    K: torch.Tensor
    V: torch.Tensor
    pos: torch.Tensor  # [n, H] int64
    score: torch.Tensor  # [n, H] float32: the policy's score when they were dropped (-inf: none)
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # per-slot policy state, [n, H]
    copy: Any = None  # a GPU server: the event its device-to-host copy completes (None: ready)

    @property
    def tokens(self) -> int:
        return int(self.pos.shape[0])

    def tensors(self) -> list[torch.Tensor]:
        return [self.K, self.V, self.pos, self.score, *self.state.values()]

    def map(self, fn) -> TierEntry:
        """The same tokens with ``fn`` applied to every tensor (K, V, positions, scores, state)."""
        return TierEntry(
            fn(self.K), fn(self.V), fn(self.pos), fn(self.score), {k: fn(v) for k, v in self.state.items()}
        )


class Tier:
    """One request's tier in one layer (kept in its :class:`~vllm_kvevict.request.LayerState`): the
    entries its compactions dropped, in order, each never written once added (on a GPU the newest
    may still be in flight to host memory). They are merged only when the tier exceeds its ``cap``
    (its best kept) and read as they are (:meth:`parts`, :meth:`take`); until then a :meth:`snapshot` shares
    them with the tier it was taken of, and a tier started on a snapshot (:meth:`of`) extends it
    without copying it (copy-on-extend)."""

    def __init__(self) -> None:
        self.chunks: list[TierEntry] = []
        self.cap = 0

    @classmethod
    def of(cls, snapshot: tuple[TierEntry, ...], cap: int) -> Tier:
        """A tier holding ``snapshot``'s entries (shared, never written), extended by later adds."""
        t = cls()
        t.chunks, t.cap = list(snapshot), cap
        return t

    def snapshot(self) -> tuple[TierEntry, ...]:
        """The tier as it is now, read-only: its entries, shared (nothing copied)."""
        return tuple(self.chunks)

    def add(self, new: TierEntry, cap: int) -> None:
        """Append ``new``; over ``cap`` tokens per KV head, keep the ``cap`` best-scored. Tokens on a
        GPU are copied to pinned host memory without waiting; that copy is waited for when the tier
        is next merged (by then the step that issued it has long finished)."""
        if new.K.device.type != "cpu":
            new = _to_host(new)
        self.cap = cap
        self.chunks = [c for c in (*self.chunks, new) if c.tokens]
        if self.tokens <= cap:
            return
        last = self.chunks[-1]
        if last.copy is not None and not last.copy.query():
            merged, pending = merge_entries(self.chunks[:-1], cap), [last]
        else:
            merged, pending = merge_entries(self.chunks, cap), []
        self.chunks = [c for c in (merged, *pending) if c is not None and c.tokens]

    def parts(self, device: torch.device | str | None = None) -> list[TierEntry]:
        """The whole tier as its entries (copies in flight waited for; merged only over ``cap``,
        which :meth:`add` allows no longer than a copy is in flight), on ``device`` (copied back
        from pinned memory asynchronously); the tier keeps them. What reads every token (recall's
        scoring and attention) concatenates them with the window itself, once, rather than
        merging a cached window's snapshot first."""
        if self.tokens > self.cap:
            merged = merge_entries(self.chunks, self.cap)
            self.chunks = [] if merged is None else [merged]
        for c in self.chunks:
            if c.copy is not None:
                c.copy.synchronize()
                c.copy = None
        return [c if device is None else on_device(c, device) for c in self.chunks if c.tokens]

    def take(self, device: torch.device | str | None = None) -> list[TierEntry]:
        """:meth:`parts`, the tier empty afterwards."""
        out = self.parts(device)
        self.chunks = []
        return out

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for c in self.chunks for t in c.tensors())


def _to_host(e: TierEntry) -> TierEntry:
    """``e`` copied into pinned host memory, ordered on the current stream; ``copy`` is the event
    that says it has landed."""

    def pin(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

    out = e.map(pin)
    out.copy = torch.cuda.Event()
    out.copy.record()
    return out


def merge_entries(chunks: list[TierEntry], cap: int) -> TierEntry | None:
    """The chunks as one entry (their copies waited for), the ``cap`` best per KV head."""
    if not chunks:
        return None
    for c in chunks:
        if c.copy is not None:
            c.copy.synchronize()
            c.copy = None
    if len(chunks) == 1:
        e = chunks[0]
    else:
        keys = [k for k in chunks[0].state if all(k in c.state for c in chunks)]
        K, V, pos, score = (torch.cat([getattr(c, f) for c in chunks]) for f in ("K", "V", "pos", "score"))
        e = TierEntry(K, V, pos, score, {k: torch.cat([c.state[k] for c in chunks]) for k in keys})
    return best_entries(e, cap) if e.tokens > cap else e


def on_device(e: TierEntry, device) -> TierEntry:
    """``e`` on ``device``: from a GPU's host memory through pinned memory, copied without waiting."""
    if torch.device(device).type == "cpu":
        return e
    return e.map(lambda t: (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True))


def best_entries(e: TierEntry, cap: int) -> TierEntry:
    """The ``cap`` highest-scored tokens of each KV head (ties: the newer), in position order."""
    idx, _ = ops.select_topk(e.score, e.pos, Ragged.of([e.tokens], e.pos.device), [cap])
    h = torch.arange(e.pos.shape[1], device=e.pos.device)[None, :]
    return e.map(lambda t: t[idx, h])


class Candidates:
    """Entries (a window's tokens, then a tier's) as one set of candidates ``[n, H]``, indexed in
    that order: their keys and positions concatenated once, for scoring; values, scores and state
    read only for the candidates picked (:meth:`pick`)."""

    def __init__(self, parts: list[TierEntry]) -> None:
        self.parts = [p for p in parts if p.tokens]
        self.K = torch.cat([p.K for p in self.parts])
        self.pos = torch.cat([p.pos for p in self.parts])

    @property
    def tokens(self) -> int:
        return int(self.pos.shape[0])

    def pick(self, idx: torch.Tensor, score: torch.Tensor) -> TierEntry:
        """The candidates at ``idx [k, H]`` (each KV head its own) as an entry, scored by
        ``score [n, H]``; the state keys of the first part (a part without one gives zeros)."""
        h = torch.arange(idx.shape[1], device=idx.device)[None, :]
        first = self.parts[0]
        state = {k: self._rows([p.state.get(k) for p in self.parts], idx, h) for k in first.state}
        return TierEntry(
            self.K[idx, h], self._rows([p.V for p in self.parts], idx, h), self.pos[idx, h], score[idx, h], state
        )

    def _rows(self, tensors: list[torch.Tensor | None], idx: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``tensors`` (one per part, ``[n_part, H, ...]``; None: zeros) at the candidates ``idx``."""
        like = tensors[0]
        assert like is not None
        out = like.new_zeros((*idx.shape, *like.shape[2:]))
        start = 0
        for t, p in zip(tensors, self.parts):
            n = p.tokens
            if t is not None:
                inside = ((idx >= start) & (idx < start + n)).view(*idx.shape, *[1] * (out.dim() - 2))
                out = torch.where(inside, t[(idx - start).clamp(0, n - 1), h].to(out.dtype), out)
            start += n
        return out


class LayerSnapshot(NamedTuple):
    """One layer's tier of a request at a compaction point: its entries, and the request's latest
    queries recall scores by (``[H_q, <= window, d]``; None: none kept), with which a request
    starting on the window there has seen what it would have seen had it computed the prefix."""

    entries: tuple[TierEntry, ...]
    queries: torch.Tensor | None = None


#: One request's tier at one point: per layer (its key in a request's state), its snapshot.
Snapshot = dict[Hashable, LayerSnapshot]


class TierStore:
    """Snapshots taken at compaction points (per request and point) and the tiers of cached windows
    (per key), with the tiers requests start on in the step being built."""

    def __init__(self) -> None:
        self._taken: dict[tuple[str, int], Snapshot] = {}
        self._cached: dict[Hashable, Snapshot] = {}
        self._starts: dict[str, Snapshot] = {}
        self._snapshotting: set[str] = set()  # requests whose attempt the core started (Start)
        self._lost: set[str] = set()  # requests started on a tier this worker does not hold
        self._refs: dict[int, list[int]] = {}  # id of a cached tier's entry -> [tiers holding it, bytes]
        self.nbytes = 0  # host memory the cached tiers hold (an entry several share counted once)

    def take(
        self,
        request_id: str,
        point: int,
        layer: Hashable,
        entries: tuple[TierEntry, ...],
        queries: torch.Tensor | None = None,
    ) -> None:
        """One layer's tier of ``request_id`` right after its compaction at ``point``, with its latest
        queries (kept only for a request whose windows the engine core caches: it started the
        attempt with a Start); the queries copied (a view of a layer's renewed windows would hold
        every request's)."""
        if request_id in self._snapshotting:
            own = None if queries is None else queries.clone()
            self._taken.setdefault((request_id, point), {})[layer] = LayerSnapshot(entries, own)

    def apply(self, messages: Iterable[Message]) -> None:
        """The engine core's messages for the step about to be built, in order."""
        for m in messages:
            if isinstance(m, Keep):
                snap = self._taken.pop((m.request_id, m.point), None)
                self._uncache(m.key)
                if snap is None:  # pragma: no cover - the core keeps only what a step has taken
                    logger.warning("kvevict: no recall tier taken for request %s at %d", m.request_id, m.point)
                else:
                    self._cache(m.key, snap)
            elif isinstance(m, Start):
                self._start(m)
            elif isinstance(m, Forget):
                self._taken.pop((m.request_id, m.point), None)
            elif isinstance(m, End):
                self._forget(m.request_id)
            elif isinstance(m, Drop):
                self._uncache(m.key)

    def _start(self, m: Start) -> None:
        self._forget(m.request_id)  # what an earlier attempt took
        self._snapshotting.add(m.request_id)
        if m.key is None:
            return
        snap = self._cached.get(m.key)
        if snap is None:  # the core starts requests only on kept tiers: never, unless the two disagree
            self._lost.add(m.request_id)
        else:
            self._starts[m.request_id] = snap

    def lost(self, request_id: str) -> bool:
        """Whether ``request_id`` was started on a tier this worker does not hold (asked once, with
        :meth:`started`): it cannot compute what it would alone, and falls back."""
        if request_id not in self._lost:
            return False
        self._lost.discard(request_id)
        return True

    def _forget(self, request_id: str) -> None:
        self._starts.pop(request_id, None)
        self._lost.discard(request_id)
        self._snapshotting.discard(request_id)
        for k in [k for k in self._taken if k[0] == request_id]:
            del self._taken[k]

    def _cache(self, key: Hashable, snap: Snapshot) -> None:
        self._cached[key] = snap
        for layer in snap.values():  # the queries (a few KiB a layer) are not counted
            for e in layer.entries:
                ref = self._refs.setdefault(id(e), [0, sum(t.nbytes for t in e.tensors())])
                ref[0] += 1
                self.nbytes += ref[1] if ref[0] == 1 else 0

    def _uncache(self, key: Hashable) -> None:
        for layer in self._cached.pop(key, {}).values():
            for e in layer.entries:
                ref = self._refs[id(e)]
                ref[0] -= 1
                if ref[0] == 0:
                    del self._refs[id(e)]
                    self.nbytes -= ref[1]

    def started(self, request_id: str) -> Snapshot | None:
        """The tier ``request_id`` starts its attempt on (None: from scratch); asked once, when the
        attempt's first step is planned."""
        return self._starts.pop(request_id, None)

    def retain(self, live: frozenset[str] | set[str]) -> None:
        """Forget what requests the model runner no longer holds took or were to start on (after
        this step's messages: a window cached as a request is freed is kept before it goes)."""
        for rid in {k[0] for k in self._taken} | set(self._starts) | self._snapshotting | self._lost:
            if rid not in live:
                self._forget(rid)

    def __len__(self) -> int:
        return len(self._cached)


#: This worker process's store (every layer and request).
TIERS = TierStore()
