# SPDX-License-Identifier: Apache-2.0
"""Recall tiers that travel with cached windows: what the engine core decides, what it tells the workers.

A request with recall keeps the tokens its compactions drop in a tier on each worker (host memory,
per layer; ``backends/recall.py``). Its window after a compaction point ``b`` is a function of its
first ``b`` tokens and its configuration, and so is its tier then: both are cached together, and a
request starting on that window starts with that tier, as it would have it had it computed the
prefix itself. The window's blocks live in vLLM's prefix cache (``window_cache.py``); the tier's
entries live in each worker's host memory (``backends/tier_store.py``), shared read-only by every
request that starts on them (a tier grows by appending entries, so a snapshot is a tuple of the
entries it held, and a tier started on it extends it without copying: copy-on-extend).

The engine core decides everything; the workers follow, in order, the messages it puts on each
step's ``SchedulerOutput``: :class:`Start` (a request whose windows are cached starts an attempt,
on the window under ``key`` or from scratch: the workers snapshot its tier at its compaction points
from then on), :class:`Keep` (the snapshot at a point becomes the tier of the window cached under
``key``), :class:`Forget` (a snapshot the core will not keep goes: the window was cached already,
or is not cached), :class:`End` (the attempt ended: its snapshots go), :class:`Drop` (a cached
window's tier goes). So the
core knows which windows have a tier on the workers without hearing from them: a window is hit only
with its tier. The tiers' host memory is modelled here (:class:`TierCache`: each kept tier the
entries its request added since the tier it extends), bounded by a budget, least recently used
first, and a tier whose window vLLM's LRU evicted goes when room is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class Keep:
    """The snapshot of ``request_id``'s tier at its compaction point ``point`` is the tier of the
    window cached under ``key``."""

    request_id: str
    point: int
    key: Hashable


@dataclass(frozen=True)
class Start:
    """``request_id`` starts an attempt whose windows are cached, on the window cached under
    ``key`` (its tier is that window's, shared, extended by its own compactions) or from scratch
    (``key`` None)."""

    request_id: str
    key: Hashable | None


@dataclass(frozen=True)
class Forget:
    """The snapshot of ``request_id``'s tier at ``point`` is not kept."""

    request_id: str
    point: int


@dataclass(frozen=True)
class End:
    """``request_id``'s attempt ended (finished, aborted, preempted): its snapshots not kept go."""

    request_id: str


@dataclass(frozen=True)
class Drop:
    """The tier of the window cached under ``key`` goes (the window left the cache, or room is needed)."""

    key: Hashable


Message = Keep | Start | Forget | End | Drop


@dataclass
class _Node:
    """A kept tier: the bytes its request added since ``parent`` (the node of the tier it extends,
    None: all of it), whether a window's key names it, and how many kept tiers extend it."""

    nbytes: int
    parent: int | None
    cached: bool = True
    children: int = 0


@dataclass
class _Chain:
    """What the core knows of one attempt's tier: the node of the kept tier it extends (its start,
    then its last kept snapshot; None: none) and the tokens per (layer, KV head) it held then."""

    base: int | None = None
    base_tokens: int = 0


class TierCache:
    """The engine core's view of the workers' cached tiers, in one evicting KV cache group.

    ``budget``: bytes the cached tiers may hold per worker.
    A kept tier is counted at what its request added since the tier it extends (the rest is that
    tier's, held once by every tier that extends it); a tier stays modelled while a kept tier
    extends it, as the workers hold its entries until then. A tier past its ``cap`` was merged
    on the workers (its entries are its own): counted whole."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._nodes: dict[int, _Node] = {}
        self._keys: OrderedDict[Hashable, int] = OrderedDict()  # cached key -> node, least recent first
        self._chains: dict[str, _Chain] = {}
        self._outbox: list[Message] = []
        self._next = 0
        self._pinned: set[Hashable] = set()  # found for a request in the step being scheduled
        self.nbytes = 0  # bytes of every modelled tier

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def pin(self, key: Hashable) -> bool:
        """Whether a tier is kept under ``key``; if so it stays until the step being scheduled has
        its messages (a request found it and may start on it in that step)."""
        if key not in self._keys:
            return False
        self._pinned.add(key)
        return True

    def start(self, request_id: str, key: Hashable | None, tokens: int = 0) -> None:
        """An attempt of ``request_id`` starts, on the window under ``key`` whose tier holds
        ``tokens`` per (layer, KV head) (None: from scratch)."""
        node = self._keys.get(key) if key is not None else None
        self._chains[request_id] = _Chain(node, tokens if node is not None else 0)
        if node is not None:
            self._keys.move_to_end(key)
        self._outbox.append(Start(request_id, key if node is not None else None))

    def keep(
        self,
        request_id: str,
        point: int,
        key: Hashable,
        tokens: int,
        cap: int,
        token_bytes: int,
        is_cached: Callable[[Hashable], bool],
    ) -> None:
        """The window ``request_id`` compacted at ``point`` is cached under ``key``, its tier holding
        ``tokens`` per (layer, KV head) before its ``cap``, each ``token_bytes`` on a worker (keys,
        values, position, score and per-slot state of every layer): the workers keep their snapshot
        (replacing any tier under ``key``); then, while the tiers are over the budget, tiers go,
        those whose window is no longer cached (``is_cached``) first, then the least recently used."""
        chain = self._chains.setdefault(request_id, _Chain())
        if key in self._keys:
            self._discard(key)
        parent = chain.base if chain.base in self._nodes and tokens <= cap else None
        added = min(tokens, cap) - (chain.base_tokens if parent is not None else 0)
        node = self._next
        self._next += 1
        self._nodes[node] = _Node(max(0, added) * token_bytes, parent)
        self.nbytes += self._nodes[node].nbytes
        if parent is not None:
            self._nodes[parent].children += 1
        self._keys[key] = node
        chain.base, chain.base_tokens = node, min(tokens, cap)
        self._outbox.append(Keep(request_id, point, key))
        self._fit(is_cached, key)

    def forget(self, request_id: str, point: int) -> None:
        """The window ``request_id`` compacted at ``point`` is not cached with its tier."""
        if request_id in self._chains:
            self._outbox.append(Forget(request_id, point))

    def end(self, request_id: str) -> None:
        """``request_id``'s attempt ended: the workers drop its snapshots not kept."""
        if self._chains.pop(request_id, None) is not None:
            self._outbox.append(End(request_id))

    def drop(self, key: Hashable) -> None:
        """The tier under ``key`` goes."""
        if key in self._keys:
            self._discard(key)
            self._outbox.append(Drop(key))

    def messages(self) -> list[Message]:
        """What the workers apply before the next step, in order; the outbox is empty afterwards."""
        out, self._outbox = self._outbox, []
        self._pinned.clear()
        return out

    def _fit(self, is_cached: Callable[[Hashable], bool], newest: Hashable) -> None:
        if self.nbytes <= self.budget:
            return
        for key in [k for k in self._keys if k != newest and k not in self._pinned and not is_cached(k)]:
            self.drop(key)
        for key in [k for k in self._keys if k != newest and k not in self._pinned]:
            if self.nbytes <= self.budget:
                return
            self.drop(key)
        if self.nbytes > self.budget:
            self.drop(newest)  # over the budget with what the step's requests start on

    def _discard(self, key: Hashable) -> None:
        """``key`` names no tier any more; its node goes once no kept tier extends it (and so on up)."""
        first = self._keys.pop(key)
        self._nodes[first].cached = False
        n: int | None = first
        while n is not None and not self._nodes[n].cached and self._nodes[n].children == 0:
            node = self._nodes.pop(n)
            self.nbytes -= node.nbytes
            n = node.parent
            if n is not None:
                self._nodes[n].children -= 1
