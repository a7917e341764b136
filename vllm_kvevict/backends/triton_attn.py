# SPDX-License-Identifier: Apache-2.0
"""The kvevict attention backend on vLLM's ``TRITON_ATTN``: the CUDA base where FlashAttention
refuses the configuration (:func:`vllm_kvevict.backends.flash_attn.choose_base` decides; the
CUDA-graph behaviour, documented there, is the same for both bases). Not to be confused with the
Triton *eviction* kernels (:mod:`vllm_kvevict.kernels.triton_ops`), which run under either base.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvevict.backends.base import KVEvictBackendMixin, KVEvictBuilderMixin, KVEvictImplMixin, KVEvictMetadata
from vllm_kvevict.backends.flash_layout import FLASH_LAYOUT, FlashLayout
from vllm_kvevict.backends.plan import StepPlan
from vllm_kvevict.vllm_compat.attention import TRITON_ATTN, AttentionCGSupport


@dataclass
class KVEvictTritonAttentionMetadata(KVEvictMetadata, TRITON_ATTN.metadata):
    kvevict_plan: StepPlan | None = None


class KVEvictTritonAttentionImpl(KVEvictImplMixin, TRITON_ATTN.impl):
    kvevict_base = TRITON_ATTN.name

    def kvevict_layout(self, layer) -> FlashLayout:
        return FLASH_LAYOUT


class KVEvictTritonAttentionMetadataBuilder(KVEvictBuilderMixin, TRITON_ATTN.builder):
    kvevict_metadata = KVEvictTritonAttentionMetadata
    # Host-planned windows and data-dependent compaction: no full CUDA graphs (flash_attn.py).
    _cudagraph_support = AttentionCGSupport.NEVER


class KVEvictTritonAttentionBackend(KVEvictBackendMixin, TRITON_ATTN.backend):
    @staticmethod
    def get_impl_cls() -> type[KVEvictTritonAttentionImpl]:
        return KVEvictTritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVEvictTritonAttentionMetadataBuilder]:
        return KVEvictTritonAttentionMetadataBuilder
