"""The kvevict attention backend on CUDA: ``FLASH_ATTN`` subclassed (written against vLLM 0.32.0).

Inherits FlashAttention's ``validate_configuration`` answers (head sizes, dtypes, block sizes), so
``--attention-backend kvevict`` is accepted wherever FLASH_ATTN would be. CI cannot run vLLM on a
GPU; this module is import-tested on CPU only.
"""

from __future__ import annotations

from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
)

from vllm_kvevict.backends.common import BACKEND_NAME, KVEvictImplMixin


class KVEvictFlashAttentionImpl(KVEvictImplMixin, FlashAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kvevict_init("FLASH_ATTN")


class KVEvictFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[KVEvictFlashAttentionImpl]:
        return KVEvictFlashAttentionImpl
