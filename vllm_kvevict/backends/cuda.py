"""The kvevict attention backend on CUDA: ``FLASH_ATTN`` subclassed (written against vLLM 0.32.0).

Inherits FlashAttention's ``validate_configuration`` answers (head sizes, dtypes, block sizes), so
``--attention-backend kvevict`` is accepted wherever FLASH_ATTN would be. CI cannot run vLLM on a
GPU: this module is import-tested on CPU, and the cache reads/writes it uses
(``kernels/flash_cache.py``) are tested on CPU tensors. The eviction path itself is the one the CPU
backend runs (``backends/common.py``).
"""

from __future__ import annotations

from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from vllm_kvevict.backends.common import KVEvictBackendMixin, KVEvictBuilderMixin, KVEvictImplMixin
from vllm_kvevict.kernels.flash_cache import gather_tokens, write_tokens


class KVEvictFlashAttentionImpl(KVEvictImplMixin, FlashAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kvevict_init("FLASH_ATTN")

    def _kvevict_gather(self, layer, kv_cache, blocks, offsets):
        return gather_tokens(kv_cache, blocks, offsets)

    def _kvevict_write(self, layer, kv_cache, slots, K, V):
        write_tokens(kv_cache, slots, K, V)


class KVEvictFlashAttentionMetadataBuilder(KVEvictBuilderMixin, FlashAttentionMetadataBuilder):
    # The shifted block table and lengths are new tensors each step: no full CUDA graphs
    # (vLLM then runs attention eagerly inside piecewise graphs).
    _cudagraph_support = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._kvevict_builder_init(kv_cache_spec.block_size, vllm_config)


class KVEvictFlashAttentionBackend(KVEvictBackendMixin, FlashAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[KVEvictFlashAttentionImpl]:
        return KVEvictFlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVEvictFlashAttentionMetadataBuilder]:
        return KVEvictFlashAttentionMetadataBuilder
