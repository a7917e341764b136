# SPDX-License-Identifier: Apache-2.0
"""The manager of :class:`~vllm_kvevict.spec.KVEvictSpec` layers: free the leading blocks the window has left behind.

vLLM's classes come through :mod:`vllm_kvevict.vllm_compat.kv_cache`. The worker's backend turns each plain ``FullAttentionSpec`` into a
``KVEvictSpec`` (``AttentionBackend.customize_spec``); the spec is pickled to the engine core,
where the registry maps it to :class:`KVEvictManager`. The manager is a ``FullAttentionManager``
whose ``remove_skipped_blocks`` (called from ``KVCacheManager.allocate_slots`` with the number of
*processed* tokens every time the request is scheduled) nulls and frees logical blocks
``[0, E / block_size)`` with ``E = evicted_tokens(...)``, exactly as sliding-window attention does.

Prefix caching (docs/architecture.md, "Prefix caching"): a block enters vLLM's prefix cache only
when its KV is what its hash says and will never be rewritten. Whether that holds is decided from
the schedule, never from what the engine core later sees of a step: for every step the scheduler
schedules, ``allocate_slots`` tells the manager the tokens the workers will have computed after it
(:meth:`KVEvictManager.scheduled`), so the core knows the ``E`` every step reaches. The first step
scheduled with ``E > 0`` fences the attempt at ``E1``: blocks ``[0, E1)`` (computed before anything
was evicted, never written by a compaction) are hashed then; no block at or after ``E1`` is ever
hashed. A request freed before any scheduled step compacts hashes every full block it computed.
This holds whatever happens between a step and the core's next look at the request (it finishes,
is aborted or preempted, or sits out rounds; async scheduling). A prefix-cache hit is held
read-only, and only up to the ``E`` of its first compaction (``window.pure_hit_limit``), which
frees it: the request computes what it would have computed without the hit.

Compressed windows (docs/architecture.md, "Compressed windows"): the window a request holds after
each compaction point is cached once that step has run, with the blocks it computes after it
(tails); the blocks a compaction rewrites are copied aside before it and cached, and a request
that starts on such blocks gets its own copies (vLLM's copy-on-write, ``kv_cache_block_copies``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from vllm_kvevict import metrics
from vllm_kvevict._logging import logger
from vllm_kvevict.request import ENGINE, RequestSettings, RequestState, resolve
from vllm_kvevict.spec import KVEvictSpec
from vllm_kvevict.tier_cache import TierCache
from vllm_kvevict.vllm_compat import kv_cache as vllm_kv_cache
from vllm_kvevict.vllm_compat.kv_cache import FullAttentionManager, KVCacheBlock, RequestStatus
from vllm_kvevict.window import (
    WindowConfig,
    copy_range,
    draft_cut,
    evicted_tokens,
    first_boundary,
    last_boundary,
    next_point,
    prompt_tail,
    pure_hit_limit,
    settle_limit,
    step_limit,
    window_bound_blocks,
)
from vllm_kvevict.window_cache import WindowCache


@dataclass
class _Attempt:
    """The engine core's record of one attempt of a request (from its first allocation to its free)."""

    nulled: int = 0  # leading blocks nulled and freed by ``remove_skipped_blocks``
    peak: int = 0  # most blocks held at once
    #: ``E`` the workers reach after the last step scheduled for the request (from the schedule)
    scheduled_e: int = 0
    #: ``E1``, the first compaction point scheduled in this attempt: no block at or after it is
    #: ever hashed as a pure block (None while no scheduled step compacts)
    fence: int | None = None
    #: ``(E1, L1)``: the pure blocks below ``E1`` that the step reaching ``L1`` computes, hashed
    #: once that step has run (vLLM's priority scheduling may still take the step back)
    pure_pending: tuple[int, int] | None = None
    #: compaction points scheduled whose windows wait to be cached (once their step has run)
    windows: list[int] = field(default_factory=list)
    #: tokens up to which the blocks computed after compaction points (tails) have been cached
    tails_done: int = 0
    #: copies of blocks a compaction (or recall) in a scheduled step rewrites, waiting for the
    #: core to see their blocks processed (at once when it has): ``(the point they follow, first
    #: token of the block, the copy)`` (the manager holds one reference to each copy)
    saves: list[tuple[int, int, KVCacheBlock]] = field(default_factory=list)
    #: a waiting request has waited for this one's windows (:meth:`KVEvictManager.waits_for_window`):
    #: its compactions copy aside the blocks they rewrite (nobody else is known to want them)
    awaited: bool = False
    #: recall: the copies of the window at each compaction point, made before the next step (the
    #: step completing the prompt rewrites the window in place), cached once the core has seen
    #: the point's step run (at once when it has)
    window_copies: dict[int, list[KVCacheBlock]] = field(default_factory=dict)


