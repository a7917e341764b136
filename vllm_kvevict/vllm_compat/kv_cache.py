"""The engine core's KV cache: spec and manager bases, the spec registry, per-request hooks.

Written against vLLM 0.32.0 (``v1/kv_cache_interface.py``, ``v1/core/single_type_kv_cache_manager.py``,
``v1/kv_cache_spec_registry.py``, ``v1/core/kv_cache_manager.py``); 0.33.0 has the same classes and
signatures, with two differences that do not reach the plugin:

* ``KVCacheSpec.is_draft`` (0.33): a ``kw_only``, ``compare=False`` field; ``KVEvictSpec.from_spec``
  copies every init field of ``FullAttentionSpec`` whatever they are, so it is carried over.
* ``SingleTypeKVCacheManager.pop_blocks_for_free`` (0.33) strips leading null blocks (those eviction
  leaves) before handing the list to the block pool; the plugin's override passes the list on.

KV cache planning moved from ``v1/core/kv_cache_utils.py`` to a new module,
``vllm.v1.core.kv_cache_planning``, in 0.33; the plugin reaches it only through
``KVCacheSpec.max_memory_usage_bytes(vllm_config)``, whose signature is the same in both.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_kvevict.vllm_compat.patching import wrap_method

__all__ = ["FullAttentionManager", "FullAttentionSpec", "install_request_hooks", "register_spec", "request_extra_args"]


def register_spec(spec_cls: type, manager_cls: type) -> None:
    """Map ``spec_cls`` to ``manager_cls`` in vLLM's registry (idempotent; engine-core process)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    # Without this first, registering a spec makes the registry skip the built-in specs.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(spec_cls, manager_cls, uniform_type_base_spec=FullAttentionSpec)


def request_extra_args(request) -> dict | None:
    """A request's sampling parameters' ``extra_args`` (where ``vllm_xargs`` arrive)."""
    return getattr(getattr(request, "sampling_params", None), "extra_args", None)


def install_request_hooks(
    on_allocate: Callable[[object], None],
    on_end: Callable[[str], None],
    on_prefix_hit: Callable[[object, int, list], int],
) -> None:
    """The single-type managers only see request ids; ``KVCacheManager`` sees the request.

    ``on_allocate(request)`` runs before every ``allocate_slots``; ``on_end(request_id)`` after
    ``free`` and after ``pop_blocks_for_free`` (the deferred-free path of
    ``Scheduler._free_request_blocks``), so per-request state ends on both of vLLM's free paths;
    ``on_prefix_hit(request, num_tokens, single_type_managers)`` sees every prefix-cache lookup
    (``get_computed_blocks``, run when a request is scheduled from the waiting queue: new or
    preempted) and returns how many of the hit tokens the request may use (a multiple of the block
    size, at most ``num_tokens``); the hit is cut to that. vLLM 0.32/0.33: ``get_computed_blocks``
    returns ``(KVCacheBlocks, num_tokens, shared_prefix_boundary)``.
    """
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    def make_allocate(orig):
        def allocate_slots(self, request, *args, **kwargs):
            on_allocate(request)
            return orig(self, request, *args, **kwargs)

        return allocate_slots

    def make_end(orig):
        def end(self, request, *args, **kwargs):
            try:
                return orig(self, request, *args, **kwargs)
            finally:
                on_end(request.request_id)

        return end

    def make_lookup(orig):
        def get_computed_blocks(self, request):
            blocks, num_tokens, boundary = orig(self, request)
            managers = list(self.coordinator.single_type_managers)
            allowed = on_prefix_hit(request, num_tokens, managers)
            if allowed < num_tokens:
                keep = [allowed // m.block_size for m in managers]
                blocks = self.create_kv_cache_blocks(tuple(list(g[:k]) for g, k in zip(blocks.blocks, keep)))
                num_tokens, boundary = allowed, 0
            return blocks, num_tokens, boundary

        return get_computed_blocks

    wrap_method(KVCacheManager, "allocate_slots", make_allocate, "kvevict: record each request's overrides")
    wrap_method(KVCacheManager, "free", make_end, "kvevict: forget a request's overrides")
    wrap_method(KVCacheManager, "pop_blocks_for_free", make_end, "kvevict: forget a request's overrides (deferred free)")
    wrap_method(KVCacheManager, "get_computed_blocks", make_lookup, "kvevict: prefix-cache hits a window can use")
