# SPDX-License-Identifier: Apache-2.0
"""Soak: 200+ mixed requests at once against one real server with a small KV pool.

Chat and completions, streaming and not, ``n > 1``, prompts from tens to thousands of tokens,
every policy with its own budget and parameters, eviction turned off per request, the OpenAI
``seed`` on sampled requests, clients that disconnect mid-stream or before the first token, and
bad requests mixed in. All generated from one seed (the request mix, not the arrival timing, which
the server's queue absorbs). Afterwards, from vLLM's own ``/metrics`` and the plugin's log: the
server is alive, every bad request got a 4xx with a message, nothing got a 5xx, nothing is running
or waiting, the whole KV pool is free, and preemptions really happened.

Correctness under this load, for a sample of greedy completions:

* each equals the transformers replay of the tokens the engine kept (per attempt, so preempted
  and recomputed requests are covered);
* replayed alone on the same server, each gives the same tokens wherever its compaction schedule
  (the ``L`` of every compaction, set by how the scheduler cut its prefill into chunks beside the
  other requests, and by preemptions) is the same. Where the schedule differs the kept tokens
  differ, legitimately: eviction decided after other chunks sees other tokens. Those are counted,
  not compared.
"""

from __future__ import annotations

import json
import os
import random
import socket
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.engine.evict_common import check_against_reference, complete, pool_server
from vllm_kvevict.policies import POLICIES
from vllm_kvevict.testing.hf_reference import attempts_for, load_attempts
from vllm_kvevict.testing.server import VLLMServer, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.timeout(2400)]

SEED, N = 20261123, 220
BS, CHUNK, POOL, BUDGET, MAX_LEN = 32, 128, 24, 128, 4096  # 24 usable blocks = 768 tokens < max_model_len
POOL_TOKENS = POOL * BS
WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


@pytest.fixture(scope="module")
def server(gqa_model, tmp_path_factory):
    cfg = {"policy": "keydiff", "budget": BUDGET}
    # admit on the first chunk: preemption under load, as in production
    extra = ["--no-scheduler-reserve-full-isl"]
    base = tmp_path_factory.mktemp("soak")
    with pool_server(gqa_model, base, cfg, pool=POOL, chunk=CHUNK, max_len=MAX_LEN, max_seqs=8, extra=extra) as srv:
        yield srv


def _params(rng: random.Random, policy: str) -> dict:
    """Valid parameters for a policy, varied."""
    return {
        "streamingllm": lambda: {"sink_tokens": rng.randint(0, 8)},
        "snapkv": lambda: {
            "window": rng.choice([8, 16, 32]),
            "kernel": rng.choice([1, 3, 5, 7]),
            "pooling": rng.choice(["avg", "max"]),
        },
        "h2o": lambda: {"recent_tokens": rng.randint(0, 16)},
        "knorm": lambda: {"sink_tokens": rng.randint(0, 4), "recent_tokens": rng.randint(0, 16)},
        "random": lambda: {"seed": rng.randint(0, 2**31 - 1)},
        "lshe": lambda: {
            "bits": rng.randint(4, 32),
            "seed": rng.randint(0, 1000),
            "hash": rng.choice(["query", "key"]),
        },
        "kvmerger": lambda: {"threshold": rng.uniform(0.3, 0.9), "sigma": rng.uniform(0.5, 10)},
        "criticalkv": lambda: {"alpha": rng.uniform(0, 1), "base": rng.choice(["snapkv", "tova", "h2o"])},
        "caote": lambda: {"base": rng.choice(["h2o", "tova", "snapkv"])},
        "fastcaote": lambda: {"base": rng.choice(["h2o", "tova"])},
    }.get(policy, dict)()


ONCE = {"criticalkv", "kvmerger"}