class KVEvictManager(FullAttentionManager):
    """Frees the blocks of evicted tokens as soon as the processed-token count crosses a trigger,
    and hashes for vLLM's prefix cache only what no compaction can have written (see the module
    docstring and docs/architecture.md, "Prefix caching")."""

    kv_cache_spec: KVEvictSpec  # vLLM's attribute, always this plugin's spec here

    def __init__(self, kv_cache_spec: KVEvictSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        # vLLM 0.32 passes the admission cap only to its own recycling specs; set ours the same way.
        if self.max_admission_blocks_per_request is None:
            self.max_admission_blocks_per_request = kv_cache_spec.max_admission_blocks_per_request()
        self._attempts: dict[str, _Attempt] = {}
        #: Peak of blocks in use in the whole pool (vLLM's free-block count), since start.
        self.pool_peak_used = 0
        #: whether blocks are copied (hits that a compaction would rewrite, blocks it rewrites):
        #: prefix caching on, one KV cache group, vLLM's hash blocks the size of its blocks
        self.copies = False
        #: ids of the blocks hashed as pure in the step being scheduled (perhaps computed in it: no
        #: copy, which runs before the step, may read them)
        self._fresh: set[int] = set()
        #: requests that made copies aside in the step being scheduled: the tokens they had processed
        self._settle: dict[str, int] = {}
        #: requests that evict: request id -> (blocks held, window bound), for the gauges
        self._windows: dict[str, tuple[int, int]] = {}
        self.window_cache = WindowCache(
            self.block_pool, self.block_size, self.kv_cache_group_id, kv_cache_spec.evict_hash_algo
        )
        #: recall tiers of cached windows, on the workers (half of their host budget at most)
        self.tiers = TierCache(kv_cache_spec.config.recall.host_bytes // 2)
        # One manager per process records (a model with several kvevict KV cache groups has one
        # manager per group, all moving the same windows).
        global _metrics_owner
        self._metrics = metrics.recorder("core") if _metrics_owner is None else None
        _metrics_owner = _metrics_owner or self

    def _held(self, request_id: str) -> int:
        # The nulled blocks are exactly a prefix of vLLM's block list (the evicted window start).
        att = self._attempts.get(request_id)
        return len(self.req_to_blocks.get(request_id, ())) - (att.nulled if att else 0)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        hit = len(self.req_to_blocks.get(request_id, ())) * self.block_size  # at its first: the hit
        new = super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        att = self._attempts.get(request_id)
        if att is None:  # the first allocation of an attempt
            lo, hi = self._hit_copies(request_id, hit)
            for i in range(lo // self.block_size, hi // self.block_size):
                vllm_kv_cache.copy_on_write(self, request_id, i)  # reserved by get_num_blocks_to_allocate
            att = self._attempts[request_id] = self._new_attempt(request_id)
            self._count_hit(request_id)
            self._start_tier(request_id)
        att.peak = max(att.peak, self._held(request_id))
        pool = self.block_pool
        self.pool_peak_used = max(self.pool_peak_used, pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
        self._track_window(request_id)
        return new

    def _start_tier(self, request_id: str) -> None:
        """A recall request whose windows are cached starts its attempt, on a cached window's
        tier (``tier_cache.Start``) or from scratch."""
        st = ENGINE.get(request_id)
        if st is None or st.request is None or not self._shares_tiers(st):
            return
        b, prompt = last_boundary(st.window_hit, st.settings.window), st.request.num_prompt_tokens
        key = self.window_cache.tier_key(st.request, st.settings, b) if b else None
        self.tiers.start(request_id, key, evicted_tokens(b, prompt, st.settings.window) if b else 0)

    def _copy_windows(self, request, st: RequestState, att: _Attempt, start: int) -> None:
        """With recall, the step completing the prompt re-selects the window before it in place, so
        that window is cached as a copy, never as the request's own blocks: copied aside before
        the step after its point (``start`` tokens), before that step's forward (no copy when the
        pool has no room to spare: that window is not cached). Cached, and so back in the pool's
        LRU, as that step's scheduling ends when the core has seen the point's step run
        (:meth:`take_pending_cow_copies`): a copy is not held beside the window it copies while
        the step runs."""
        bs, window = self.block_size, st.settings.window
        blocks = self.req_to_blocks.get(request.request_id, [])
        for b in att.windows:
            if b > start or b in att.window_copies or not self._copied_window(st, b):
                continue
            todo = blocks[evicted_tokens(b, request.num_prompt_tokens, window) // bs : b // bs]
            room = self._room_to_copy(len(todo))
            att.window_copies[b] = [vllm_kv_cache.copy_aside(self, blk) for blk in todo] if room else []

    def _room_to_copy(self, n: int) -> bool:
        """Whether the pool has room to spare for ``n`` copies aside: after them, at least as many
        free blocks and an eighth of the pool."""
        pool = self.block_pool
        return pool.get_num_free_blocks() - n >= max(n, pool.num_gpu_blocks // 8)

    def _hit_copies(self, request_id: str, hit: int) -> tuple[int, int]:
        """The tokens ``[lo, hi)`` of a request's ``hit``-token prefix-cache hit that it copies
        before its first step, because its next compaction rewrites them (``window.copy_range``;
        the lookup stopped the hit before any block computed in the step being scheduled), or with
        recall the step completing its prompt does (a cached window it starts on and its tail, whole,
        when its prompt ends before its next compaction moves past the window)."""
        st = ENGINE.get(request_id)
        if not self.copies or st is None or st.request is None or hit <= 0:
            return (0, 0)
        prompt, window = st.request.num_prompt_tokens, st.settings.window
        b = last_boundary(hit, window)
        if st.settings.recall.enabled and st.window_hit and prompt <= b + window.step:
            return (evicted_tokens(b, prompt, window), hit)  # the step completing its prompt rewrites them
        if not st.settings.shares_tails:
            return (0, 0)
        return copy_range(hit, prompt, prompt + st.request.max_tokens, window)

    def _new_attempt(self, request_id: str) -> _Attempt:
        """A request that starts on a cached window at ``b`` starts with ``E(b)`` evicted: its
        leading blocks are null, nothing of it is pure (it caches no pure block)."""
        st = ENGINE.get(request_id)
        if st is None or not st.window_hit or st.request is None:
            return _Attempt()
        e = evicted_tokens(st.window_hit, st.request.num_prompt_tokens, st.settings.window)
        return _Attempt(nulled=e // self.block_size, scheduled_e=e, fence=0)

    def _count_hit(self, request_id: str) -> None:
        st = ENGINE.get(request_id)
        if self._metrics is None or st is None or st.shared <= 0 or not st.settings.evicts:
            return
        kind = "compressed_hit" if st.window_hit else "prefix_hit"
        self._metrics.inc(f"{kind}s", st.settings.policy_name)
        self._metrics.inc(f"{kind}_tokens", st.settings.policy_name, st.shared)

    def state_of(self, request) -> RequestState:
        """The request's state in the engine core, its settings resolved the first time it is seen."""
        return ENGINE.open(
            request.request_id,
            lambda: resolve(self.kv_cache_spec.config, vllm_kv_cache.request_extra_args(request), self.block_size),
        )

    def settings_for(self, request_id: str) -> RequestSettings | None:
        st = ENGINE.get(request_id)
        return st.settings if st is not None else None

    def _track_window(self, request_id: str, gone: bool = False) -> None:
        """Keep the gauges of blocks held by requests with a bounded window, and of their bounds, current."""
        if self._metrics is None:
            return
        settings = None if gone else self.settings_for(request_id)
        bound = settings.admission_blocks(*self.kv_cache_spec.in_flight) if settings is not None else None
        if bound is None:  # gone, or its window is not bounded (eviction off, once, no decode-time eviction)
            if self._windows.pop(request_id, None) is None:
                return
        else:
            self._windows[request_id] = (self._held(request_id), bound)
        self._metrics.set("window_blocks_held", sum(h for h, _ in self._windows.values()))
        self._metrics.set("window_blocks_bound", sum(b for _, b in self._windows.values()))

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks,
        total_computed_tokens: int,
        *args,
        apply_admission_cap: bool = False,
        **kwargs,
    ) -> int:
        """vLLM's count, with the admission cap of the request's *own* window: its bound when it
        evicts in ``chunked`` mode, none (the whole sequence must fit) when a per-request override
        turns eviction off, chooses a ``once`` policy or a larger budget. (The API refuses a
        request whose peak exceeds the whole pool, so every admitted request can finish alone.)
        At an attempt's first allocation, plus the copies of its hit (:meth:`_hit_copies`)."""
        copies = 0
        if request_id not in self._attempts:
            lo, hi = self._hit_copies(request_id, total_computed_tokens)
            copies = (hi - lo) // self.block_size
        if apply_admission_cap:
            st = ENGINE.get(request_id)
            cap = (
                st.settings.admission_blocks(*self.kv_cache_spec.in_flight)
                if st is not None
                else self.max_admission_blocks_per_request
            )
            if cap is not None:
                # vLLM 0.32/0.33 cap the blocks a request reserves at min(cdiv(num_tokens, block),
                # cap): the same count from tokens capped at the request's own cap, with vLLM's
                # server-wide cap left out
                num_tokens = min(num_tokens, cap * self.block_size)
        blocks = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens, *args, **kwargs
        )
        return blocks + copies

    def scheduled(self, request, start: int, num_tokens: int) -> None:
        """The scheduler has scheduled a step after which the workers will have computed
        ``num_tokens`` of the request's tokens (``start`` before it); they compact in it when its ``E`` exceeds the last
        scheduled step's (the same pure function, on the same integers, as on the workers:
        ``backends/plan.py``). Decided here, from the schedule, never from what the core later
        sees of the step: the request may finish, be aborted or preempted, or sit out rounds
        before the core hears of its processed tokens again.

        The first compaction point ``E1`` of the attempt fences the prefix cache: blocks ``[0, E1)``
        were computed with nothing evicted and no compaction ever writes them (every compaction
        writes ``[E, L)`` with ``E >= E1``), so they are hashed now, those this step computes once
        it has run (vLLM's priority scheduling may preempt a request it has already scheduled in
        the step being built, which then never runs); no block at or after ``E1`` is
        ever hashed in this attempt (the first compaction rewrites ``[E1, L1)``, and everything
        computed after it attended to a window), except the copies of the blocks it rewrites
        (:meth:`_save`)."""
        rid = request.request_id
        st = ENGINE.get(rid)
        att = self._attempts.get(rid)
        if st is None or not st.settings.evicts or att is None:
            return
        if self._caches_windows(st):
            self._copy_windows(request, st, att, start)
            self._save_prompt_tail(request, st.settings, att, start, num_tokens)
        self._compacts(request, st, att, start, num_tokens)
        if att.window_copies or att.saves:  # cached as the scheduling of this step ends
            self._settle[rid] = vllm_kv_cache.processed_tokens(request)

    def _compacts(self, request, st: RequestState, att: _Attempt, start: int, num_tokens: int) -> None:
        """The step just scheduled (``[start, num_tokens)``) compacts when its ``E`` exceeds the last
        scheduled step's: the fence, the window it caches and the copies at its point."""
        e = evicted_tokens(num_tokens, request.num_prompt_tokens, st.settings.window)
        if e <= att.scheduled_e:
            return
        if att.fence is None:
            att.fence = e
            self._cache_pure(request, min(e, start))  # computed in earlier steps
            if start < e:
                att.pure_pending = (e, num_tokens)
        prompt = request.num_prompt_tokens
        if (
            self._caches_windows(st)
            and num_tokens % st.settings.window.step == 0
            and st.settings.caches_window_at(num_tokens, prompt)
        ):
            att.windows.append(num_tokens)  # cached once the step has run (remove_skipped_blocks, free)
            if self.copies and st.settings.shares_tails:
                self._save(request, st.settings, att, start, num_tokens)
        if self._metrics is not None:  # one compaction on the workers, in the step just scheduled
            policy, freed = st.settings.policy_name, (e - att.scheduled_e) // self.block_size
            self._metrics.inc("blocks_freed", policy, freed)
            self._metrics.inc("tokens_evicted", policy, freed * self.block_size)
            self._metrics.inc("compactions", policy)
        att.scheduled_e = e

    def _caches_windows(self, st: RequestState) -> bool:
        """Whether what the request compacts is cached for others: it shares its windows and no
        worker has replaced its policy (a window the safe policy kept is not what its
        configuration computes, and its per-slot state was never snapshotted)."""
        shares = st.settings.shares_windows and (self.copies or not st.settings.recall.enabled)
        return self.enable_caching and shares and st.fell_back_from is None

    def _shares_tiers(self, st: RequestState) -> bool:
        """Whether the request's windows are cached with their recall tiers."""
        return st.settings.recall.enabled and self._caches_windows(st)

    @staticmethod
    def _copied_window(st: RequestState, b: int) -> bool:
        """Whether the request's window at ``b`` is cached as a copy: with recall, the window at the
        last point before the prompt's end, which the step completing the prompt re-selects."""
        return (
            st.settings.recall.enabled
            and st.request is not None
            and st.request.num_prompt_tokens <= b + st.settings.window.step
        )

    @staticmethod
    def _recalls(st: RequestState, scheduled: int) -> bool:
        """Whether a step completing the request's prompt, which with recall re-selects the window
        and its tail in place, is among its first ``scheduled`` tokens."""
        return st.settings.recall.enabled and st.request is not None and scheduled >= st.request.num_prompt_tokens

    def fell_back(self, request_id: str) -> None:
        """A worker replaced the request's policy by the safe policy in a step whose results the
        core has not yet seen: nothing of the request is cached from now on (its windows, tails and
        copies; it keeps the safe policy for life, on every rank), and the copies it holds aside
        go back uncached. Its pure blocks stay: they were computed before anything was evicted."""
        att = self._attempts.get(request_id)
        if att is None:
            return
        att.windows.clear()
        if att.saves:
            self.block_pool.free_blocks([blk for *_, blk in att.saves])
            att.saves = []
        self._let_go(att, list(att.window_copies))
        self.tiers.end(request_id)  # its tier snapshots: none will be kept

    def _save(self, request, settings: RequestSettings, att: _Attempt, start: int, p: int) -> None:
        """Copy aside the request's blocks that its compaction at ``p``, in the step just scheduled,
        rewrites: ``[E(p), min(start, hit_end(p)))`` (the scheduler ends the step before at
        ``hit_end`` when it expects the copies: ``window.step_limit``, :meth:`step_tokens`),
        computed in earlier steps, the workers copying them before this step's forward. Each copy
        is cached once the core has seen the step that computed its block (:meth:`_cache_saves`:
        at once when that step has run) as a tail of the window before
        ``p`` (a pure block before the first compaction), so a later request with this prefix
        starts past them. Only when :meth:`_copies_at` says so."""
        if not self._copies_at(request, settings, att, p):
            return
        e = evicted_tokens(p, request.num_prompt_tokens, settings.window)
        self._copy_aside(request, settings, att, p - settings.window.step, e, min(start, settings.hit_end(p)))

    def _copies_at(self, request, settings: RequestSettings, att: _Attempt | None, p: int) -> bool:
        """Whether the request copies aside what its compaction at ``p`` rewrites. Not unless the
        configuration says ``copy_rewritten: always`` or a request has waited for this one's
        windows (``awaited``): a copy takes a block beside the window at its fullest while the
        step is scheduled (under asynchronous scheduling until the core has seen what it copies
        computed) and costs the workers a copy, and a
        conversation's next turn never reads one (it starts on the last window and tail), so by
        default only a prefix others are known to share pays for it (and the step cut before the
        copies with it). With recall, also at the last point before the prompt's end when no tail
        follows it (:meth:`_recall_saves`)."""
        return (
            settings.config.copy_rewritten == "always"
            or (att is not None and att.awaited)
            or self._recall_saves(request, settings, p)
        )

    def _recall_saves(self, request, settings: RequestSettings, p: int) -> bool:
        """Whether a recall request copies aside what its compaction at ``p`` rewrites, whoever
        waits: at its last point before the prompt's end, when its prompt ends too soon after it
        for a tail (``window.prompt_tail``), i.e. its own question likely runs across ``p``, and it
        computed the stride before ``p`` itself (started on no hit past ``p - stride``). A request
        with its document but another question then shares no window at ``p`` (that window's key
        covers this request's question): it starts on the window before ``p`` and, without the
        copies, would compute the stride before ``p`` again, each chunk over the tier. One that
        started past ``p - stride`` would copy its own question's first blocks alone, which no
        other request shares, for a step more."""
        prompt, window = request.num_prompt_tokens, settings.window
        return (
            settings.recall.enabled
            and p < prompt <= p + window.step
            and prompt_tail(prompt, window, settings.recall.window) is None
            and self.state_of(request).shared <= p - window.step
        )

    def _save_prompt_tail(self, request, settings: RequestSettings, att: _Attempt, start: int, end: int) -> None:
        """With recall, when the step just scheduled (``[start, end)``) completes the prompt, which
        re-selects the window and its tail in place: copy aside the blocks computed after the last
        point ``b`` in earlier steps (``window.prompt_tail``: ``step_limit`` ends the step before
        there), cached as the tail of the window at ``b`` (:meth:`_cache_saves`). The next turn of
        a chat, whose prompt repeats this one's, starts on them."""
        prompt = request.num_prompt_tokens
        if not (self.copies and settings.shares_tails and settings.recall.enabled and start < prompt <= end):
            return
        tail = prompt_tail(prompt, settings.window, settings.recall.window)
        if tail is not None:
            self._copy_aside(request, settings, att, tail[0], tail[0], start)

    def _copy_aside(self, request, settings: RequestSettings, att: _Attempt, b: int, lo: int, hi: int):
        """Copy aside the request's whole blocks in ``[lo, hi)``, computed after point ``b`` in
        steps before the one just scheduled, which rewrites them; each cached once the core has
        seen the step that computed its block (:meth:`_cache_saves`). Blocks whose key is cached already (what
        the request itself started on) are not copied; nothing is when the pool has no room to
        spare."""
        bs, pool = self.block_size, self.block_pool
        blocks = self.req_to_blocks.get(request.request_id, [])
        todo = []
        for i in range(lo, min(hi // bs * bs, len(blocks) * bs), bs):
            blk = blocks[i // bs]
            if blk.is_null or blk.block_hash is not None:
                continue
            key = self.window_cache.save_key(request, settings, b, i)
            if key is not None and vllm_kv_cache.cached_block(pool, key) is not None:
                continue
            todo.append((i, blk))
        if not todo or not self._room_to_copy(len(todo)):
            return
        for i, blk in todo:
            att.saves.append((b, i, vllm_kv_cache.copy_aside(self, blk)))

    def _cache_saves(self, request, settings: RequestSettings, att: _Attempt, processed: int) -> None:
        """Cache the copies whose blocks' tokens the core has seen processed (``processed``) and
        let go of them: the pool's LRU evicts them as any cached block. Their content is final: the
        workers copy before the forward of the step that rewrites the originals, and a request
        that hits one reads it in a later step (:meth:`take_pending_cow_copies`). (The attempt's
        end lets go of the others uncached.)"""
        bs = self.block_size
        ready = [s for s in att.saves if s[1] + bs <= processed]
        if not ready:
            return
        att.saves = [s for s in att.saves if s[1] + bs > processed]
        for b, i, blk in ready:
            key = self.window_cache.save_key(request, settings, b, i)
            if key is not None:
                vllm_kv_cache.cache_block(self.block_pool, key, blk)
        self.block_pool.free_blocks([blk for *_, blk in ready])

    def take_pending_cow_copies(self):
        """vLLM drains the step's copies once it has scheduled everything: a new step begins. The
        copies made aside in it whose content the core has seen computed are cached now (in the
        pool's LRU once the scheduler lets go of them), not when the step has run: no request
        scheduled in this step hit them (nothing copies a block being copied), and any later one
        reads them after the workers have copied them."""
        self._fresh.clear()
        for rid, processed in self._settle.items():
            if (att := self._attempts.get(rid)) is not None:
                self._cache_windows(rid, att, processed)
        self._settle.clear()
        return super().take_pending_cow_copies()

    def pop_blocks_for_free(self, request_id: str):
        """vLLM's deferred free (``Scheduler._free_request_blocks`` hands the blocks back after an
        in-flight step): the request's bookkeeping ends here."""
        blocks, att = self._release(request_id)
        if att is not None:
            self._log_release(request_id, att)
        return blocks

    def free(self, request_id: str) -> None:
        """vLLM's free: the blocks go back to the pool now (tail first, as vLLM 0.32/0.33's
        ``SingleTypeKVCacheManager.free``), then the release line counts them free."""
        blocks, att = self._release(request_id)
        self.block_pool.free_blocks(reversed(blocks))
        if att is not None:
            self._log_release(request_id, att)

    def _release(self, request_id: str) -> tuple[list, _Attempt | None]:
        """End the request's attempt: its last tail cached, its copies whose step had not run
        freed uncached, its gauges dropped; returns vLLM's blocks for it and its attempt."""
        self._cache_at_free(request_id)
        blocks = super().pop_blocks_for_free(request_id)
        att = self._attempts.pop(request_id, None)
        if att is not None and att.saves:  # copies whose step had not run: not cached
            self.block_pool.free_blocks([blk for *_, blk in att.saves])
        if att is not None:
            self._let_go(att, list(att.window_copies))
        self.tiers.end(request_id)
        self._track_window(request_id, gone=True)
        return blocks, att

    def _log_release(self, request_id: str, att: _Attempt) -> None:
        """Once per request (and per preemption), whether it evicted or not: logged and counted."""
        pool = self.block_pool
        settings = self.settings_for(request_id)
        if settings is None:  # pragma: no cover - every allocated request has its settings
            return
        cfg = settings.config
        bound = settings.admission_blocks(*self.kv_cache_spec.in_flight)
        policy = cfg.policy if cfg.eviction_active else "none"
        if self._metrics is not None:
            self._metrics.inc("requests_released", policy)
            self._metrics.inc("peak_blocks_held", policy, att.peak)
        logger.info(
            "kvevict: request %s released: %d blocks freed by eviction, peak %d blocks held "
            "(window bound %s); pool %d/%d blocks free, peak %d used; policy %s, budget %d",
            request_id,
            att.scheduled_e // self.block_size,
            att.peak,
            bound,
            pool.get_num_free_blocks(),
            pool.num_gpu_blocks - 1,
            self.pool_peak_used,
            policy,
            cfg.budget,
        )

    @property
    def tracked_requests(self) -> int:
        """Requests this manager holds bookkeeping for (0 when nothing is allocated)."""
        return len(self._attempts)

    def window_for(self, request_id: str) -> WindowConfig:
        """The request's window (resolved as the workers resolve it, so both sides agree on ``E``);
        the server's for a request the engine core has not seen."""
        settings = self.settings_for(request_id)
        return settings.window if settings is not None else self.kv_cache_spec.window

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Free the blocks the window has left once the workers have processed the step that left
        them (vLLM passes processed tokens: an in-flight step still reads its window). Memory
        only: what is hashed is decided from the schedule (:meth:`scheduled`)."""
        window = self.window_for(request_id)
        if num_prompt_tokens is None:
            if window.trigger != "chunked" or not window.decode:
                return  # E depends on the prompt length; without it, free nothing (never too much)
            num_prompt_tokens = processed_computed_tokens
        e = evicted_tokens(processed_computed_tokens, num_prompt_tokens, window)
        blocks = self.req_to_blocks.get(request_id)
        att = self._attempts.get(request_id)
        if att is not None and self.enable_caching:  # before the blocks of a window it has left go back
            self._cache_pending_pure(request_id, att, processed_computed_tokens)
            self._cache_windows(request_id, att, processed_computed_tokens)
        if e <= 0 or blocks is None or att is None:
            return
        n_evicted = min(e // self.block_size, len(blocks))
        # Backward scan that stops at the first null block: frees exactly [E_prev/bs, E/bs).
        self._remove_blocks_in_range(request_id, 0, n_evicted)
        if n_evicted > att.nulled:
            att.nulled = n_evicted
            self._track_window(request_id)

    def cache_blocks(self, request, num_tokens, retention_interval=None, *, replay_boundaries) -> None:
        """vLLM hashes the blocks a step fills as it schedules the step (and, with async
        scheduling, as outputs arrive). A request whose window may evict hashes nothing here: its
        pure blocks are hashed when its first compaction is scheduled (:meth:`scheduled`) or when
        it is freed (:meth:`_cache_at_free`). Any other request: vLLM's own caching."""
        if self.window_for(request.request_id).enabled:
            return
        self._vllm_cache_blocks(request, num_tokens, retention_interval, replay_boundaries)

    def _vllm_cache_blocks(self, request, num_tokens: int, retention_interval=None, replay_boundaries=()) -> None:
        """vLLM's hashing of the request's full blocks below ``num_tokens``; the blocks it hashes
        now may be computed in the step being scheduled, so no copy reads them in it."""
        blocks = self.req_to_blocks.get(request.request_id, ())
        before = self.num_cached_block.get(request.request_id, 0)
        super().cache_blocks(request, num_tokens, retention_interval, replay_boundaries=replay_boundaries)
        after = self.num_cached_block.get(request.request_id, 0)
        if self.copies and after > before:
            self._fresh.update(blk.block_id for blk in blocks[before:after])

    def _cache_pure(self, request, num_tokens: int) -> None:
        """Hash the request's full blocks below ``num_tokens``, whose KV is what vLLM computes for
        their tokens without eviction (never beyond the tokens the request knows: vLLM hashes
        only those)."""
        if not self.enable_caching or num_tokens <= 0:
            return
        num_tokens = min(num_tokens, len(request.block_hashes) * self.block_size, request.num_tokens)
        self._vllm_cache_blocks(request, num_tokens // self.block_size * self.block_size)

    def _cache_pending_pure(self, request_id: str, att: _Attempt, processed: int) -> None:
        """Hash the pure blocks the step that set the fence computed, once it has run."""
        st = ENGINE.get(request_id)
        if att.pure_pending is None or processed < att.pure_pending[1] or st is None or st.request is None:
            return
        self._cache_pure(st.request, att.pure_pending[0])
        att.pure_pending = None

    def _cache_at_free(self, request_id: str) -> None:
        """When a request with an evicting window is freed (finished, aborted, preempted), every
        step it will ever run has been scheduled: its blocks below the fence (all of them when no
        scheduled step compacted) were computed without eviction and are never written again;
        so are those after its last scheduled compaction point (``WindowCache.cache_last_tail``)."""
        att = self._attempts.get(request_id)
        st = ENGINE.get(request_id)
        if st is None or st.request is None or att is None or not st.settings.evicts:
            return
        request = st.request
        computed = min(request.num_computed_tokens, len(self.req_to_blocks.get(request_id, ())) * self.block_size)
        self._cache_pure(request, computed if att.fence is None else min(att.fence, computed))
        if self._caches_windows(st):
            processed = vllm_kv_cache.processed_tokens(request)
            self._cache_windows(request_id, att, processed, at_free=True)
            # no compaction will rewrite them now, nor recall unless the prompt's end was scheduled
            if self.copies and st.settings.shares_tails and not self._recalls(st, request.num_computed_tokens):
                blocks = self.req_to_blocks.get(request_id, [])
                self.window_cache.cache_last_tail(request, st.settings, processed, blocks)

    def _cache_windows(self, request_id: str, att: _Attempt, processed: int, at_free: bool = False) -> None:
        """Cache the windows of the compaction points whose step has run (``processed`` tokens):
        from then on their blocks are never written again (the next compaction writes
        ``[E(b) + stride, b + stride)``, above ``b`` since the stride is at least ``W``), and a
        request hitting them reads them in a later step. A window whose last tokens are not yet
        known to the core (async scheduling) is dropped, as is one whose blocks are going back.
        With recall, the window before the prompt's end is cached as the copies made before the
        step after it (at the request's free, if none was made, its own blocks). Then the tails
        computed since (``WindowCache.cache_tails``), with recall those below the prompt's window."""
        st = ENGINE.get(request_id)
        if st is None or st.request is None or not self._caches_windows(st):
            return
        blocks = self.req_to_blocks.get(request_id, [])
        ready = [  # the window before the prompt's end with recall: once copied (_copy_windows)
            b
            for b in att.windows
            if b <= processed and (at_free or b in att.window_copies or not self._copied_window(st, b))
        ]
        if ready:
            att.windows = [b for b in att.windows if b not in ready]
            for b in ready:
                self._cache_window(st, att, b, blocks, at_free)
        if att.saves:
            self._cache_saves(st.request, st.settings, att, processed)
        if st.settings.shares_tails:  # the blocks computed after a compaction point (window_cache)
            request, window = st.request, st.settings.window
            # with recall, its own blocks from the prompt's window on are re-selected: copies only
            below = evicted_tokens(request.num_prompt_tokens, request.num_prompt_tokens, window)
            upto = min(processed, below) if st.settings.recall.enabled else processed
            att.tails_done = self.window_cache.cache_tails(request, st.settings, att.tails_done, upto, blocks)

    def _cache_window(self, st: RequestState, att: _Attempt, b: int, blocks: list, at_free: bool) -> None:
        """Cache the window at ``b``: the request's blocks, or with recall before the prompt's end
        their copies (:meth:`_copied_window`; its own blocks once it is freed before any step after
        ``b`` was scheduled), and the workers keep its tier under the window's key
        (``tier_cache.Keep``)."""
        settings, request = st.settings, st.request
        if self._copied_window(st, b) and (b in att.window_copies or not at_free):
            copies = att.window_copies.get(b)
            if not copies:  # none made (no room): its own blocks are re-selected at the prompt's end
                self._let_go(att, [b])
                self.tiers.forget(request.request_id, b)
                return
            e = evicted_tokens(b, request.num_prompt_tokens, settings.window) // self.block_size
            blocks = [*blocks[:e], *copies]
        cached = self.window_cache.cache_window(request, settings, b, blocks)
        if settings.recall.enabled and not cached:
            self.tiers.forget(request.request_id, b)
        elif settings.recall.enabled:
            self.tiers.keep(
                request.request_id,
                b,
                self.window_cache.tier_key(request, settings, b),
                evicted_tokens(b, request.num_prompt_tokens, settings.window),
                settings.recall.cap,
                self.kv_cache_spec.tier_token_bytes(settings.tier_state_bytes),
                lambda k: vllm_kv_cache.cached_block(self.block_pool, k) is not None,
            )
        self._let_go(att, [b])

    def _let_go(self, att: _Attempt, points: list[int]) -> None:
        """The copies of the windows at ``points`` go (to the LRU where cached, else to the pool)."""
        blocks = [blk for b in points for blk in att.window_copies.pop(b, ())]
        if blocks:
            self.block_pool.free_blocks(blocks)

    def window_hit(self, request, num_tokens: int, others_hold=lambda t: True) -> tuple[list, int] | None:
        """The cached window the request may start on, beyond its pure hit of ``num_tokens``
        (:meth:`WindowCache.find`), with the tail cached since, up to ``hit_end`` of the next point
        with copies (its own copies of what that compaction rewrites, if they fit the pool), else
        up to ``tail_end``; cut where a speculative step would be padded and cut, or where the
        model's other KV cache groups (sliding-window layers) do not hit exactly as many tokens
        (``others_hold``). None when there is none."""
        st = self.state_of(request)
        st.window_hit = 0
        settings = st.settings
        if not self.enable_caching or not settings.shares_windows:
            return None
        window, bs, prompt = settings.window, self.block_size, request.num_prompt_tokens

        def tail_end(b: int, top: int) -> int:
            end = min(settings.hit_end(b + window.step) if self.copies else settings.tail_end(b), top // bs * bs)
            e_p = evicted_tokens(b + window.step, prompt, window)
            if end > e_p and not self._copies_fit(settings, (end - e_p) // bs):
                end = max(b, min(end, e_p))
            return end

        def usable(t: int) -> bool:
            return not self._padded_and_cut(request, t) and others_hold(t) and with_tier(t)

        def with_tier(t: int) -> bool:  # recall: the tier of the window at the point b <= t is kept
            if not settings.recall.enabled:
                return True
            if not self.copies or not settings.starts_on_window_at(t, prompt):
                return False
            b = last_boundary(t, window)
            e = evicted_tokens(b, prompt, window)
            if prompt <= b + window.step and not self._copies_fit(settings, (t - e) // bs):
                return False  # its copies of the window and tail would never fit beside its window bound
            return self.tiers.pin(self.window_cache.tier_key(request, settings, b))

        hit = self.window_cache.find(request, settings, num_tokens, tail_end if settings.shares_tails else None, usable)
        if hit is not None:
            st.window_hit = hit[1]
        return hit

    def waits_for_window(self, request) -> bool:
        """Whether a waiting request waits a step rather than start now: when a running request
        with its configuration, sharing a block or more of its prefix beyond what it would hit now,
        has yet to compute (and cache) the windows and copies that cover that prefix. Two
        users of one document arriving together then compute it once, as they would on stock
        vLLM, whose blocks are shared while they are computed (a compacted window exists only once
        the step that makes it has run). The wait ends when that request has processed the point
        past the shared prefix (its copies are then cached) or is no longer running. Requests that
        cache their tails wait, and recall requests whose windows are cached with their tiers."""
        st = ENGINE.get(request.request_id)
        if not self.copies or st is None or not (st.settings.shares_tails or self._shares_tiers(st)):
            return False
        settings, hbs = st.settings, self.block_pool.hash_block_size
        window = settings.window
        mine = request.block_hashes[: (request.num_tokens - 1) // hbs]
        for rid in self._attempts:
            other = ENGINE.get(rid)
            if rid == request.request_id or other is None or other.request is None:
                continue
            if other.settings.window_salt != settings.window_salt or other.fell_back_from is not None:
                continue  # another configuration, or one whose windows are not cached
            theirs, n = other.request.block_hashes, 0
            while n < min(len(mine), len(theirs)) and mine[n] == theirs[n]:
                n += 1
            shared = n * hbs
            if shared - st.shared < window.block_size:
                continue
            p = next_point(shared, window)
            done = p if other.request.num_prompt_tokens >= p else other.request.num_prompt_tokens
            if vllm_kv_cache.processed_tokens(other.request) < done:
                self._attempts[rid].awaited = True
                return True
        return False

    def step_tokens(self, request, start: int, n: int) -> int:
        """How many of the ``n`` tokens the scheduler offers a step of the request from ``start`` it
        may compute: none past its next compaction point (nor past the blocks copied aside before
        it), none past what a ``once`` window's in-flight compaction leaves room for, and, with
        speculative drafts, not up to a compaction point with drafts in the step (``window``'s
        ``step_limit``, ``settle_limit``, ``draft_cut``)."""
        settings = self.state_of(request).settings
        tails = self.copies and settings.shares_tails
        prompt, p = request.num_prompt_tokens, last_boundary(start, settings.window) + settings.window.step
        copies = tails and self._copies_at(request, settings, self._attempts.get(request.request_id), p)
        saves = settings.policy.needs.window if copies else None
        recall_tail = settings.recall.window if tails and settings.recall.enabled else None
        for limit in (
            step_limit(start, prompt, settings.window, saves, recall_tail),
            settle_limit(start, vllm_kv_cache.processed_tokens(request), prompt, settings.window),
        ):
            if limit is not None:
                n = min(n, limit)
        return draft_cut(start, n, request.num_tokens, prompt, settings.window)

    def pads_step(self, request, start: int, n: int) -> bool:
        """Whether vLLM's speculative decoding padded this step of a waiting request: one token to
        compute and ``k`` placeholder drafts, a step it requires to run whole."""
        k = self.kv_cache_spec.evict_spec_tokens
        return k > 0 and n == 1 + k and request.num_tokens - start == 1

    def _padded_and_cut(self, request, hit: int) -> bool:
        """Whether a request starting on ``hit`` tokens would have one token left to compute, which
        vLLM's speculative decoding pads with placeholder drafts to a step of ``1 + k`` tokens that
        it requires to run whole, and that :meth:`step_tokens` would cut (a compaction point in
        it): such a hit is shortened, so that the first step is an ordinary prefill chunk."""
        k = self.kv_cache_spec.evict_spec_tokens
        return k > 0 and request.num_tokens - hit == 1 and self.step_tokens(request, hit, 1 + k) < 1 + k

    def usable_hit(self, request, num_tokens: int) -> int:
        """How many of ``num_tokens`` prefix-cache hit tokens (pure blocks) the request may use: all
        of them when its window never evicts; none when its policy keeps per-slot state (the state
        of a shared block is another request's); otherwise at most the ``E`` of its first
        compaction (``window.pure_hit_limit``), which frees them and writes only above them: the
        request computes exactly what it would have computed without the hit. A request that
        caches its tails goes on to ``hit_end`` of its first compaction point, with its own copies
        of the blocks that compaction rewrites (:meth:`_hit_copies`), up to the first block
        hashed in the step being scheduled."""
        if num_tokens <= 0:
            return 0
        settings = self.state_of(request).settings
        window = settings.window
        if not window.enabled:
            return num_tokens
        if settings.policy.needs.state:
            return 0
        prompt = request.num_prompt_tokens
        limit = pure_hit_limit(prompt, prompt + request.max_tokens, window)
        if limit is None:
            return num_tokens
        num_tokens = min(num_tokens, max(limit, settings.hit_end(first_boundary(window))))
        if num_tokens > limit and not (
            self.copies
            and settings.shares_tails
            and self._copies_fit(settings, (num_tokens - limit) // self.block_size)
        ):
            num_tokens = limit
        num_tokens = self._not_fresh(request, limit, num_tokens)
        while num_tokens > 0 and self._padded_and_cut(request, num_tokens):
            num_tokens -= self.block_size
        return num_tokens

    def _copies_fit(self, settings: RequestSettings, copies: int) -> bool:
        """Whether a request's first step, which holds the copies of its hit beside its window
        bound (the shared blocks go back once the copies have run), fits the pool: a hit that
        needs more is cut below them, else the request could never be admitted."""
        bound = window_bound_blocks(settings.window, *self.kv_cache_spec.in_flight)
        return bound + copies <= self.block_pool.num_gpu_blocks - 1

    def _not_fresh(self, request, lo: int, hi: int) -> int:
        """``hi``, or the first block in ``[lo, hi)`` hashed in the step being scheduled (which the
        request would copy before that step computes it)."""
        bs, hbs = self.block_size, self.block_pool.hash_block_size
        for i in range(lo, hi, bs):
            key = vllm_kv_cache.pure_block_key(request.block_hashes[(i + bs) // hbs - 1], self.kv_cache_group_id)
            blk = vllm_kv_cache.cached_block(self.block_pool, key)
            if blk is None or blk.block_id in self._fresh:
                return i
        return hi


_metrics_owner: KVEvictManager | None = None


def _ours(managers: list) -> list[KVEvictManager]:
    """The plugin's managers among a coordinator's (one per evicting KV cache group)."""
    found = [m for m in managers if isinstance(m, KVEvictManager)]
    for m in found:  # copies need one KV cache group whose hash blocks are its blocks
        m.copies = m.enable_caching and len(managers) == 1 and m.block_pool.hash_block_size == m.block_size
    return found


class SchedulerHooks:
    """The plugin's answers to vLLM's scheduler (``vllm_compat.kv_cache.RequestHooks``): resolve
    each request's settings the first time the scheduler looks at it (a prefix-cache lookup, a
    step's size or an allocation), record the request and the prefix-cache hit its attempt starts
    on, cut every step at the request's next compaction point (and a block short of it when the
    blocks it rewrites are copied aside), let a waiting request wait for a running one that
    computes its prefix (:meth:`KVEvictManager.waits_for_window`), and end both on vLLM's free
    paths: the attempt when the request is preempted, everything when it has finished."""

    def allocate(self, request, managers: list) -> None:
        for m in _ours(managers):
            m.state_of(request).request = request
            return

    def end(self, request) -> None:
        if request.is_finished():
            ENGINE.end(request.request_id)
        elif (st := ENGINE.get(request.request_id)) is not None:  # preempted: it starts again later
            st.request = None
            st.restart(0)

    def prefix_hit(self, request, num_tokens: int, managers: list) -> int:
        return min([m.usable_hit(request, num_tokens) for m in _ours(managers)], default=num_tokens)

    def hit(self, request, num_tokens: int) -> None:
        st = ENGINE.get(request.request_id)
        if st is not None:
            st.shared = num_tokens

    def scheduled(self, request, start: int, num_tokens: int, managers: list) -> None:
        for m in _ours(managers):
            m.scheduled(request, start, num_tokens)

    def fallbacks(self, request_ids: frozenset[str], managers: list) -> None:
        for rid in request_ids:
            st = ENGINE.get(rid)
            if st is None:  # finished or aborted before this step's results arrived
                continue
            if st.fell_back_from is None:
                st.fell_back_from = "a worker"
                logger.debug("kvevict: request %s fell back on a worker: nothing of it is cached", rid)
            for m in _ours(managers):
                m.fell_back(rid)

    def window(self, request, num_tokens: int, managers: list, per_group) -> tuple[tuple, int] | None:
        """A window every evicting group has at the same point, with the other groups' (sliding
        windows) own hit of exactly its tokens."""
        mine = [i for i, m in enumerate(managers) if isinstance(m, KVEvictManager)]
        others = [i for i in range(len(managers)) if i not in mine]
        lookup = functools.cache(per_group)  # vLLM's hit of at most t tokens in each group, once per t

        def others_hold(t: int) -> bool:
            return not others or all(lookup(t)[1][i] == t for i in others)

        hits = [managers[i].window_hit(request, num_tokens, others_hold) for i in mine]
        if not hits or None in hits or len({t for _, t in hits}) != 1:
            if hits and (st := ENGINE.get(request.request_id)) is not None:
                st.window_hit = 0
            return None
        t = hits[0][1]
        groups = list(lookup(t)[0]) if others else [[] for _ in managers]
        for i, (blocks, _) in zip(mine, hits):
            groups[i] = blocks
        return tuple(groups), t

    def chunk(self, request, start: int, num_tokens: int, managers: list) -> int:
        for m in _ours(managers):
            waiting = request.status != RequestStatus.RUNNING
            if waiting and m.waits_for_window(request):
                return 0
            cut = m.step_tokens(request, start, num_tokens)
            if waiting and cut < num_tokens and m.pads_step(request, start, num_tokens):
                return 0  # vLLM runs a padded step whole or not at all: not in this step
            num_tokens = cut
        return num_tokens

    def messages(self, managers: list) -> list:
        return [m for mgr in _ours(managers) for m in mgr.tiers.messages()]

    def keeps_every_block(self, request) -> bool:
        st = ENGINE.get(request.request_id)
        return st is not None and st.settings.window.enabled


def install_scheduler_hooks() -> None:
    """Wire vLLM's scheduler to :class:`SchedulerHooks` (idempotent)."""
    vllm_kv_cache.install_request_hooks(SchedulerHooks())


def register_spec() -> None:
    """Map KVEvictSpec to KVEvictManager in vLLM's registry (idempotent; engine-core process)."""
    vllm_kv_cache.register_spec(KVEvictSpec, KVEvictManager)
