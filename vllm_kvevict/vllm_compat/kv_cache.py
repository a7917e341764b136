# SPDX-License-Identifier: Apache-2.0
"""The engine core's KV cache: spec and manager bases, the spec registry, per-request hooks.

Written against vLLM 0.32.0 (``v1/kv_cache_interface.py``, ``v1/core/single_type_kv_cache_manager.py``,
``v1/kv_cache_spec_registry.py``, ``v1/core/kv_cache_manager.py``, ``v1/core/sched/scheduler.py``); 0.33.0 has the same classes and
signatures, with two differences that do not reach the plugin:

* ``KVCacheSpec.is_draft`` (0.33): a ``kw_only``, ``compare=False`` field; ``KVEvictSpec.from_spec``
  copies every init field of ``FullAttentionSpec`` whatever they are, so it is carried over.
* ``SingleTypeKVCacheManager.pop_blocks_for_free`` (0.33) strips leading null blocks (those eviction
  leaves) before handing the list to the block pool; the plugin's override passes the list on.

Block copies (:func:`copy_on_write`, :func:`copy_aside`) use vLLM's copy-on-write of partial
prefix-cache hits, the same in 0.32 and 0.33: ``SingleTypeKVCacheManager._apply_cow`` and
``_pending_cow_copies`` (drained by ``take_pending_cow_copies`` into
``SchedulerOutput.kv_cache_block_copies``, which the V1 runner's ``_update_states`` copies with
``copy_kv_cache_blocks_inplace`` before the step's forward; the scheduler frees both ends once the
step has run).

KV cache planning moved from ``v1/core/kv_cache_utils.py`` to a new module,
``vllm.v1.core.kv_cache_planning``, in 0.33; the plugin reaches it only through
``KVCacheSpec.max_memory_usage_bytes(vllm_config)``, whose signature is the same in both.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import RequestStatus

from vllm_kvevict.vllm_compat import MESSAGES_ATTR
from vllm_kvevict.vllm_compat.patching import wrap_method

__all__ = [
    "FullAttentionManager",
    "FullAttentionSpec",
    "KVCacheBlock",
    "RequestStatus",
    "cache_block",
    "cached_block",
    "copy_aside",
    "copy_on_write",
    "RequestHooks",
    "install_request_hooks",
    "processed_tokens",
    "pure_block_key",
    "register_spec",
    "request_extra_args",
    "spec_tokens",
    "uncache_blocks",
    "window_block_keys",
]


def register_spec(spec_cls: type, manager_cls: type) -> None:
    """Map ``spec_cls`` to ``manager_cls`` in vLLM's registry (idempotent; engine-core process)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    # Without this first, registering a spec makes the registry skip the built-in specs.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(spec_cls, manager_cls, uniform_type_base_spec=FullAttentionSpec)


def _keyed(hash_algo: str, group_id: int):
    """``key(parent, tokens, extra)``: vLLM's own block hash (``hash_block_tokens`` with the
    server's ``prefix_caching_hash_algo``) with the KV cache group, as vLLM keys its map."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, make_block_hash_with_group_id

    fn = get_hash_fn_by_name(hash_algo)
    return lambda parent, tokens, extra: make_block_hash_with_group_id(
        hash_block_tokens(fn, parent, tokens, extra), group_id
    )


def window_block_keys(hash_algo: str, prefix_hash, salt: str, n: int, group_id: int) -> Iterator:
    """The prefix-cache keys of a compacted window's ``n`` blocks, in order (lazily: a lookup stops
    at the first block not cached): vLLM's block hash chained on the hash of the token prefix the
    window was compacted from, with the block's index in the window as its "tokens" and the
    eviction configuration as extra keys, so it can equal no pure block's hash and no other
    configuration's window."""
    key = _keyed(hash_algo, group_id)
    return (key(prefix_hash, (j,), ("kvevict-window", salt)) for j in range(n))


def tail_block_key(hash_algo: str, block_hash, b: int, salt: str, group_id: int):
    """The prefix-cache key of a block computed after the compaction at ``b`` (a window's tail):
    vLLM's block hash chained on the pure hash of the token prefix through that block, with ``b``
    as its "tokens" and the eviction configuration as extra keys (its KV is a function of the
    window at ``b`` and the tokens up to it)."""
    return _keyed(hash_algo, group_id)(block_hash, (b,), ("kvevict-tail", salt))


