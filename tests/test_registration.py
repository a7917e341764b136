"""register(): the entry point, the CUSTOM override, the `kvevict` alias, the CPU selector, idempotence."""

from __future__ import annotations

import importlib.metadata as md

import pytest
import torch

import vllm_kvevict
from vllm_kvevict import plugin
from vllm_kvevict.backends import CPU_BACKEND


@pytest.fixture(scope="module")
def registered():
    vllm_kvevict.register()
    return True


def test_entry_point_installed():
    (ep,) = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "kvevict"]
    assert ep.value == "vllm_kvevict:register"
    assert ep.load() is vllm_kvevict.register


def test_cli_names_resolve_to_custom(registered):
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for name in ("kvevict", "KVEVICT", "custom"):
        assert AttentionConfig.validate_backend_before(name) is AttentionBackendEnum.CUSTOM
    assert AttentionBackendEnum.CUSTOM.get_path() == CPU_BACKEND
    # An unknown name still fails as in stock vLLM.
    with pytest.raises(ValueError):
        AttentionConfig.validate_backend_before("kvevictt")


def test_cpu_selector_honours_custom_only(registered):
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    sel = AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=32)
    assert CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, sel) == CPU_BACKEND
    stock = AttentionBackendEnum.CPU_ATTN.get_path()
    assert CpuPlatform.get_attn_backend_cls(None, sel) == stock
    assert CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CPU_ATTN, sel) == stock


def test_backend_classes(registered):
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cls = resolve_obj_by_qualname(CPU_BACKEND)
    assert issubclass(cls, CPUAttentionBackend)
    assert issubclass(cls.get_impl_cls(), CPUAttentionBackendImpl)
    # Attention.__init__ maps get_name() back to an enum member: it must be CUSTOM.
    assert AttentionBackendEnum[cls.get_name()] is AttentionBackendEnum.CUSTOM
    from vllm_kvevict.backends.cuda import KVEvictFlashAttentionBackend  # importable without a GPU

    assert AttentionBackendEnum[KVEvictFlashAttentionBackend.get_name()] is AttentionBackendEnum.CUSTOM


def test_register_is_idempotent(registered):
    from vllm.platforms.cpu import CpuPlatform

    before = (CpuPlatform.get_attn_backend_cls, CpuPlatform.check_and_update_config)
    plugin._registered = False  # force the body to run again, as a second plugin load would
    vllm_kvevict.register()
    vllm_kvevict.register()
    assert (CpuPlatform.get_attn_backend_cls, CpuPlatform.check_and_update_config) == before


def test_unsupported_vllm_version_is_refused(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    monkeypatch.delenv(plugin.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(RuntimeError, match="supports vLLM 0.32.x but found 0.40.1"):
        plugin._check_vllm_version()
    monkeypatch.setenv(plugin.ALLOW_UNTESTED_ENV, "1")
    plugin._check_vllm_version()
