# SPDX-License-Identifier: Apache-2.0
"""Memory: the window bound holds inside vLLM's block pool, prompts longer than the whole KV cache
run, and a mixed run (finished, aborted mid-prefill, preempted requests) returns every block.

The KV cache is 9 blocks of 32 tokens (8 usable: block 0 is vLLM's null block), i.e. 256 tokens.
Block counts come from vLLM's own block lists and free-block count, read by the plugin's manager in
the engine core and logged once per request ("kvevict: request ... released: ...").
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest

from tests.engine.evict_common import (
    check_against_reference,
    complete,
    make_prompt,
    pool_server,
    release_lines,
    released_line,
)
from vllm_kvevict.testing.hf_reference import load_attempts
from vllm_kvevict.testing.server import wait_until
from vllm_kvevict.window import WindowConfig, evicted_tokens, window_bound_blocks

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BUDGET, BS, CHUNK = 96, 32, 64
BOUND = window_bound_blocks(WindowConfig(BUDGET, BS), CHUNK)  # 6 blocks per running request
POOL = 8
ABORTED_PROMPT = 30000


@pytest.fixture(scope="module")
def server(gqa_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("memory")
    # Admit on the first chunk only (vLLM's default reserves the whole window bound per request,
    # which avoids preemption altogether); over-admission makes vLLM preempt, as under load.
    # Request logs: admit_together counts the requests that reached the engine.
    extra = ["--no-scheduler-reserve-full-isl", "--enable-log-requests"]
    env = {"VLLM_SERVER_DEV_MODE": "1", "KVEVICT_TEST_HOLD": str(base / "hold")}
    cfg = {"policy": "keydiff", "budget": BUDGET}
    with pool_server(gqa_model, base, cfg, pool=POOL, chunk=CHUNK, max_len=32768, extra=extra, env=env) as srv:
        yield srv


def test_prompt_longer_than_whole_cache_runs_within_bound(server, hf_model):
    prompt = make_prompt(8 * BUDGET + 40, 11, hf_model.config.vocab_size)  # 808 tokens > 256 in the cache
    out = complete(server, prompt, 40)
    assert len(out["tokens"]) == 40
    _, freed, peak, bound, free, total, pool_peak = released_line(server, out["id"])
    assert (bound, total) == (BOUND, POOL)
    assert peak <= BOUND and pool_peak <= BOUND  # one running request: the whole pool stayed in the bound
    # every evicted block went back to the pool: E at the last compaction point
    assert freed == evicted_tokens(len(prompt) + 39, len(prompt), WindowConfig(BUDGET, BS)) // BS
    assert free == POOL
    assert re.search(rf"request {out['id']}\S* released: .*; policy keydiff, budget {BUDGET}\n", server.log())
    check_against_reference(hf_model, out, load_attempts(server.dump_dir))


def test_mixed_run_returns_every_block(server, hf_model):
    vocab = hf_model.config.vocab_size
    preemptions_before = server.metrics().get("vllm:num_preemptions_total", 0.0)
    # 1. A client that disconnects mid-prefill (30000 tokens take ~470 steps of 64): the worker holds
    #    a step once eviction has moved the window, so the prefill cannot finish first.
    rid = server.abort_mid_prefill(
        {"model": server.served_model_name, "prompt": make_prompt(ABORTED_PROMPT, 21, vocab), "max_tokens": 4}
    )
    # vLLM frees the aborted request; wait until it has logged the release.
    full_prefill_frees = (ABORTED_PROMPT - BUDGET) // BS
    aborted = released_line(server, rid, 120)
    # 2. Four requests that need up to 4 x 6 blocks from a pool of 8, admitted together (the
    #    scheduler is paused until all four have reached it): vLLM must preempt.
    specs = [(300, 22), (450, 23), (600, 24), (700, 25)]
    with ThreadPoolExecutor(4) as pool:
        futures = server.admit_together(pool, [partial(complete, server, make_prompt(*a, vocab), 64) for a in specs])
        outs = [f.result() for f in futures]
    assert all(len(o["tokens"]) == 64 for o in outs)
    wait_until(
        lambda: server.metrics().get("vllm:num_preemptions_total", 0.0) > preemptions_before,
        60,
        "a preemption counted in /metrics",
    )
    # Preempted requests were recomputed and still equal the reference (per attempt).
    attempts = load_attempts(server.dump_dir)
    recomputed = [o for o in outs if len(check_against_reference(hf_model, o, attempts)) > 1]
    assert recomputed, "expected at least one recomputed request"
    # 3. The aborted request was released mid-prefill, after some eviction.
    assert 0 < aborted[1] < full_prefill_frees - 2, f"aborted request not released mid-prefill: {aborted}"
    # 4. Afterwards every block is free again.
    last = complete(server, make_prompt(200, 26, vocab), 8)
    line = released_line(server, last["id"])
    assert line[4] == POOL, f"{POOL - line[4]} blocks leaked"
    for r in release_lines(server):
        assert r[2] <= BOUND, f"request {r[0]} held {r[2]} blocks"