def _plan(rng: random.Random, i: int) -> dict:
    """One request of the mix: what to send and what must come back."""
    kind = rng.choices(["ok", "bad", "disconnect_early", "disconnect_mid"], [76, 12, 6, 6])[0]
    if kind == "bad":
        bad = rng.choice(
            [
                {"vllm_xargs": {"kvevict_budget": -3}},
                {"vllm_xargs": {"kvevict_policy": "h3o"}},
                {"vllm_xargs": {"kvevict_params": "{not json"}},
                {"vllm_xargs": {"kvevict_enabled": 7}},
                {"vllm_xargs": {"kvevict_policy": "random", "kvevict_params": json.dumps({"seed": 2**70})}},
                {"vllm_xargs": {"kvevict_budgte": 5}},
                {"max_tokens": -1},
                {"temperature": -2},
                {"vllm_xargs": {"kvevict_enabled": False}, "prompt_len": POOL_TOKENS + 200},  # cannot fit the pool
                {"prompt_len": MAX_LEN + 10},  # longer than max_model_len
            ]
        )
        return {
            "kind": "bad",
            "chat": False,
            "stream": False,
            "n": 1,
            "max_tokens": bad.get("max_tokens", 4),
            "prompt_len": bad.get("prompt_len", rng.randint(10, 200)),
            "temperature": bad.get("temperature", 0),
            "xargs": bad.get("vllm_xargs", {}),
            "seed": None,
        }
    xargs: dict = {}
    roll = rng.random()
    max_tokens = rng.randint(1, 48)
    if roll < 0.55:  # a policy (and maybe budget and parameters) of its own
        policy = rng.choice(sorted(POLICIES))
        xargs["kvevict_policy"] = policy
        min_budget = POLICIES[policy].Params(**_params(random.Random(0), policy)).min_budget()
        if rng.random() < 0.6:
            xargs["kvevict_budget"] = rng.randint(max(min_budget, 40), 320)
        params = _params(rng, policy)
        if params:
            xargs["kvevict_params"] = json.dumps(params)
            if policy in ("snapkv",) or (policy in ("criticalkv", "caote") and params.get("base") == "snapkv"):
                xargs["kvevict_budget"] = max(xargs.get("kvevict_budget", BUDGET), 40)
        unbounded = policy in ONCE or policy == "none"
    elif roll < 0.65:
        xargs["kvevict_enabled"] = False
        unbounded = True
    else:
        unbounded = False
    if unbounded:  # must fit the whole pool alone, with room to spare (else: a 400, tested elsewhere)
        prompt_len = rng.randint(10, POOL_TOKENS - max_tokens - 96)
    else:
        prompt_len = int(rng.choice([rng.randint(10, 100), rng.randint(100, 800), rng.randint(800, 3000)]))
    sampled = rng.random() < 0.35
    stream = rng.random() < 0.4
    chat = rng.random() < 0.3 and not unbounded  # a chat prompt's token count is only known after templating
    return {
        "kind": kind,
        "chat": chat,
        "stream": stream or kind != "ok",
        "n": 2 if sampled and rng.random() < 0.4 else 1,
        "max_tokens": max_tokens,
        "prompt_len": prompt_len,
        "temperature": 0.8 if sampled else 0,
        "seed": rng.randint(0, 10**6) if sampled else None,
        "xargs": xargs,
    }


