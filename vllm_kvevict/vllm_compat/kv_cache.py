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

__all__ = ["FullAttentionManager", "FullAttentionSpec", "install_request_hooks", "register_spec"]


def register_spec(spec_cls: type, manager_cls: type) -> None:
    """Map ``spec_cls`` to ``manager_cls`` in vLLM's registry (idempotent; engine-core process)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    # Without this first, registering a spec makes the registry skip the built-in specs.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(spec_cls, manager_cls, uniform_type_base_spec=FullAttentionSpec)


def install_request_hooks(on_allocate: Callable[[str, dict | None], None], on_end: Callable[[str], None]) -> None:
    """The single-type managers only see request ids; ``KVCacheManager`` sees the request.

    ``on_allocate(request_id, extra_args)`` runs before every ``allocate_slots`` (the request's
    sampling parameters' ``extra_args``: where ``vllm_xargs`` arrive); ``on_end(request_id)`` after
    ``free`` and after ``pop_blocks_for_free`` (the deferred-free path of
    ``Scheduler._free_request_blocks``), so per-request state ends on both of vLLM's free paths.
    """
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    def make_allocate(orig):
        def allocate_slots(self, request, *args, **kwargs):
            params = getattr(request, "sampling_params", None)
            on_allocate(request.request_id, getattr(params, "extra_args", None))
            return orig(self, request, *args, **kwargs)

        return allocate_slots

    def make_end(orig):
        def end(self, request, *args, **kwargs):
            try:
                return orig(self, request, *args, **kwargs)
            finally:
                on_end(request.request_id)

        return end

    wrap_method(KVCacheManager, "allocate_slots", make_allocate, "kvevict: record each request's overrides")
    wrap_method(KVCacheManager, "free", make_end, "kvevict: forget a request's overrides")
    wrap_method(KVCacheManager, "pop_blocks_for_free", make_end, "kvevict: forget a request's overrides (deferred free)")
