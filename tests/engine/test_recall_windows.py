# SPDX-License-Identifier: Apache-2.0
"""Recall and compressed windows together (docs/architecture.md, "Recall tiers with cached windows").

A recall request's window at a compaction point before its prompt's end is cached with its tier (the
tokens its compactions dropped, kept on the workers under the window's key); a later request with
that prefix and configuration starts on both, as it would have them had it computed the prefix
itself. With ``recall.prefill: all`` every chunk of the request attends to its window and its tier,
so a request started on a window without its tier would compute its prompt against the window alone
and part from the request computed alone by far (``test_recall_prefill`` measures how far): each
request here equals the same request computed alone from scratch on the same server (greedy tokens
and logprobs within the engine tests' tolerance). The step completing a prompt re-selects the window
in place, so the cached window's blocks are copied first: the next turn of a chat starts on the
window the previous turn cached, unchanged.
"""

from __future__ import annotations

import pytest

from tests.engine.evict_common import complete, computed_alone, make_prompt, pool_server, released_line, same_as_alone
from vllm_kvevict.testing.server import VLLMServer
from vllm_kvevict.window import WindowConfig, last_boundary, prompt_tail, window_bound_blocks

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

BUDGET, BS, CHUNK, POOL, RECALL_WINDOW = 96, 32, 512, 120, 32
WINDOW = WindowConfig(BUDGET, BS)  # stride 96
#: the window bound, and the copies of the window the step completing the prompt rewrites
BOUND = window_bound_blocks(WINDOW, CHUNK, CHUNK) + BUDGET // BS
#: host bytes of one evicted token of the test model in a worker's tiers: 2 layers x 2 KV heads x
#: (key and value, 64 float32 each; position and score)
TOKEN_BYTES = 2 * 2 * (2 * 64 * 4 + 8 + 4)


def _server(model, base, prefill: str, **recall):
    cfg = {"policy": "keydiff", "budget": BUDGET, "recall": {"enabled": True, "prefill": prefill, **recall}}
    env = {"VLLM_SERVER_DEV_MODE": "1", "KVEVICT_TEST_HOLD": str(base / "hold")}
    return pool_server(model, base, cfg, pool=POOL, chunk=CHUNK, max_len=4096, env=env, dump=False)


@pytest.fixture(scope="module", params=["all", "window"])
def server(gqa_model, tmp_path_factory, request):
    """With ``prefill: all`` a missing tier would change every chunk after the window; with
    ``window`` (the default) the prompt's end, whose re-selection reads the tier, before and after
    the question's attention."""
    with _server(gqa_model, tmp_path_factory.mktemp(f"recall-windows-{request.param}"), request.param) as srv:
        yield srv


def _hits(srv: VLLMServer) -> float:
    return srv.metrics().get("kvevict:compressed_hits_total", 0.0)


def _point(prompt_len: int) -> int:
    """The window a recall request of ``prompt_len`` tokens starts on: the last compaction point
    before its prompt's end (the tier cached there carries the queries recall scores by)."""
    return last_boundary(prompt_len - 1, WINDOW)


def _tail_end(prompt_len: int) -> int:
    """Where the tail a recall request of ``prompt_len`` tokens caches ends: its blocks after the
    last point before its prompt's end, copied before the step completing it, up to where a
    request starting there still computes recall's window of queries (else the point)."""
    tail = prompt_tail(prompt_len, WINDOW, RECALL_WINDOW)
    return tail[1] if tail is not None else last_boundary(prompt_len - 1, WINDOW)


def test_shared_document_starts_on_the_window_and_its_tier(server, vocab):
    """The first request (780 tokens) ends too soon after its last point, 768, for a tail: its
    compaction there copies ``[672, 736)`` aside, the tail of the window at 672. A request with the
    document and another question (760 tokens: its prompt ends before 768) starts on the window at
    672 and that tail up to 704 (the last block boundary that leaves it recall's 32 queries: it
    has seen none in the tail)."""
    doc = make_prompt(740, 11, vocab)
    mine = doc + make_prompt(20, 12, vocab)
    alone = computed_alone(server, mine, 24)
    first = complete(server, doc + make_prompt(40, 13, vocab), 24)  # computes the document, caches its windows
    released_line(server, first["id"])
    hits = _hits(server)
    out = complete(server, mine, 24)
    assert out["cached_tokens"] == 704 and _point(len(mine)) == 672
    same_as_alone(out, alone)
    assert _hits(server) == hits + 1
    assert released_line(server, out["id"])[2] <= BOUND


def test_shared_document_starts_on_the_tail_copied_before_the_prompts_end(server, vocab):
    """A prompt ending 64 tokens or more after its last point: the step completing it starts at
    the end of its tail (``prompt_tail``), the blocks after the point copied before it (it
    re-selects them in place); a request whose document covers that tail starts past the window."""
    doc = make_prompt(810, 41, vocab)
    mine = doc + make_prompt(60, 42, vocab)
    alone = computed_alone(server, mine, 24)
    first = complete(server, doc + make_prompt(50, 43, vocab), 24)  # 860 tokens: the window at 768, tail to 800
    released_line(server, first["id"])
    hits = _hits(server)
    out = complete(server, mine, 24)
    assert out["cached_tokens"] == _tail_end(860) == 800
    same_as_alone(out, alone)
    assert _hits(server) == hits + 1
    assert released_line(server, out["id"])[2] <= BOUND
    assert _hits(server) == hits + 1
    assert released_line(server, out["id"])[2] <= BOUND


