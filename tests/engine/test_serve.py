# SPDX-License-Identifier: Apache-2.0
"""A real `vllm serve` with the kvevict backend answers the OpenAI API; the worker log proves our backend ran."""

from __future__ import annotations

import json
import re

import pytest
from openai import OpenAI

from tests.conftest import CPU_SERVER_ARGS
from vllm_kvevict.testing.server import VLLMServer

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def _ask_both_endpoints(srv: VLLMServer) -> None:
    client = OpenAI(base_url=srv.base_url + "/v1", api_key="unused")
    comp = client.completions.create(
        model=srv.served_model_name,
        prompt="Hello world, the capital of France is",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert comp.usage.completion_tokens == 8 and comp.choices[0].text
    chat = client.chat.completions.create(
        model=srv.served_model_name,
        messages=[{"role": "user", "content": "What is the magic number?"}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 8 and chat.choices[0].message.content


def _worker_line(log: str, pattern: str) -> str:
    """The first line logged by the worker process (not the API server or engine core) matching pattern."""
    for line in log.splitlines():
        if re.match(r"^\(Worker[^)]*\) INFO ", line) and re.search(pattern, line):
            return line
    raise AssertionError(f"no worker log line matches {pattern!r}")


def test_kvevict_backend_serves_chat_and_completions(tiny_model, server_log):
    cfg = {"kvevict": {"policy": "streamingllm", "budget": 64, "streamingllm": {"sink_tokens": 4}}}
    args = [
        "--attention-backend",
        "kvevict",
        *CPU_SERVER_ARGS,
        "--max-model-len",
        "2048",
        "--additional-config",
        json.dumps(cfg),
    ]
    with VLLMServer(tiny_model, args, log_path=server_log("kvevict")) as srv:
        _ask_both_endpoints(srv)
    log = srv.log()
    _worker_line(
        log,
        r"kvevict: attention backend KVEvictCPUImpl \(base CPU_ATTN\).*policy=streamingllm, budget=64, sink_tokens=4",
    )
    _worker_line(log, r"kvevict: first forward through KVEvictCPUImpl \(model\.layers\.0\.self_attn\.attn\)")
    assert "Cannot use" not in log  # the CPU platform did not fall back to CPU_ATTN


def test_custom_backend_name_and_env_config(tiny_model, server_log):
    args = ["--attention-backend", "custom", *CPU_SERVER_ARGS, "--max-model-len", "2048"]
    env = {"KVEVICT_CONFIG": json.dumps({"policy": "keydiff", "budget": 96})}
    with VLLMServer(tiny_model, args, log_path=server_log("custom"), env=env) as srv:
        _ask_both_endpoints(srv)
    _worker_line(srv.log(), r"kvevict: attention backend KVEvictCPUImpl .*policy=keydiff, budget=96")