def pure_block_key(block_hash, group_id: int):
    """The key vLLM caches a pure block of this KV cache group under (its block hash with the group)."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    return make_block_hash_with_group_id(block_hash, group_id)


def copy_on_write(manager, request_id: str, index: int):
    """Give the request its own copy of the shared block at ``index`` of its block list, before
    the workers run its next step: vLLM's copy-on-write of a partial prefix-cache hit
    (``SingleTypeKVCacheManager._apply_cow``, 0.32 and 0.33): the new block takes the shared one's
    place, the pair goes into the step's ``SchedulerOutput.kv_cache_block_copies`` (the workers
    copy every layer's block before the step's forward), and the scheduler keeps both until the
    copy has run. The shared block must have been computed in an earlier step. Returns the copy."""
    block = manager.block_pool.get_new_blocks(1)[0]
    manager._apply_cow(request_id, index, manager.req_to_blocks[request_id][index], block)
    if manager._record_new_block_ids:
        manager.new_block_ids.append(block.block_id)
    return block


def copy_aside(manager, block: KVCacheBlock) -> KVCacheBlock:
    """A new block that holds a copy of ``block`` (computed in an earlier step) once the workers
    start the step being scheduled: the same copies as :func:`copy_on_write`, the request keeping
    its block. The caller holds one reference to the copy (the scheduler frees its own once the
    copy has run)."""
    copy = manager.block_pool.get_new_blocks(1)[0]
    block.ref_cnt += 1  # the scheduler's hold on both ends until the copy has run
    copy.ref_cnt += 1  # the caller's
    manager._pending_cow_copies.append((block, copy))
    return copy


def cache_block(block_pool, key, block) -> None:
    """Enter ``block`` in vLLM's prefix cache under ``key`` (``BlockPool._insert_block_hash``, 0.32
    and 0.33: the block takes the hash, the map gains it; vLLM's LRU evicts it as any cached block),
    unless a block is cached under ``key`` already (the same KV, from another request)."""
    if cached_block(block_pool, key) is None:
        block_pool._insert_block_hash(key, block, num_tokens=None)


def uncache_blocks(block_pool, blocks) -> None:
    """Take ``blocks`` out of vLLM's prefix cache (``BlockPool.evict_blocks``, 0.32 and 0.33: their
    hashes go, the blocks stay with whoever holds them and go back to the pool as uncached)."""
    block_pool.evict_blocks({blk.block_id for blk in blocks})


def cached_block(block_pool, key):
    """The block cached under ``key``, or None."""
    return block_pool.cached_block_hash_to_block.get_one_block(key)


def spec_tokens(vllm_config) -> int:
    """Draft tokens per step with speculative decoding (0 without): ``SpeculativeConfig.num_speculative_tokens``."""
    spec = getattr(vllm_config, "speculative_config", None)
    return int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0


def processed_tokens(request) -> int:
    """The request's tokens whose step has run (computed, less those of steps still in flight)."""
    return request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)


def request_extra_args(request) -> dict | None:
    """A request's sampling parameters' ``extra_args`` (where ``vllm_xargs`` arrive)."""
    return getattr(getattr(request, "sampling_params", None), "extra_args", None)


def hit_per_group(coordinator, request, num_tokens: int) -> tuple[tuple[list, ...], tuple[int, ...]]:
    """vLLM's prefix-cache hit of at most ``num_tokens`` in each KV cache group on its own: the
    blocks and the length, per group. Asked only of a model with several groups. vLLM 0.32/0.33:
    ``HybridKVCacheCoordinator.find_longest_cache_hit_per_group``."""
    blocks, lengths = coordinator.find_longest_cache_hit_per_group(request.block_hashes, num_tokens)
    return tuple(blocks), tuple(lengths)


