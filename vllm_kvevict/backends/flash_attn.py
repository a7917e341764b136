# SPDX-License-Identifier: Apache-2.0
"""The kvevict attention backends on CUDA: vLLM's ``FLASH_ATTN`` with eviction, and the choice of base.

Two of vLLM's backends subclassed, the same way:

* ``FLASH_ATTN`` (:class:`KVEvictFlashAttentionBackend`), the default where FlashAttention accepts
  the configuration (its own ``validate_configuration`` answers: head sizes, dtypes, compute
  capability, block sizes);
* ``TRITON_ATTN`` (:class:`KVEvictTritonAttentionBackend`, ``backends/triton_attn.py``), the fallback
  base (fp32 models, GPUs or head sizes FlashAttention refuses), or forced with
  ``KVEVICT_CUDA_BASE=triton_attn``. :func:`choose_base` decides, per worker, at backend selection.

Both bind each layer's cache as ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` and view
it as ``K, V = cache.transpose(1, 2).split(head_dim, -1)``, ``[num_blocks, block_size, H, D]``
strided views: :class:`~vllm_kvevict.backends.flash_layout.FlashLayout` reads and writes
tokens through them. The eviction path itself is the one the CPU backend runs
(``backends/layer.py``), with the batched kernels of ``kernels/ops.py`` (Triton on CUDA tensors).

CUDA graphs: the builders declare ``AttentionCGSupport.NEVER``. The step's window (shifted block
table, physical lengths) is planned on the host every step and the compaction that follows
attention has data-dependent shapes, so neither can live inside a captured graph. vLLM 0.32 and 0.33
resolve its default ``FULL_AND_PIECEWISE`` to ``PIECEWISE`` for such a backend (attention is a
splitting op, run eagerly between the captured pieces); an explicit ``FULL`` mode is refused by
vLLM with its own message (tests/test_registration.py checks both against vLLM's resolver).
CI cannot run vLLM on a GPU: these modules are import-tested on CPU, and everything below vLLM
(cache views, kernels) is tested on CPU tensors and, when a GPU is lent, on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvevict import envs
from vllm_kvevict.backends import FLASH_ATTN_BACKEND as FLASH_PATH
from vllm_kvevict.backends import TRITON_BACKEND as TRITON_PATH
from vllm_kvevict.backends.base import KVEvictBackendMixin, KVEvictBuilderMixin, KVEvictImplMixin, KVEvictMetadata
from vllm_kvevict.backends.flash_layout import FLASH_LAYOUT, FlashLayout
from vllm_kvevict.backends.plan import StepPlan
from vllm_kvevict.vllm_compat.attention import FLASH_ATTN, AttentionCGSupport


@dataclass
class KVEvictFlashAttentionMetadata(KVEvictMetadata, FLASH_ATTN.metadata):
    kvevict_plan: StepPlan | None = None


class KVEvictFlashAttentionImpl(KVEvictImplMixin, FLASH_ATTN.impl):
    kvevict_base = FLASH_ATTN.name

    def kvevict_layout(self, layer) -> FlashLayout:
        return FLASH_LAYOUT


class KVEvictFlashAttentionMetadataBuilder(KVEvictBuilderMixin, FLASH_ATTN.builder):
    kvevict_metadata = KVEvictFlashAttentionMetadata
    # Host-planned windows and data-dependent compaction: no full CUDA graphs (see the module doc).
    _cudagraph_support = AttentionCGSupport.NEVER


class KVEvictFlashAttentionBackend(KVEvictBackendMixin, FLASH_ATTN.backend):
    @staticmethod
    def get_impl_cls() -> type[KVEvictFlashAttentionImpl]:
        return KVEvictFlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVEvictFlashAttentionMetadataBuilder]:
        return KVEvictFlashAttentionMetadataBuilder


def choose_base(device_capability, attn_selector_config) -> tuple[str, list[str]]:
    """The backend class path to use on this GPU, and FlashAttention's reasons when it was refused.

    ``attn_selector_config``: vLLM's ``AttentionSelectorConfig`` (what ``validate_configuration``
    takes, with the device capability).
    """
    choice = envs.KVEVICT_CUDA_BASE
    if choice not in ("auto", "flash_attn", "triton_attn"):
        raise ValueError(f"kvevict: KVEVICT_CUDA_BASE={choice!r}; expected auto, flash_attn or triton_attn")
    if choice == "triton_attn":
        return TRITON_PATH, []
    if choice == "flash_attn":
        return FLASH_PATH, []
    try:
        reasons = KVEvictFlashAttentionBackend.validate_configuration(
            device_capability=device_capability, **attn_selector_config._asdict()
        )
    except (ImportError, OSError) as e:
        reasons = [f"{type(e).__name__}: {e}"]
    return (TRITON_PATH, list(reasons)) if reasons else (FLASH_PATH, [])
