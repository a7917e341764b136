"""The kvevict attention backend on vLLM's ``TRITON_ATTN``: the CUDA base where FlashAttention
refuses the configuration (:func:`vllm_kvevict.backends.flash_attn.choose_base` decides; the
CUDA-graph behaviour, documented there, is the same for both bases). Not to be confused with the
Triton *eviction* kernels (:mod:`vllm_kvevict.kernels.triton_ops`), which run under either base.
"""

from __future__ import annotations

from vllm_kvevict.backends.common import make_backend
from vllm_kvevict.backends.flash_layout import FlashLayoutMixin
from vllm_kvevict.vllm_compat.attention import TRITON_ATTN, AttentionCGSupport

KVEvictTritonAttentionBackend, KVEvictTritonAttentionImpl, KVEvictTritonAttentionMetadataBuilder = make_backend(
    __name__, "TritonAttention", TRITON_ATTN, FlashLayoutMixin, cudagraph_support=AttentionCGSupport.NEVER
)
