# SPDX-License-Identifier: Apache-2.0
"""The plugin's metrics on vLLM's own ``/metrics``, scraped from a real server after a few requests
and checked against what the engine did: blocks freed equal the sum of the per-request release
lines, tokens evicted are those blocks' slots, one compaction per window move (counted from the
kept-set dumps of the workers), a fault counted once per policy, the eviction-time histogram fed
by every compacting step, the blocks-held gauge back to zero when nothing runs, a refused request
counted by its key, and every series labelled with the model and engine as vLLM's own."""

from __future__ import annotations

import json
import re
import urllib.request
from collections import defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import CPU_SERVER_ARGS
from tests.engine.evict_common import RELEASED, complete, make_prompt
from vllm_kvevict.metrics import BUCKETS, REFUSED_KEYS, REFUSED_REASONS
from vllm_kvevict.testing.hf_reference import attempts_for, load_attempts
from vllm_kvevict.testing.server import VLLMServer, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BUDGET, BS, CHUNK = 96, 32, 64
REQUESTS = [  # prompt length, seed, vllm_xargs, policy label
    (400, 41, None, "keydiff"),
    (520, 42, None, "keydiff"),
    (450, 43, {"kvevict_policy": "snapkv", "kvevict_budget": 128}, "snapkv"),
    (300, 44, {"kvevict_policy": "tova"}, "tova"),  # its scoring raises: falls back, still evicts
    (200, 45, {"kvevict_enabled": False}, None),  # evicts nothing
]


@pytest.fixture(scope="module")
def run(gqa_model, hf_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("metrics")
    cfg = {"kvevict": {"policy": "keydiff", "budget": BUDGET}}
    args = [
        "--attention-backend",
        "kvevict",
        *CPU_SERVER_ARGS,
        "--max-model-len",
        "4096",
        "--max-num-batched-tokens",
        str(CHUNK),
        "--additional-config",
        json.dumps(cfg),
    ]
    env = {"KVEVICT_DUMP_DIR": str(base / "dump"), "KVEVICT_TEST_FAULT": "tova"}
    with VLLMServer(gqa_model, args, log_path=base / "server.log", env=env) as srv:
        before = _scrape(srv)
        vocab = hf_model.config.vocab_size
        outs = [complete(srv, make_prompt(n, seed, vocab), 40, xargs) for n, seed, xargs, _ in REQUESTS]
        with pytest.raises(Exception, match="kvevict_budget"):  # refused with a 400: counted by its key
            complete(srv, make_prompt(50, 46, vocab), 4, {"kvevict_budget": 0})
        # Each request's release line is logged right after its last output: wait for all of them.
        wait_until(lambda: len(RELEASED.findall(srv.log())) >= len(REQUESTS), 60, "every release line")
        wait_until(lambda: _value(_scrape(srv), "kvevict:window_blocks_held") == 0, 60, "no evicting request held")
        yield {
            "model_name": srv.served_model_name,
            "before": before,
            "after": _scrape(srv),
            "outs": outs,
            "log": srv.log(),
            "attempts": load_attempts(base / "dump"),
        }


def _scrape(srv: VLLMServer) -> dict:
    text = urllib.request.urlopen(srv.base_url + "/metrics", timeout=30).read().decode()
    out: dict = defaultdict(float)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] += s.value
    return out