class RequestHooks(Protocol):
    """What the engine core's scheduler tells the plugin about requests, and asks it. vLLM's
    single-type managers only see request ids; ``KVCacheManager`` and the scheduler see the request.
    ``managers`` is always the coordinator's single-type managers, one per KV cache group. vLLM
    0.32/0.33: ``get_computed_blocks`` returns ``(KVCacheBlocks, num_tokens, shared_prefix_boundary)``
    (0.33 adds an optional ``max_cache_hit_length``, passed on); ``find_longest_cache_hit(block_hashes,
    max_length)`` returns ``(blocks, num_tokens, num_uncached)``."""

    def allocate(self, request, managers: list) -> None:
        """Before every ``allocate_slots``."""

    def scheduled(self, request, start: int, num_tokens: int, managers: list) -> None:
        """After every ``allocate_slots`` that succeeded, i.e. for every step the scheduler
        schedules the request in: ``num_tokens`` the tokens whose KV the workers will have computed
        once that step has run (the request's computed tokens, the hit it adopts in this step and
        the step's new tokens: vLLM's own sum in ``allocate_slots``), ``start`` those before it."""

    def end(self, request) -> None:
        """After ``free`` and after ``pop_blocks_for_free`` (the deferred-free path of
        ``Scheduler._free_request_blocks``), so per-request state ends on both of vLLM's free paths
        (``request.is_finished()`` tells a finished request from a preempted one: vLLM frees a
        preempted request's blocks before it sets ``PREEMPTED``, a finished one's after ``FINISHED_*``)."""

    def prefix_hit(self, request, num_tokens: int, managers: list) -> int:
        """Every prefix-cache lookup (``get_computed_blocks``, when a request is scheduled from the
        waiting queue: new or preempted): how many of the hit tokens the request may use (a
        multiple of the block size, at most ``num_tokens``). A hit that must be cut is looked up
        again through vLLM's coordinator with that maximum length (``find_longest_cache_hit``,
        which keeps every KV cache group consistent)."""
        ...

    def window(self, request, num_tokens: int, managers: list, per_group) -> tuple[tuple, int] | None:
        """Every lookup, after the pure hit (``num_tokens``) is decided: a cached compacted window
        the request may start on instead, ``(blocks, tokens)`` (one block list per KV cache
        group), or None. ``per_group(tokens)`` is vLLM's own hit of at most ``tokens`` in each
        group (:func:`hit_per_group`)."""
        ...

    def hit(self, request, num_tokens: int) -> None:
        """The hit the lookup returns."""

    def chunk(self, request, start: int, num_tokens: int, managers: list) -> int:
        """Every step the scheduler is about to give a request (running or waiting, after every cap
        of its own: ``Scheduler._reserve_prefill_lookahead``, the last one before the allocation in
        both of ``schedule``'s loops, 0.32 and 0.33): how many of those tokens it may compute (at
        least one; 0 for a waiting request: not in this step, which makes 0.32's scheduler stop
        admitting waiting requests for the step and 0.33's requeue it behind the others)."""
        ...

    def fallbacks(self, request_ids: frozenset[str], managers: list) -> None:
        """The requests whose policy a worker replaced by the safe policy in a step
        (``runner.output_fallbacks``), first thing in ``Scheduler.update_from_output`` for that
        step: before vLLM advances anything from the step's results."""

    def messages(self, managers: list) -> list:
        """After every ``Scheduler.schedule``: what the workers must apply before they build the
        step it scheduled (``SchedulerOutput`` carries it to every worker: :data:`MESSAGES_ATTR`)."""
        ...

    def keeps_every_block(self, request) -> bool:
        """Whether the request's blocks in the KV cache groups that cache sparsely are all kept
        reachable (``retention_interval=None``): vLLM keeps a sliding-window group's blocks
        reachable only for a hit at a prompt's end (``prefix_cache_retention_interval`` 0)."""
        ...


def _managers(kv_cache_manager) -> list:
    return list(kv_cache_manager.coordinator.single_type_managers)


def _wrap_allocate(hooks: RequestHooks):
    """``KVCacheManager.allocate_slots``: ``allocate`` before, ``scheduled`` after a success."""
    import inspect

    def make(orig):
        signature = inspect.signature(orig)

        def allocate_slots(self, request, *args, **kwargs):
            hooks.allocate(request, _managers(self))
            computed = request.num_computed_tokens  # before the call: vLLM advances it after scheduling
            blocks = orig(self, request, *args, **kwargs)
            if blocks is not None:
                a = signature.bind(self, request, *args, **kwargs).arguments
                hit = a.get("num_new_computed_tokens", 0) + a.get("num_external_computed_tokens", 0)
                start = min(computed + hit, self.max_model_len)
                hooks.scheduled(request, start, start + a["num_new_tokens"], _managers(self))
            return blocks

        return allocate_slots

    return make


def _wrap_end(hooks: RequestHooks):
    """``KVCacheManager.free`` and ``pop_blocks_for_free``: ``end`` after either."""

    def make(orig):
        def end(self, request, *args, **kwargs):
            try:
                return orig(self, request, *args, **kwargs)
            finally:
                hooks.end(request)

        return end

    return make


