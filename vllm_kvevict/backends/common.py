"""What the CPU and CUDA backends share (written against vLLM 0.32.0).

The backend is registered on ``AttentionBackendEnum.CUSTOM``, so ``get_name()`` must return
``"CUSTOM"``: ``Attention.__init__`` maps the name back to an enum member, and CUSTOM is the only
member that survives pickling into the spawned engine-core and worker processes
(VLLM_INTEGRATION.md sections 1.3-1.4).
"""

from __future__ import annotations

import os

from vllm_kvevict._logging import info_once
from vllm_kvevict.config import KVEvictConfig, config_from_vllm

BACKEND_NAME = "CUSTOM"


class KVEvictImplMixin:
    """Mixed into vLLM's attention impls: resolves the plugin config once per layer."""

    kvevict_config: KVEvictConfig

    def _kvevict_init(self, base_name: str) -> None:
        from vllm.config import get_current_vllm_config

        self.kvevict_config = config_from_vllm(get_current_vllm_config())
        self._kvevict_base = base_name
        info_once(
            f"kvevict: attention backend {type(self).__name__} (base {base_name}) in pid {os.getpid()}; "
            f"{self.kvevict_config.summary()}; note: this version does not evict yet, the KV cache is kept in full"
        )
        self._kvevict_forward_seen = False

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        if not self._kvevict_forward_seen and attn_metadata is not None:
            self._kvevict_forward_seen = True
            name = getattr(layer, "layer_name", type(layer).__name__)
            info_once(f"kvevict: first forward through {type(self).__name__} ({name})", key="forward")
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