def _value(m: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in m.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def test_metrics_are_on_vllms_endpoint(run):
    after = run["after"]
    names = {n for n, _ in after}
    assert "vllm:num_requests_running" in names  # vLLM's own are still there
    for name in (
        "kvevict:tokens_evicted_total",
        "kvevict:blocks_freed_total",
        "kvevict:compactions_total",
        "kvevict:fallbacks_total",
        "kvevict:eviction_seconds_count",
        "kvevict:window_blocks_held",
        "kvevict:window_blocks_bound",
    ):
        assert name in names, name


def test_blocks_freed_equal_the_release_lines(run):
    freed_by_policy, peaks, released = defaultdict(int), defaultdict(int), defaultdict(int)
    for m in re.finditer(RELEASED.pattern + r"; policy (\S+), budget", run["log"]):
        freed_by_policy[m.group(8)] += int(m.group(2))
        peaks[m.group(8)] += int(m.group(3))
        released[m.group(8)] += 1
    assert freed_by_policy["keydiff"] > 0 and freed_by_policy["snapkv"] > 0 and freed_by_policy["tova"] > 0
    assert freed_by_policy.get("none", 0) == 0
    b, a = run["before"], run["after"]
    for policy in ("keydiff", "snapkv", "tova"):
        freed = _value(a, "kvevict:blocks_freed_total", policy=policy) - _value(
            b, "kvevict:blocks_freed_total", policy=policy
        )
        assert freed == freed_by_policy[policy], policy
        tokens = _value(a, "kvevict:tokens_evicted_total", policy=policy) - _value(
            b, "kvevict:tokens_evicted_total", policy=policy
        )
        assert tokens == freed * BS
    assert released == {"keydiff": 2, "snapkv": 1, "tova": 1, "none": 1}  # every request, as each released
    for policy, n in released.items():  # the release lines' peaks, counted per policy
        for name, want in (("requests_released", n), ("peak_blocks_held", peaks[policy])):
            got = _value(a, f"kvevict:{name}_total", policy=policy) - _value(b, f"kvevict:{name}_total", policy=policy)
            assert got == want > 0, (name, policy)


def test_one_compaction_per_window_move(run):
    """The workers' kept-set dumps record every compaction (per layer); the engine core counts
    each window move once: the same number per policy."""
    moves = defaultdict(int)
    for out, (_, _, _, policy) in zip(run["outs"], REQUESTS):
        (attempt,) = attempts_for(run["attempts"], out["id"])
        if policy is not None:
            moves[policy] += len(attempt.events)
        else:
            assert not attempt.events
    b, a = run["before"], run["after"]
    for policy, n in moves.items():
        counted = _value(a, "kvevict:compactions_total", policy=policy) - _value(
            b, "kvevict:compactions_total", policy=policy
        )
        assert counted == n > 0, policy


def test_fault_counted_once_per_request(run):
    a = run["after"]
    assert _value(a, "kvevict:fallbacks_total", policy="tova") == 1
    assert _value(a, "kvevict:fallbacks_total") == 1
    assert run["log"].count("policy tova failed") == 1


def test_eviction_time_and_gauges(run):
    b, a = run["before"], run["after"]
    steps = _value(a, "kvevict:eviction_seconds_count") - _value(b, "kvevict:eviction_seconds_count")
    assert steps > 0 and _value(a, "kvevict:eviction_seconds_sum") > 0
    inf = _value(a, "kvevict:eviction_seconds_bucket", le="+Inf")
    assert inf == _value(a, "kvevict:eviction_seconds_count")
    assert _value(a, "kvevict:eviction_seconds_bucket", le=str(BUCKETS[0])) <= inf  # cumulative
    assert _value(a, "kvevict:window_blocks_held") == 0 and _value(a, "kvevict:window_blocks_bound") == 0


def test_series_carry_vllms_model_and_engine_labels_and_refusals_are_counted(run):
    """Every ``kvevict:*`` series has ``model_name`` (the served name) and ``engine`` as vLLM's
    ``vllm:*`` have them (the API server's refusal counter: no engine); the one refused request
    is counted by its key and reason, every other key and reason exported at 0."""
    after = run["after"]
    ours = [dict(ls) | {"__name__": n} for n, ls in after if n.startswith("kvevict:")]
    assert ours
    for labels in ours:
        assert labels["model_name"] == run["model_name"], labels
        refused = labels["__name__"] == "kvevict:requests_refused_total"
        assert labels.get("engine") == (None if refused else "0"), labels
    theirs = {(dict(ls)["model_name"], dict(ls)["engine"]) for n, ls in after if n == "vllm:num_requests_running"}
    assert theirs == {(run["model_name"], "0")}
    refused = {
        (dict(ls)["key"], dict(ls)["reason"]): v
        for (n, ls), v in after.items()
        if n == "kvevict:requests_refused_total"
    }
    assert len(refused) == len(REFUSED_KEYS) * len(REFUSED_REASONS)
    assert {k: v for k, v in refused.items() if v} == {("budget", "invalid"): 1}
    assert _value(run["before"], "kvevict:requests_refused_total") == 0