def test_tenants_do_not_start_on_each_others_windows(server, vocab):
    """A window and its tier are keyed on vLLM's prefix hashes, which carry the request's
    ``cache_salt``: a tenant with another salt computes the document itself, one with the same salt
    starts on the window."""
    doc = make_prompt(740, 51, vocab)
    mine = doc + make_prompt(20, 52, vocab)
    first = complete(server, doc + make_prompt(40, 53, vocab), 8, extra={"cache_salt": "tenant-a"})
    released_line(server, first["id"])
    other = complete(server, mine, 8, extra={"cache_salt": "tenant-b"})
    assert other["cached_tokens"] == 0
    released_line(server, other["id"])
    same = complete(server, mine, 8, extra={"cache_salt": "tenant-a"})
    assert same["cached_tokens"] == 704


def test_a_request_ending_just_after_a_window_starts_on_it(server, vocab):
    """A request whose prompt ends fewer than recall's ``window`` tokens after a cached window
    starts on it: the tier cached there carries the queries before the point, which its recall
    scores by with its own."""
    doc = make_prompt(700, 14, vocab)
    first = complete(server, doc + make_prompt(80, 15, vocab), 8)
    released_line(server, first["id"])
    mine = doc[:680]  # 8 tokens past the point 672
    alone = computed_alone(server, mine, 16)
    first = complete(server, doc + make_prompt(80, 15, vocab), 8)  # the windows again (the reset dropped them)
    released_line(server, first["id"])
    out = complete(server, mine, 16)
    assert out["cached_tokens"] == _point(len(mine)) == 672
    same_as_alone(out, alone)


def test_chat_turns_start_on_the_window_the_last_turn_cached(server, vocab):
    """Each turn repeats the previous prompt and answer: it starts on the last window the previous
    turn cached before its prompt's end (the windows after it depend on where that prompt ended)
    and its tail, with that window's tier; the previous turn's own recall, which rewrote its window
    and tail in place when its prompt completed, did so on copies."""
    history = make_prompt(500, 16, vocab)
    last = None
    for t in range(3):
        prompt = history + make_prompt(70, 17 + t, vocab)
        alone = computed_alone(server, prompt, 20)  # the prefix cache reset around it
        if last is not None:
            released_line(server, complete(server, last, 20)["id"])  # the last turn, its windows cached again
        out = complete(server, prompt, 20)
        if last is not None:  # the last window and tail cached before the last turn's prompt ended
            assert out["cached_tokens"] == _tail_end(len(last)) > last_boundary(len(last) - 1, WINDOW), t
        same_as_alone(out, alone)
        assert released_line(server, out["id"])[2] <= BOUND
        last, history = prompt, prompt + out["tokens"]


def test_windows_cached_before_an_abort_are_exact(server, vocab):
    """A client disconnects while its request's prefill is held past its first compaction: the
    windows (and tiers) whose steps had run are cached as the engine core frees it, and a request
    with that prefix equals the same request alone."""
    doc = make_prompt(1000, 21, vocab)
    mine = doc[:300] + make_prompt(50, 22, vocab)
    alone = computed_alone(server, mine, 16)
    rid = server.abort_mid_prefill(
        {"model": server.served_model_name, "prompt": doc, "max_tokens": 8, "temperature": 0.0}
    )
    released_line(server, rid)
    out = complete(server, mine, 16)
    same_as_alone(out, alone)
    assert out["cached_tokens"] in (0, 96, 192, 288)  # a pure hit, or a window the aborted request cached


def test_a_window_whose_tier_was_dropped_is_not_started_on(gqa_model, tmp_path_factory, vocab):
    """The cached tiers may hold half of ``recall.max_bytes``: here one document's, so a second
    document's tiers drop the first's (least recently used), whose windows' blocks stay in vLLM's
    cache. A request with the first document's prefix does not start on those windows (it would
    start without their tier): it computes from its pure prefix, as alone."""
    tiers = int(1.5 * 672 * TOKEN_BYTES)  # one document's tiers (672 tokens dropped by its last point), not two
    base = tmp_path_factory.mktemp("recall-windows-budget")
    with _server(gqa_model, base, "all", max_bytes=2 * tiers) as srv:
        doc1, doc2 = make_prompt(780, 31, vocab), make_prompt(780, 32, vocab)
        mine = doc1[:700] + make_prompt(60, 33, vocab)
        alone = computed_alone(srv, mine, 16)
        released_line(srv, complete(srv, doc1, 8)["id"])
        released_line(srv, complete(srv, doc2, 8)["id"])
        out = complete(srv, mine, 16)
        assert out["cached_tokens"] == BUDGET  # its pure prefix: the first compaction's E
        same_as_alone(out, alone)
        control = complete(srv, doc2[:740] + make_prompt(20, 34, vocab), 16)
        assert control["cached_tokens"] == 704  # the second document's window at 672 and tail kept their tiers
