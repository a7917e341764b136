"""``KVEvictSpec`` and its manager: free the leading blocks the window has left behind.

Written against vLLM 0.32.0 (``v1/kv_cache_interface.py``, ``v1/core/single_type_kv_cache_manager.py``,
``v1/kv_cache_spec_registry.py``). The worker's backend turns each plain ``FullAttentionSpec`` into a
``KVEvictSpec`` (``AttentionBackend.customize_spec``); the spec is pickled to the engine core,
where the registry maps it to :class:`KVEvictManager`. The manager is a ``FullAttentionManager``
whose ``remove_skipped_blocks`` (called from ``KVCacheManager.allocate_slots`` with the number of
*processed* tokens every time the request is scheduled) nulls and frees logical blocks
``[0, E / block_size)`` with ``E = evicted_tokens(...)``, exactly as sliding-window attention does.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Self

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_kvevict.window import WindowConfig, evicted_tokens, window_bound_blocks


@dataclass(frozen=True, kw_only=True)
class KVEvictSpec(FullAttentionSpec):
    """A full-attention layer whose per-request KV is bounded by the kvevict window."""

    evict_budget: int
    evict_trigger: str = "chunked"
    evict_decode: bool = True
    evict_max_chunk: int = 0  # the scheduler's token budget per step (bounds the in-step peak)

    @property
    def window(self) -> WindowConfig:
        return WindowConfig(
            budget=self.evict_budget, block_size=self.block_size, trigger=self.evict_trigger,  # type: ignore[arg-type]
            decode=self.evict_decode,
        )

    @classmethod
    def from_spec(cls, spec: FullAttentionSpec, window: WindowConfig, max_chunk: int) -> KVEvictSpec:
        base = {f.name: getattr(spec, f.name) for f in fields(FullAttentionSpec) if f.init}
        return cls(**base, evict_budget=window.budget, evict_trigger=window.trigger, evict_decode=window.decode,
                   evict_max_chunk=max_chunk)

    def max_memory_usage_bytes(self, vllm_config) -> int:
        full = super().max_memory_usage_bytes(vllm_config)
        if self.evict_trigger != "chunked":  # nothing is evicted before the prompt is complete
            return full
        chunk = self.evict_max_chunk or vllm_config.scheduler_config.max_num_batched_tokens
        return min(full, window_bound_blocks(self.window, chunk) * self.page_size_bytes)

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        merged = FullAttentionSpec.merge.__func__(FullAttentionSpec, specs)  # checks the common fields
        first = specs[0]
        extra = ("evict_budget", "evict_trigger", "evict_decode", "evict_max_chunk")
        for s in specs:
            assert all(getattr(s, k) == getattr(first, k) for k in extra), "kvevict layers disagree on the window"
        return cls.from_spec(merged, first.window, first.evict_max_chunk)


class KVEvictManager(FullAttentionManager):
    """Frees the blocks of evicted tokens as soon as the processed-token count crosses a trigger."""

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        window = self.kv_cache_spec.window
        if num_prompt_tokens is None:
            if window.trigger != "chunked" or not window.decode:
                return  # E depends on the prompt length; without it, free nothing (never too much)
            num_prompt_tokens = processed_computed_tokens
        e = evicted_tokens(processed_computed_tokens, num_prompt_tokens, window)
        if e <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        # Backward scan that stops at the first null block: frees exactly [E_prev/bs, E/bs).
        self._remove_blocks_in_range(request_id, 0, min(e // self.block_size, len(blocks)))

    def cache_blocks(self, request, num_tokens, retention_interval=None, *, replay_boundaries) -> None:
        # Compaction rewrites blocks in place: they must never enter the prefix cache. The plugin
        # turns prefix caching off when eviction is on; this guards against it being on anyway.
        return None


def register_spec() -> None:
    """Map KVEvictSpec to KVEvictManager in vLLM's registry (idempotent; engine-core process)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    # Without this first, registering our spec makes the registry skip the built-in specs.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(KVEvictSpec, KVEvictManager, uniform_type_base_spec=FullAttentionSpec)