def _wrap_lookup(hooks: RequestHooks):
    """``KVCacheManager.get_computed_blocks``: the pure hit cut to ``prefix_hit`` (looked up again
    through the coordinator, every group consistent), then a ``window`` in its place."""

    def make(orig):
        def get_computed_blocks(self, request, *args, **kwargs):  # 0.33: max_cache_hit_length=None
            blocks, num_tokens, boundary = orig(self, request, *args, **kwargs)
            managers = _managers(self)
            allowed = hooks.prefix_hit(request, num_tokens, managers)
            if allowed < num_tokens:
                if allowed > 0:
                    hit, num_tokens, uncached = self.coordinator.find_longest_cache_hit(request.block_hashes, allowed)
                    blocks, boundary = self.create_kv_cache_blocks(hit), (num_tokens + uncached if uncached else 0)
                else:
                    blocks, num_tokens, boundary = self.empty_kv_cache_blocks, 0, 0
            if self.prefix_cache_lookup_enabled(request):
                window = hooks.window(
                    request, num_tokens, managers, lambda t: hit_per_group(self.coordinator, request, t)
                )
                if window is not None:
                    group_blocks, num_tokens = window
                    blocks, boundary = self.create_kv_cache_blocks(group_blocks), 0
            hooks.hit(request, num_tokens)
            return blocks, num_tokens, boundary

        return get_computed_blocks

    return make


def _wrap_cache(hooks: RequestHooks):
    """``SingleTypeKVCacheManager.cache_blocks``: dense retention where ``keeps_every_block``."""

    def make(orig):
        def cache_blocks(self, request, num_tokens, retention_interval=None, **kwargs):
            if retention_interval is not None and hooks.keeps_every_block(request):
                retention_interval = None
            return orig(self, request, num_tokens, retention_interval, **kwargs)

        return cache_blocks

    return make


def _wrap_chunk(hooks: RequestHooks):
    """``Scheduler._reserve_prefill_lookahead``: the step cut to ``chunk`` (a waiting request cut
    to nothing is not in this step)."""

    def make(orig):
        def reserve(self, request, num_computed_tokens, num_new_tokens, *args, **kwargs):
            n = orig(self, request, num_computed_tokens, num_new_tokens, *args, **kwargs)
            if n <= 0:
                return n
            allowed = hooks.chunk(request, num_computed_tokens, n, _managers(self.kv_cache_manager))
            if allowed <= 0 and request.status != RequestStatus.RUNNING:
                return 0  # a waiting request: not in this step
            return max(1, min(n, allowed))

        return reserve

    return make


def _wrap_output(hooks: RequestHooks):
    """``Scheduler.update_from_output``: ``fallbacks`` first."""
    from vllm_kvevict.vllm_compat.runner import output_fallbacks

    def make(orig):
        def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
            fallbacks = output_fallbacks(model_runner_output)
            if fallbacks:
                hooks.fallbacks(fallbacks, _managers(self.kv_cache_manager))
            return orig(self, scheduler_output, model_runner_output, *args, **kwargs)

        return update_from_output

    return make


def _wrap_schedule(hooks: RequestHooks):
    """``Scheduler.schedule``: the step's messages to the workers on its output."""

    def make(orig):
        def schedule(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            messages = hooks.messages(_managers(self.kv_cache_manager))
            if messages:
                setattr(out, MESSAGES_ATTR, messages)
            return out

        return schedule

    return make


def install_request_hooks(hooks: RequestHooks) -> None:
    """Wire vLLM's scheduler and KV cache manager to ``hooks`` (:class:`RequestHooks`)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    wrap_method(
        SingleTypeKVCacheManager,
        "cache_blocks",
        _wrap_cache(hooks),
        "kvevict: a request whose window evicts keeps every block of its sliding-window groups reachable",
    )
    wrap_method(
        Scheduler, "update_from_output", _wrap_output(hooks), "kvevict: the workers' fallbacks, before a step's results"
    )
    wrap_method(Scheduler, "schedule", _wrap_schedule(hooks), "kvevict: the engine core's messages to the workers")
    wrap_method(
        Scheduler,
        "_reserve_prefill_lookahead",
        _wrap_chunk(hooks),
        "kvevict: no step crosses a request's compaction point",
    )
    wrap_method(
        KVCacheManager,
        "allocate_slots",
        _wrap_allocate(hooks),
        "kvevict: each request's settings; the window each scheduled step reaches",
    )
    end = _wrap_end(hooks)
    wrap_method(KVCacheManager, "free", end, "kvevict: end a request's attempt (or the request)")
    wrap_method(KVCacheManager, "pop_blocks_for_free", end, "kvevict: end a request's attempt (deferred free)")
    wrap_method(
        KVCacheManager, "get_computed_blocks", _wrap_lookup(hooks), "kvevict: prefix-cache hits a window can use"
    )
