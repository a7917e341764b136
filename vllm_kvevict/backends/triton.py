"""The kvevict attention backend on ``TRITON_ATTN`` (written against vLLM 0.32.0): the CUDA
fallback base where FlashAttention refuses the configuration (``backends/cuda.py`` decides and
documents the CUDA-graph behaviour, which is the same for both bases)."""

from __future__ import annotations

from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

from vllm_kvevict.backends.common import KVEvictBackendMixin, KVEvictBuilderMixin, KVEvictImplMixin
from vllm_kvevict.backends.cuda import FlashLayoutMixin


class KVEvictTritonAttentionImpl(FlashLayoutMixin, KVEvictImplMixin, TritonAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kvevict_init("TRITON_ATTN")


class KVEvictTritonAttentionMetadataBuilder(KVEvictBuilderMixin, TritonAttentionMetadataBuilder):
    _cudagraph_support = AttentionCGSupport.NEVER  # as for FLASH_ATTN: see backends/cuda.py

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._kvevict_builder_init(kv_cache_spec.block_size, vllm_config)


class KVEvictTritonAttentionBackend(KVEvictBackendMixin, TritonAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[KVEvictTritonAttentionImpl]:
        return KVEvictTritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVEvictTritonAttentionMetadataBuilder]:
        return KVEvictTritonAttentionMetadataBuilder