def _body(srv: VLLMServer, p: dict, rng: random.Random) -> tuple[str, dict]:
    body = {
        "model": srv.served_model_name,
        "max_tokens": p["max_tokens"],
        "temperature": p["temperature"],
        "n": p["n"],
        "stream": p["stream"],
        "ignore_eos": True,
    }
    if p["seed"] is not None:
        body["seed"] = p["seed"]
    if p["xargs"]:
        body["vllm_xargs"] = p["xargs"]
    if p["chat"]:
        # At most 300 words: well inside max_model_len with this tokenizer, whatever the words.
        words = " ".join(rng.choice(WORDS) for _ in range(min(300, max(1, p["prompt_len"] // 4))))
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": words}]}
    body["prompt"] = [rng.randrange(3, 500) for _ in range(p["prompt_len"])]
    if _traced(p):  # the chosen tokens, to compare with the transformers replay and a run alone
        body.update(logprobs=1, return_tokens_as_token_ids=True)
    return "/v1/completions", body


def _traced(p: dict) -> bool:
    return p["kind"] == "ok" and not p["chat"] and not p["stream"] and p["temperature"] == 0 and p["n"] == 1


def _disconnect_early(srv: VLLMServer, path: str, body: dict) -> None:
    """Send the request and close the connection before any byte of the answer is read."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )


def _send(srv: VLLMServer, p: dict, seed: int) -> dict:
    rng = random.Random(seed)
    path, body = _body(srv, p, rng)
    url = srv.base_url + path
    if p["kind"] == "disconnect_early":
        _disconnect_early(srv, path, body)
        return {"status": None}
    r = requests.post(url, json=body, stream=body["stream"], timeout=1200)
    out: dict = {"status": r.status_code}
    if r.status_code != 200:
        out["message"] = (
            (r.json().get("error", {}) or {}).get("message", "")
            if r.headers.get("content-type", "").startswith("application/json")
            else r.text[:200]
        )
        return out
    if p["kind"] == "disconnect_mid":
        for i, _ in enumerate(r.iter_lines()):
            if i >= 2:
                break
        r.close()
        return out
    if body["stream"]:
        chunks = [ln for ln in r.iter_lines() if ln.startswith(b"data: ")]
        out["done"] = chunks[-1] == b"data: [DONE]"
    else:
        js = r.json()
        out["choices"] = len(js["choices"])
        if _traced(p):
            lp = js["choices"][0]["logprobs"]
            out.update(
                id=js["id"],
                prompt=body["prompt"],
                logprobs=lp["token_logprobs"],
                tokens=[int(t.removeprefix("token_id:")) for t in lp["tokens"]],
            )
    return out


def test_soak(server, hf_model, tmp_path):
    rng = random.Random(SEED)
    plans = [_plan(rng, i) for i in range(N)]
    used = {p["xargs"].get("kvevict_policy") for p in plans if p["kind"] == "ok"}
    assert set(POLICIES) <= used, f"the mix misses policies: {set(POLICIES) - used}"
    before = server.metrics()
    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(lambda ip: _send(server, ip[1], SEED + ip[0]), enumerate(plans)))

    figures = Counter()
    for p, r in zip(plans, results):
        figures[p["kind"]] += 1
        if r["status"] is not None and r["status"] >= 500:
            figures["5xx"] += 1
        if p["kind"] == "bad":
            assert r["status"] is not None and 400 <= r["status"] < 500 and r.get("message"), (p, r)
            figures["4xx"] += 1
        elif p["kind"] == "ok":
            assert r["status"] == 200, (p, r)
            assert r.get("done", True) and r.get("choices", p["n"]) == p["n"], (p, r)
    assert figures["5xx"] == 0
    assert requests.get(server.base_url + "/health", timeout=30).status_code == 200

    def idle() -> bool:
        m = server.metrics()
        return (
            m.get("vllm:num_requests_running") == 0
            and m.get("vllm:num_requests_waiting") == 0
            and m.get("vllm:kv_cache_usage_perc") == 0
        )

    wait_until(idle, 300, "nothing running or waiting and the whole KV pool free after the soak")
    after = server.metrics()
    figures["preemptions"] = int(
        after.get("vllm:num_preemptions_total", 0) - before.get("vllm:num_preemptions_total", 0)
    )
    assert figures["preemptions"] > 0, "the pool was meant to be small enough to preempt"

    # Greedy completions under load equal the transformers replay of the tokens they kept (every
    # attempt: preempted ones were recomputed); a sample of them, replayed alone, equals the load
    # run wherever the compaction schedule is the same.
    attempts = load_attempts(server.dump_dir)
    traced = [(p, r) for p, r in zip(plans, results) if _traced(p) and r.get("status") == 200]
    sample = [(p, r) for p, r in traced if p["prompt_len"] <= 1200][:12]
    assert len(sample) >= 6, len(sample)
    for _p, r in sample:
        check_against_reference(
            hf_model, r, attempts, expect_compaction=any(a.events for a in attempts_for(attempts, r["id"]))
        )
    figures["preempted_in_sample"] = sum(len(attempts_for(attempts, r["id"])) > 1 for _, r in sample)
    for p, r in sample:
        alone = complete(server, r["prompt"], p["max_tokens"], p["xargs"] or None)
        attempts = load_attempts(server.dump_dir)
        load_att, alone_att = attempts_for(attempts, r["id"]), attempts_for(attempts, alone["id"])
        if len(load_att) == 1 and list(load_att[0].events) == list(alone_att[0].events):
            figures["same_schedule"] += 1
            if alone["tokens"] != r["tokens"]:
                figures["mismatches"] += 1
        else:
            figures["other_schedule"] += 1
    assert figures["mismatches"] == 0 and figures["same_schedule"] > 0, dict(figures)
    figures["sampled"] = len(sample)
    report = os.environ.get("KVEVICT_SOAK_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump(dict(figures), f, indent=1)
    print("soak figures:", dict(figures))
