# SPDX-License-Identifier: Apache-2.0
"""Each bad configuration stops `vllm serve` at start-up with one clear line, before any weight loads."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_kvevict.testing.server import CPU_BASE_ARGS, VLLMServer

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

CASES = {  # name: (--additional-config, KVEVICT_CONFIG, extra vllm args, the one line)
    "unknown_key": (
        {"kvevict": {"budgett": 64}},
        None,
        [],
        "invalid kvevict configuration (--additional-config): unknown key 'kvevict.budgett'; "
        "allowed keys: budget, cache_windows, caote, copy_rewritten, criticalkv, enabled, fastcaote, h2o, knorm, kvmerger, limits, lshe, policy, random, "
        "recall, snapkv, streamingllm, stride, trigger",
    ),
    "wrong_type": (
        {"kvevict": {"budget": "lots"}},
        None,
        [],
        "invalid kvevict configuration (--additional-config): kvevict.budget: Input should be a valid integer "
        '(got "lots"; allowed: an integer in [1, 1073741824])',
    ),
    "budget_below_minimum": (
        {"kvevict": {"policy": "streamingllm", "budget": 3}},
        None,
        [],
        "invalid kvevict configuration (--additional-config): kvevict.budget: budget 3 is below the minimum 5 "
        "for policy 'streamingllm' (its protected sink/recent tokens plus one)",
    ),
    "unknown_policy": (
        {"kvevict": {"policy": "h3o", "budget": 64}},
        None,
        [],
        "invalid kvevict configuration (--additional-config): kvevict.policy: unknown policy 'h3o'; "
        "allowed values: caote, criticalkv, fastcaote, h2o, keydiff, knorm, kvmerger, lshe, none, random, snapkv, "
        "streamingllm, tova",
    ),
    "env_wrong_type": (
        None,
        {"enabled": "perhaps"},
        [],
        "invalid kvevict configuration (KVEVICT_CONFIG): kvevict.enabled: Input should be a valid boolean "
        '(got "perhaps"; allowed: true or false)',
    ),
    "fp8_kv_cache": (
        {"kvevict": {"policy": "keydiff", "budget": 64}},
        None,
        ["--kv-cache-dtype", "fp8"],
        "invalid kvevict configuration: --kv-cache-dtype fp8 is not supported with eviction; allowed: auto",
    ),
    "speculative_decoding_draft_model": (
        {"kvevict": {"policy": "keydiff", "budget": 64}},
        None,
        [
            "--speculative-config",
            json.dumps({"method": "draft_model", "model": "{model}", "num_speculative_tokens": 2}),
            "--no-async-scheduling",
        ],
        "invalid kvevict configuration: speculative decoding with the method draft_model is not supported with "
        "eviction (its drafter keeps a KV cache of its own beside the evicted one; n-gram and suffix drafts are "
        "supported)",
    ),
    "speculative_decoding_h2o": (
        {"kvevict": {"policy": "h2o", "budget": 64}},
        None,
        ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})],
        "invalid kvevict configuration: speculative decoding with the policy h2o compacting while decoding is not "
        "supported with eviction (it counts every query in per-slot state, rejected drafts' too; choose a policy "
        "without per-slot state (docs/compatibility.md), or trigger once)",
    ),
    "kv_connector": (
        {"kvevict": {"policy": "keydiff", "budget": 64}},
        None,
        ["--kv-transfer-config", json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both"})],
        "invalid kvevict configuration: a KV transfer or offloading connector (--kv-transfer-config, "
        "--kv-offloading-size) is not supported with eviction (compaction rewrites blocks the connector would copy)",
    ),
    "pipeline_parallel": (
        {"kvevict": {"policy": "keydiff", "budget": 64}},
        None,
        ["--pipeline-parallel-size", "2"],
        "invalid kvevict configuration: pipeline parallelism (--pipeline-parallel-size) is not supported with "
        "eviction (a policy that fails on one stage must reach the engine core before it caches that request's "
        "windows; tensor parallelism is supported)",
    ),
    # models none of whose layers evict (testing/models.ARCHS)
    "every_layer_sliding": (
        {"kvevict": {"policy": "keydiff", "budget": 64}},
        None,
        ["MODEL:mistral-sliding"],
        "invalid kvevict configuration: a model whose every attention layer is sliding-window attention (window "
        "256) is not supported with eviction (vLLM already keeps those layers within their window and the plugin "
        "evicts full-attention layers only; serve it without --attention-backend kvevict)",
    ),
    "every_layer_local": (
        {"kvevict": {"policy": "keydiff", "budget": 64}},
        None,
        ["MODEL:gemma3-local"],
        "invalid kvevict configuration: a model whose every attention layer is sliding-window attention (window "
        "256) is not supported with eviction (vLLM already keeps those layers within their window and the plugin "
        "evicts full-attention layers only; serve it without --attention-backend kvevict)",
    ),
    "mla": (
        {"kvevict": {"policy": "keydiff", "budget": 64}},
        None,
        ["MODEL:deepseek-v2"],
        "invalid kvevict configuration: multi-head latent attention (MLA, as in DeepSeek-V2/V3) is not supported "
        "with eviction (its latent KV cache has no per-head keys and values to score; set VLLM_MLA_DISABLE=1 to run "
        "it as multi-head attention, which evicts, or serve it without --attention-backend kvevict)",
    ),
    "pooling": (
        {"kvevict": {"policy": "keydiff", "budget": 64}},
        None,
        ["--runner", "pooling", "--convert", "embed"],
        "invalid kvevict configuration: a pooling model (--runner pooling: embeddings, classification, scores) is "
        "not supported with eviction (its output is a representation of the whole prompt, which eviction would "
        "change, and it generates nothing to bound memory for; serve it without --attention-backend kvevict)",
    ),
    "model_runner_v2": (
        {"kvevict": {"policy": "keydiff", "budget": 64}},
        None,
        ["ENV:VLLM_USE_V2_MODEL_RUNNER=1"],
        "invalid kvevict configuration: VLLM_USE_V2_MODEL_RUNNER=1 is not supported with eviction (the plugin's "
        "per-step hook is in vLLM's V1 model runner; unset it or set VLLM_USE_V2_MODEL_RUNNER=0)",
    ),
}


def _start(case: str, tiny_model, base) -> tuple[int, str]:
    """``vllm serve`` with the case's configuration, run until it exits: its exit code and log."""
    additional, env_cfg, extra, _ = CASES[case]
    extra_env = dict(a.removeprefix("ENV:").split("=", 1) for a in extra if a.startswith("ENV:"))
    extra = [a.replace('"{model}"', json.dumps(str(tiny_model))) for a in extra]
    models = [a.removeprefix("MODEL:") for a in extra if a.startswith("MODEL:")]
    extra = [a for a in extra if not a.startswith(("ENV:", "MODEL:"))]
    if models:
        from vllm_kvevict.testing.models import arch_path

        tiny_model = arch_path(models[0])
    args = ["--attention-backend", "kvevict", *CPU_BASE_ARGS, *extra]
    if additional is not None:
        args += ["--additional-config", json.dumps(additional)]
    env = {"KVEVICT_CONFIG": json.dumps(env_cfg)} if env_cfg is not None else {"KVEVICT_CONFIG": ""}
    env.update(extra_env)
    srv = VLLMServer(tiny_model, args, log_path=base / f"{case}.log", env=env)
    return srv.wait_exit(timeout=240), srv.log()


@pytest.fixture(scope="module")
def exits(tiny_model, tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Every case's exit code and log. Two servers start at a time: each stops in its API server
    process, one core's work (importing vLLM), and the cases are independent of each other."""
    base = tmp_path_factory.mktemp("startup-errors")
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(CASES, pool.map(lambda case: _start(case, tiny_model, base), CASES)))


@pytest.mark.parametrize("case", list(CASES))
def test_bad_config_fails_fast_with_one_line(case, exits):
    rc, log = exits[case]
    expected = CASES[case][3]
    assert rc != 0
    lines = [ln for ln in log.splitlines() if "invalid kvevict configuration" in ln]
    assert lines == [f"ERROR: {expected}"], log[-3000:]
    assert "Traceback" not in log
    # It stopped in the API server, before an engine process started or any weight was loaded.
    assert "EngineCore" not in log and "load model" not in log.lower()
