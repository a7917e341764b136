# SPDX-License-Identifier: Apache-2.0
"""What the seam (vllm_kvevict/vllm_compat/) assumes of vLLM, checked against the installed vLLM:
every method it wraps exists with the parameters its wrapper passes on, every class it subclasses
has the constructor the plugin calls, every attribute the runner hook reads is set where the hook
reads it. Runs on vLLM 0.32 (make test) and 0.33 (make test-vllm033): an upgrade that breaks one of
these assumptions fails here, by name, before any server starts."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("vllm")

from vllm_kvevict.vllm_compat import SUPPORTED, vllm_version, vllm_version_is  # noqa: E402


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _starts_with(fn, *names: str) -> None:
    got = _params(fn)
    assert got[: len(names)] == list(names), f"{fn.__qualname__}{inspect.signature(fn)}: expected {names} first"


def test_installed_vllm_is_supported():
    assert vllm_version_is(*SUPPORTED), vllm_version()


def test_runner_methods_the_step_hook_wraps():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_kvevict.vllm_compat.patching import _lookup

    def raw(name):
        return _lookup(GPUModelRunner, name)  # the function as defined, before any wrap

    _starts_with(raw("_build_attention_metadata"), "self", "num_tokens", "num_reqs")
    _starts_with(raw("execute_model"), "self", "scheduler_output")
    _starts_with(raw("_dummy_run"), "self")
    _starts_with(raw("_sample"), "self")
    _starts_with(raw("_bookkeeping_sync"), "self")
    # The CPU generator fix reads these; the rewind it replaces must still be there.
    src = inspect.getsource(raw("_bookkeeping_sync"))
    assert "set_offset" in src and "discard_request_mask" in inspect.getsource(GPUModelRunner)


def test_input_batch_fields_the_step_hook_reads():
    from vllm.v1.worker import gpu_input_batch

    src = inspect.getsource(gpu_input_batch.InputBatch)
    for field in ("self.req_ids", "self.num_prompt_tokens", "self.num_tokens_no_spec", "self.generators"):
        assert field in src or field.replace("self.", "def ") in src, field
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    assert "sampling_params" in CachedRequestState.__dataclass_fields__


def test_scheduler_side_methods():
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    _starts_with(KVCacheManager.allocate_slots, "self", "request", "num_new_tokens", "num_new_computed_tokens")
    assert "num_external_computed_tokens" in _params(KVCacheManager.allocate_slots)  # read by the schedule hook
    _starts_with(KVCacheManager.get_computed_blocks, "self", "request")  # 0.33 adds max_cache_hit_length
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    _starts_with(KVCacheCoordinator.find_longest_cache_hit, "self", "block_hashes", "max_cache_hit_length")
    _starts_with(KVCacheManager.free, "self", "request")
    _starts_with(KVCacheManager.pop_blocks_for_free, "self", "request")
    _starts_with(
        FullAttentionManager.remove_skipped_blocks,
        "self",
        "request_id",
        "processed_computed_tokens",
        "num_prompt_tokens",
    )
    _starts_with(FullAttentionManager.get_num_blocks_to_allocate, "self", "request_id", "num_tokens")
    assert "apply_admission_cap" in _params(FullAttentionManager.get_num_blocks_to_allocate)
    _starts_with(FullAttentionManager.allocate_new_blocks, "self", "request_id", "num_tokens")
    assert "replay_boundaries" in _params(FullAttentionManager.cache_blocks)
    for name in ("_remove_blocks_in_range", "pop_blocks_for_free", "free"):
        assert callable(getattr(FullAttentionManager, name)), name
    assert "uniform_type_base_spec" in _params(KVCacheSpecRegistry.register)
    assert callable(KVCacheSpecRegistry._ensure_registered)


def test_what_compacted_windows_use():
    """The scheduler's last cap on a step (kv_cache.RequestHooks.chunk), vLLM's block
    hash, its cache map and its insertion of a block under a hash (window_block_keys, cache_block,
    cached_block), the lookup switch and the in-flight count (processed_tokens)."""
    from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, make_block_hash_with_group_id
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    from vllm_kvevict.vllm_compat.patching import _lookup

    _starts_with(
        _lookup(Scheduler, "_reserve_prefill_lookahead"), "self", "request", "num_computed_tokens", "num_new_tokens"
    )
    _starts_with(hash_block_tokens, "hash_function", "parent_block_hash", "curr_block_token_ids", "extra_keys")
    _starts_with(make_block_hash_with_group_id, "block_hash", "group_id")
    _starts_with(BlockPool._insert_block_hash, "self", "block_hash_with_group_id", "block", "num_tokens")
    _starts_with(BlockHashToBlockMap.get_one_block, "self", "key")
    _starts_with(KVCacheManager.prefix_cache_lookup_enabled, "self", "request")
    _starts_with(KVCacheManager.create_kv_cache_blocks, "self", "blocks")
    assert "num_in_flight_tokens" in inspect.getsource(Request.__init__)


def test_attention_classes_the_plugin_subclasses():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_kvevict.vllm_compat import attention

    assert AttentionBackendEnum.CUSTOM.name == attention.CUSTOM_NAME
    for name in ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN"):
        base = getattr(attention, name)
        _starts_with(base.builder.__init__, "self", "kv_cache_spec", "layer_names", "vllm_config", "device")
        _starts_with(base.builder.build, "self", "common_prefix_len", "common_attn_metadata", "fast_build")
        _starts_with(base.impl.forward, "self", "layer", "query", "key", "value", "kv_cache", "attn_metadata")
        assert callable(base.backend.customize_spec) if hasattr(base.backend, "customize_spec") else True


def test_selectors_and_engine_hooks():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.engine.input_processor import InputProcessor

    _starts_with(CpuPlatform.get_attn_backend_cls.__func__, "cls", "selected_backend", "attn_selector_config")
    _starts_with(CpuPlatform.check_and_update_config.__func__, "cls", "vllm_config")
    _starts_with(InputProcessor.process_inputs, "self", "request_id", "prompt", "params")
    assert "enable_prefix_caching" in EngineArgs.__dataclass_fields__
    _starts_with(EngineArgs.create_engine_config, "self")


def test_model_runner_v2_choice_is_a_config_property():
    """``require_v1_runner`` reads ``VllmConfig.use_v2_model_runner`` and the V1-unsupported
    feature list; both must exist (0.32 and 0.33)."""
    from vllm.config import VllmConfig

    assert isinstance(inspect.getattr_static(VllmConfig, "use_v2_model_runner"), property)
    assert callable(VllmConfig._get_v1_model_runner_unsupported_features)


def test_what_carries_a_fallback_to_the_engine_core():
    """A worker's fallback reaches the engine core on the step's output (runner.install_output_hook,
    kv_cache's update_from_output hook), agreed over the tensor-parallel group's CPU communicator
    (distributed.union_over_ranks); a window computed twice is replaced through vLLM's own eviction
    of cached blocks (kv_cache.uncache_blocks)."""
    import dataclasses

    from vllm.distributed.parallel_state import GroupCoordinator
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import AsyncGPUModelRunnerOutput, GPUModelRunner

    from vllm_kvevict.vllm_compat.patching import _lookup

    _starts_with(_lookup(GPUModelRunner, "sample_tokens"), "self", "grammar_output")
    _starts_with(_lookup(GPUModelRunner, "_pool"), "self")
    assert "self._model_runner_output = model_runner_output" in inspect.getsource(AsyncGPUModelRunnerOutput)
    assert "return output" in inspect.getsource(AsyncGPUModelRunnerOutput.get_output)
    assert dataclasses.is_dataclass(ModelRunnerOutput) and not hasattr(ModelRunnerOutput, "__slots__")
    assert isinstance(EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput)
    _starts_with(_lookup(Scheduler, "update_from_output"), "self", "scheduler_output", "model_runner_output")
    _starts_with(BlockPool.evict_blocks, "self", "block_ids")
    assert "cpu_group" in GroupCoordinator.__annotations__


def test_what_tells_which_layers_evict():
    """The worker's KV cache specs (runner.install_spec_check) and the configuration the start-up
    check reads (plugin._refuse_models_without_evictable_layers): vLLM gives every layer the
    model's sliding window through ``CacheConfig.sliding_window`` exactly when no layer is full
    attention (``EngineArgs.create_engine_config``), and says whether the model runs MLA."""
    from vllm.config import CacheConfig, ModelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_kvevict.vllm_compat.patching import _lookup

    assert _params(_lookup(GPUModelRunner, "get_kv_cache_spec")) == ["self"]
    assert "sliding_window" in CacheConfig.__dataclass_fields__
    assert isinstance(inspect.getattr_static(ModelConfig, "use_mla"), property)
    src = inspect.getsource(EngineArgs.create_engine_config)
    assert 'all(lt == "sliding_attention" for lt in layer_types)' in src and "sliding_window=sliding_window" in src
