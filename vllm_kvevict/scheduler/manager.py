"""``KVEvictSpec`` and its manager: free the leading blocks the window has left behind.

vLLM's classes come through :mod:`vllm_kvevict.vllm_compat.kv_cache`. The worker's backend turns each plain ``FullAttentionSpec`` into a
``KVEvictSpec`` (``AttentionBackend.customize_spec``); the spec is pickled to the engine core,
where the registry maps it to :class:`KVEvictManager`. The manager is a ``FullAttentionManager``
whose ``remove_skipped_blocks`` (called from ``KVCacheManager.allocate_slots`` with the number of
*processed* tokens every time the request is scheduled) nulls and frees logical blocks
``[0, E / block_size)`` with ``E = evicted_tokens(...)``, exactly as sliding-window attention does.

Prefix caching (docs/architecture.md, "Prefix caching"): a block enters vLLM's prefix cache only
when its KV is what its hash says and will never be rewritten. For a request whose window may
evict, that is every block it computed before its first compaction and that the first compaction
frees (``[shared, E1)``: hashed as the window moves past them, so they go back to the pool as
free-but-cached blocks), and, if it never compacts, every full block (hashed when it is freed).
Blocks its compactions write, and blocks computed after it first evicted (their KV depends on
what was evicted), are never hashed. A prefix-cache hit is held read-only: ``E`` waits until it
can move past it (``window.evicted_tokens(..., shared)``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Self

from vllm_kvevict import metrics
from vllm_kvevict._logging import logger
from vllm_kvevict.config import KVEvictConfig, config_from_json, request_config, request_overrides
from vllm_kvevict.policies import get_policy
from vllm_kvevict.vllm_compat import kv_cache as vllm_kv_cache
from vllm_kvevict.vllm_compat.kv_cache import FullAttentionManager, FullAttentionSpec
from vllm_kvevict.window import WindowConfig, admission_blocks, evicted_tokens, window_bound_blocks


@dataclass(frozen=True, kw_only=True)
class KVEvictSpec(FullAttentionSpec):
    """A full-attention layer whose per-request KV is bounded by the kvevict window."""

    evict_config: str  # the server's kvevict configuration, as JSON (the spec is pickled to the engine core)
    evict_max_in_flight: int = 0  # tokens scheduled but not yet processed (vLLM's max_in_flight_tokens)

    @property
    def config(self) -> KVEvictConfig:
        return config_from_json(self.evict_config)

    @property
    def window(self) -> WindowConfig:
        """The server's window; a request's own is ``request_config(...).window(block_size)``."""
        return self.config.window(self.block_size)

    @classmethod
    def from_spec(cls, spec: FullAttentionSpec, config: KVEvictConfig, max_in_flight: int) -> KVEvictSpec:
        base = {f.name: getattr(spec, f.name) for f in fields(FullAttentionSpec) if f.init}
        return cls(**base, evict_config=config.model_dump_json(), evict_max_in_flight=max_in_flight)

    def max_admission_blocks_per_request(self, max_model_len: int | None = None) -> int | None:
        """Most blocks one request ever holds: the window bound in ``chunked`` mode, else ``None``.

        The single source for the start-up memory check and the scheduler's admission gate, as for
        vLLM's sliding-window specs: a prompt longer than the whole KV cache is admitted, because its
        blocks are recycled as the window moves.
        """
        window = self.window
        if window.trigger != "chunked" or not window.enabled:  # unbounded before/without eviction
            return None
        bound = window_bound_blocks(window, self.evict_max_in_flight)
        return bound if max_model_len is None else min(bound, -(-max_model_len // self.block_size))

    def max_memory_usage_bytes(self, vllm_config) -> int:
        cap = self.max_admission_blocks_per_request(vllm_config.model_config.max_model_len)
        if cap is None:
            return super().max_memory_usage_bytes(vllm_config)
        return cap * self.page_size_bytes

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        merged = FullAttentionSpec.merge.__func__(FullAttentionSpec, specs)  # checks the common fields
        first = specs[0]
        extra = ("evict_config", "evict_max_in_flight")
        for s in specs:
            assert all(getattr(s, k) == getattr(first, k) for k in extra), "kvevict layers disagree on the window"
        return cls.from_spec(merged, first.config, first.evict_max_in_flight)


class KVEvictManager(FullAttentionManager):
    """Frees the blocks of evicted tokens as soon as the processed-token count crosses a trigger."""

    def __init__(self, kv_cache_spec: KVEvictSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        # vLLM 0.32 passes the admission cap only to its own recycling specs; set ours the same way.
        if self.max_admission_blocks_per_request is None:
            self.max_admission_blocks_per_request = kv_cache_spec.max_admission_blocks_per_request()
        # Per request: [leading blocks nulled (= freed by eviction), peak blocks held].
        self._stats: dict[str, list[int]] = {}
        #: Peak of blocks in use in the whole pool (vLLM's free-block count), since start.
        self.pool_peak_used = 0
        self._in_free = False
        self._popped: list[int] | None = None
        #: requests that evict: request id -> (blocks held, window bound), for the gauges
        self._windows: dict[str, tuple[int, int]] = {}
        # One manager per process records (a model with several kvevict KV cache groups has one
        # manager per group, all moving the same windows).
        global _metrics_owner
        self._metrics = metrics.recorder("core") if _metrics_owner is None else None
        _metrics_owner = _metrics_owner or self

    def _held(self, request_id: str) -> int:
        # The nulled blocks are exactly a prefix of vLLM's block list (the evicted window start).
        st = self._stats.get(request_id)
        return len(self.req_to_blocks.get(request_id, ())) - (st[0] if st else 0)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        new = super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        if request_id not in self._stats:  # the first allocation of an attempt
            self._count_hit(request_id)
        st = self._stats.setdefault(request_id, [0, 0])
        st[1] = max(st[1], self._held(request_id))
        pool = self.block_pool
        self.pool_peak_used = max(self.pool_peak_used, pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
        self._track_window(request_id)
        return new

    def _count_hit(self, request_id: str) -> None:
        shared = SHARED.get(request_id, 0)
        if self._metrics is not None and shared > 0 and self.window_for(request_id).enabled:
            policy = request_config(self.kv_cache_spec.config, REQUEST_OVERRIDES.get(request_id) or None).policy
            self._metrics.inc("prefix_hits", policy)
            self._metrics.inc("prefix_hit_tokens", policy, shared)

    def _track_window(self, request_id: str, gone: bool = False) -> None:
        """Keep the gauges of blocks held by requests with a bounded window, and of their bounds, current."""
        if self._metrics is None:
            return
        bound = None if gone else admission_blocks(self.window_for(request_id), self.kv_cache_spec.evict_max_in_flight)
        if bound is None:  # gone, or its window is not bounded (eviction off, once, no decode-time eviction)
            if self._windows.pop(request_id, None) is None:
                return
        else:
            self._windows[request_id] = (self._held(request_id), bound)
        self._metrics.set("window_blocks_held", sum(h for h, _ in self._windows.values()))
        self._metrics.set("window_blocks_bound", sum(b for _, b in self._windows.values()))

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args, apply_admission_cap: bool = False,
                                   **kwargs) -> int:
        """vLLM's count, with the admission cap of the request's *own* window: its bound (plus its
        shared prefix, held until the window moves past it) when it evicts in ``chunked`` mode,
        none (the whole sequence must fit) when a per-request override turns eviction off, chooses
        a ``once`` policy or a larger budget. (The API refuses a request whose peak exceeds the
        whole pool, and hits are cut to what fits, so every admitted request can finish alone.)"""
        if not apply_admission_cap:
            return super().get_num_blocks_to_allocate(request_id, num_tokens, *args, **kwargs)
        server_cap = self.max_admission_blocks_per_request
        self.max_admission_blocks_per_request = admission_blocks(
            self.window_for(request_id), self.kv_cache_spec.evict_max_in_flight, SHARED.get(request_id, 0))
        try:
            return super().get_num_blocks_to_allocate(request_id, num_tokens, *args, apply_admission_cap=True,
                                                      **kwargs)
        finally:
            self.max_admission_blocks_per_request = server_cap

    def pop_blocks_for_free(self, request_id: str):
        """vLLM's last call for a request on both of its free paths: ``free`` (blocks go back to
        the pool now) and the deferred one (``Scheduler._free_request_blocks`` hands them back
        after an in-flight step). The request's bookkeeping ends here either way."""
        self._cache_if_never_compacted(request_id)
        blocks = super().pop_blocks_for_free(request_id)
        st = self._stats.pop(request_id, None)
        self._track_window(request_id, gone=True)
        if self._in_free:
            self._popped = st  # logged by free() once the blocks are back in the pool
        elif st is not None:
            self._log_release(request_id, st)
        return blocks

    def free(self, request_id: str) -> None:
        self._in_free, self._popped = True, None
        try:
            super().free(request_id)
        finally:
            self._in_free = False
        st, self._popped = self._popped, None
        if st is not None:
            self._log_release(request_id, st)

    def _log_release(self, request_id: str, st: list[int]) -> None:
        """Once per request (and per preemption), whether it evicted or not."""
        pool = self.block_pool
        cfg = request_config(self.kv_cache_spec.config, REQUEST_OVERRIDES.get(request_id) or None)
        bound = admission_blocks(cfg.window(self.block_size), self.kv_cache_spec.evict_max_in_flight)
        logger.info(
            "kvevict: request %s released: %d blocks freed by eviction, peak %d blocks held "
            "(window bound %s); pool %d/%d blocks free, peak %d used; policy %s, budget %d",
            request_id, st[0], st[1], bound, pool.get_num_free_blocks(),
            pool.num_gpu_blocks - 1, self.pool_peak_used, cfg.policy if cfg.eviction_active else "none",
            cfg.budget,
        )

    @property
    def tracked_requests(self) -> int:
        """Requests this manager holds bookkeeping for (0 when nothing is allocated)."""
        return len(self._stats)

    def window_for(self, request_id: str) -> WindowConfig:
        """The server's window, or the request's own when it overrides policy/budget/enabled."""
        spec = self.kv_cache_spec
        overrides = REQUEST_OVERRIDES.get(request_id)
        # The same resolution as the workers' (backends/plan.py), so both sides agree on E.
        return request_config(spec.config, overrides).window(spec.block_size) if overrides else spec.window

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        window = self.window_for(request_id)
        if num_prompt_tokens is None:
            if window.trigger != "chunked" or not window.decode:
                return  # E depends on the prompt length; without it, free nothing (never too much)
            num_prompt_tokens = processed_computed_tokens
        e = evicted_tokens(processed_computed_tokens, num_prompt_tokens, window, SHARED.get(request_id, 0))
        if e <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        n_evicted = min(e // self.block_size, len(blocks))
        st = self._stats.setdefault(request_id, [0, 0])
        if st[0] == 0 and n_evicted > 0:
            # The first compaction: the blocks it frees were computed before anything was evicted
            # and were never rewritten: hash them now, so they go back as free-but-cached blocks.
            self._cache_pure(request_id, n_evicted * self.block_size)
        # Backward scan that stops at the first null block: frees exactly [E_prev/bs, E/bs).
        self._remove_blocks_in_range(request_id, 0, n_evicted)
        freed = n_evicted - st[0]
        st[0] = max(st[0], n_evicted)
        if freed > 0 and self._metrics is not None:  # the window moved: one compaction on the workers
            policy = request_config(self.kv_cache_spec.config, REQUEST_OVERRIDES.get(request_id) or None).policy
            self._metrics.inc("blocks_freed", policy, freed)
            self._metrics.inc("tokens_evicted", policy, freed * self.block_size)
            self._metrics.inc("compactions", policy)
            self._track_window(request_id)

    def cache_blocks(self, request, num_tokens, retention_interval=None, *, replay_boundaries) -> None:
        """vLLM hashes the blocks a step fills as it schedules the step. A request whose window
        may evict hashes nothing here (a block it computes now may be rewritten by its compaction
        or computed after an eviction); its pure blocks are hashed when they leave the window or
        when it is freed (:meth:`_cache_pure`). Any other request: vLLM's own caching."""
        if self.window_for(request.request_id).enabled:
            return
        super().cache_blocks(request, num_tokens, retention_interval, replay_boundaries=replay_boundaries)

    def _cache_pure(self, request_id: str, num_tokens: int) -> None:
        """Hash the request's blocks up to ``num_tokens`` (a multiple of the block size), whose KV
        is what vLLM would compute for their tokens without eviction."""
        request = REQUESTS.get(request_id)
        if not self.enable_caching or request is None or num_tokens <= 0:
            return
        super().cache_blocks(request, num_tokens, replay_boundaries=())

    def _cache_if_never_compacted(self, request_id: str) -> None:
        """A request freed before its first compaction computed every block without eviction."""
        st = self._stats.get(request_id)
        request = REQUESTS.get(request_id)
        if request is not None and (st is None or st[0] == 0) and self.window_for(request_id).enabled:
            computed = min(request.num_computed_tokens, len(self.req_to_blocks.get(request_id, ())) * self.block_size)
            self._cache_pure(request_id, computed // self.block_size * self.block_size)

    def usable_hit(self, request, num_tokens: int) -> int:
        """How many of ``num_tokens`` prefix-cache hit tokens the request may use: all of them
        when its window never evicts; none when its policy keeps per-slot state (the state of a
        shared block is another request's); with a bounded window (``chunked``, evicting while
        decoding), as many as keep its peak (bound plus the hit) inside the pool, so it can always
        finish alone; otherwise (``once``, or no eviction while decoding: ``E`` is fixed once the
        prompt is done) at most what its eviction moves past by the end of its prompt, so that it
        still evicts."""
        if num_tokens <= 0:
            return 0
        cfg = request_config(self.kv_cache_spec.config, request_overrides(vllm_kv_cache.request_extra_args(request)))
        window = cfg.window(self.block_size)
        if not window.enabled:
            return num_tokens
        if get_policy(cfg.policy, cfg.policy_params).slot_state:
            return 0
        bound = admission_blocks(window, self.kv_cache_spec.evict_max_in_flight)
        if bound is not None:
            return max(0, min(num_tokens, (self.block_pool.num_gpu_blocks - 1 - bound) * self.block_size))
        prompt = request.num_prompt_tokens
        return min(num_tokens, evicted_tokens(prompt, prompt, window))


_metrics_owner: KVEvictManager | None = None

#: Engine-core process: request id -> its kvevict overrides (set when vLLM first allocates for it).
REQUEST_OVERRIDES: dict[str, tuple] = {}
#: request id -> the request (vLLM's), while it holds blocks: its block hashes, for the prefix cache
REQUESTS: dict[str, object] = {}
#: request id -> the prefix-cache hit it started its current attempt on (tokens, read-only)
SHARED: dict[str, int] = {}


def install_scheduler_hooks() -> None:
    """Record each request's kvevict overrides for the manager when vLLM first allocates for it,
    the prefix-cache hit it may use, and forget both on vLLM's free paths. Idempotent."""

    def on_allocate(request) -> None:
        rid = request.request_id
        if rid not in REQUEST_OVERRIDES:
            REQUEST_OVERRIDES[rid] = request_overrides(vllm_kv_cache.request_extra_args(request)) or ()
        REQUESTS[rid] = request

    def on_end(request_id: str) -> None:
        REQUEST_OVERRIDES.pop(request_id, None)
        REQUESTS.pop(request_id, None)
        SHARED.pop(request_id, None)

    def on_prefix_hit(request, num_tokens: int, managers: list) -> int:
        ours = [m for m in managers if isinstance(m, KVEvictManager)]
        allowed = min([m.usable_hit(request, num_tokens) for m in ours], default=num_tokens)
        SHARED[request.request_id] = allowed
        return allowed

    vllm_kv_cache.install_request_hooks(on_allocate, on_end, on_prefix_hit)


def register_spec() -> None:
    """Map KVEvictSpec to KVEvictManager in vLLM's registry (idempotent; engine-core process)."""
    vllm_kv_cache.register_spec(KVEvictSpec, KVEvictManager)
