# SPDX-License-Identifier: Apache-2.0
"""The physical-window contract: evicted_tokens() properties, checked exhaustively on small ranges."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_kvevict.window import (
    WindowConfig,
    copy_range,
    draft_cut,
    evicted_tokens,
    first_boundary,
    hit_end,
    next_point,
    peak_blocks,
    prompt_tail,
    pure_hit_limit,
    settle_limit,
    step_limit,
    step_window,
    tail_end,
    window_bound_blocks,
)


@st.composite
def configs(draw, trigger=None):
    bs = draw(st.sampled_from([16, 32, 64]))
    return WindowConfig(
        budget=draw(st.integers(1, 300)),
        block_size=bs,
        trigger=trigger or draw(st.sampled_from(["chunked", "once"])),
        decode=draw(st.booleans()),
        stride=bs * draw(st.integers(0, 12)),
    )


@given(cfg=configs(), prompt_len=st.integers(1, 800))
def test_multiple_of_block_and_monotone(cfg, prompt_len):
    prev = 0
    for L in range(0, prompt_len + 200):
        e = evicted_tokens(L, prompt_len, cfg)
        assert e % cfg.block_size == 0
        assert e >= prev
        assert L - e >= min(L, cfg.budget)  # never keeps fewer than the budget
        prev = e


@given(cfg=configs("chunked"), prompt_len=st.integers(1, 800))
def test_chunked_compacts_only_at_boundaries(cfg, prompt_len):
    """E moves only at multiples of the stride, keeping exactly min(b, W) tokens there; between
    compaction points the window holds at most W + stride tokens."""
    S, W = cfg.step, cfg.window
    for L in range(1, prompt_len + 300):
        e_prev, e = evicted_tokens(L - 1, prompt_len, cfg), evicted_tokens(L, prompt_len, cfg)
        if e != e_prev:
            assert L % S == 0
            assert L - e == W
        if cfg.decode or L <= prompt_len:  # decode=False: the window grows while decoding
            assert L - e <= W + S


@given(
    cfg=configs("chunked"),
    prompt_len=st.integers(1, 800),
    saves=st.sampled_from([None, 0, 8, 64]),
    recall_tail=st.sampled_from([None, 1, 32, 100]),
    data=st.data(),
)
def test_window_does_not_depend_on_the_chunks(cfg, prompt_len, saves, recall_tail, data):
    """Steps cut at step_limit() never cross a compaction point: a request compacts at the same
    points whatever chunks the scheduler cuts (every L at which E moves is reached by some step).
    With ``saves`` (a request whose tails are cached), the step that reaches a point ``p`` starts
    at ``hit_end(p)`` or later, so the blocks ``[E(p), hit_end(p))`` are complete before it; with
    ``recall_tail`` too, the step completing the prompt starts at the end of its ``prompt_tail`` or
    later."""
    L, points, total = 0, [], prompt_len + 200
    tail = prompt_tail(prompt_len, cfg, recall_tail) if recall_tail is not None else None
    while L < total:
        n = data.draw(st.integers(1, 400))
        limit = step_limit(L, prompt_len, cfg, saves, recall_tail)
        n = min(n, total - L, limit if limit is not None else n)
        s = step_window(L, L + n, prompt_len, cfg)
        if s.compacts:
            points.append(s.L)
            if saves is not None and (recall_tail is None or s.L < prompt_len):
                end = hit_end(s.L, cfg, saves)
                assert L >= end or s.e_new >= end
        if tail is not None and L < prompt_len <= L + n:
            assert L >= tail[1]
        L += n
    expected = [
        x for x in range(1, total + 1) if evicted_tokens(x, prompt_len, cfg) > evicted_tokens(x - 1, prompt_len, cfg)
    ]
    assert points == expected


@given(cfg=configs(), prompt_len=st.integers(1, 800), out=st.integers(0, 300))
def test_pure_hit_limit_is_below_every_compaction(cfg, prompt_len, out):
    """A pure hit up to the limit lies below the first compaction's E: the request frees it there
    and writes only above it."""
    limit = pure_hit_limit(prompt_len, prompt_len + out, cfg)
    firsts = [e for L in range(1, prompt_len + out + 1) if (e := evicted_tokens(L, prompt_len, cfg)) > 0]
    if limit is None:
        assert not firsts
    else:
        assert not firsts or limit <= firsts[0]
        assert limit % cfg.block_size == 0


@given(cfg=configs("chunked"), k=st.integers(1, 20), qwin=st.sampled_from([0, 8, 64, 200]))
def test_a_tail_is_never_rewritten(cfg, k, qwin):
    """The tail of the window at a compaction point ``b`` (blocks computed after ``b``) lies wholly
    below what the next compaction writes, ``[E(p), p)``, leaves a request starting at its end
    ``qwin`` queries before ``p``, and is empty when the stride is ``W``."""
    b, p = k * cfg.step, (k + 1) * cfg.step
    end = tail_end(b, cfg, qwin)
    assert b <= end <= p and end % cfg.block_size == 0
    if end > b:
        assert end <= evicted_tokens(p, p, cfg) and p - end >= qwin
    if cfg.step <= cfg.window:
        assert end == b


@given(cfg=configs("chunked"), hit_blocks=st.integers(0, 40), out=st.integers(0, 300), qwin=st.sampled_from([0, 8, 64]))
def test_a_hit_copies_what_its_next_compaction_rewrites(cfg, hit_blocks, out, qwin):
    """``copy_range`` of a hit: exactly the hit's tokens that the request's next compaction writes
    (``[E(p), p)``), none when it never compacts again; a hit up to ``hit_end`` still computes the
    last block before that compaction and the queries it reads."""
    prompt = 800
    hit = min(hit_blocks * cfg.block_size, prompt - 1) // cfg.block_size * cfg.block_size
    lo, hi = copy_range(hit, prompt, prompt + out, cfg)
    later = [
        L
        for L in range(hit + 1, prompt + out + 1)
        if evicted_tokens(L, prompt, cfg) > evicted_tokens(L - 1, prompt, cfg)
    ]
    if not later:
        assert (lo, hi) == (0, 0)
        return
    p = later[0]
    assert p == next_point(hit, cfg)
    e = evicted_tokens(p, prompt, cfg)
    assert (lo, hi) == ((e, hit) if hit > e else (0, 0))
    end = hit_end(p, cfg, qwin)
    assert end % cfg.block_size == 0 and p - end >= max(cfg.block_size, qwin)


def test_examples():
    cfg = WindowConfig(budget=256, block_size=32)  # stride W = 256
    assert cfg.step == cfg.window == 256 and first_boundary(cfg) == 512
    assert [evicted_tokens(L, 1000, cfg) for L in (0, 256, 511, 512, 767, 768, 1000)] == [0, 0, 0, 256, 256, 512, 512]
    odd = WindowConfig(budget=250, block_size=32, stride=64)  # W = 256
    assert [evicted_tokens(L, 1000, odd) for L in (287, 288, 320, 383, 384)] == [0, 0, 64, 64, 128]
    assert [step_limit(L, 1000, odd) for L in (0, 1, 63, 64, 1000)] == [64, 63, 1, 64, 24]
    once = WindowConfig(budget=256, block_size=32, trigger="once")
    assert [evicted_tokens(L, 1000, once) for L in (999, 1000, 5000)] == [0, 736, 736]
    assert step_limit(10, 1000, once) == 990 and step_limit(1000, 1000, once) is None
    no_decode = WindowConfig(budget=256, block_size=32, decode=False)
    assert evicted_tokens(2000, 1000, no_decode) == 512  # the last boundary inside the prompt: 768
    assert step_limit(1000, 1000, no_decode) is None
    assert evicted_tokens(5000, 1000, WindowConfig(budget=1, block_size=32, enabled=False)) == 0
    assert pure_hit_limit(3000, 3100, cfg) == 256
    assert pure_hit_limit(300, 400, cfg) is None  # never reaches its first compaction point
    assert pure_hit_limit(1000, 1100, once) == 736
    # copies: a hit of 480 (pure) copies [256, 480) before the compaction at 512; a step from 0
    # stops at hit_end(512) = 480 so that those blocks are complete before the step reaching 512
    assert hit_end(512, cfg) == 480 and hit_end(512, cfg, 64) == 448
    assert copy_range(480, 1000, 1100, cfg) == (256, 480) and copy_range(480, 500, 500, cfg) == (0, 0)
    assert copy_range(512, 1000, 1100, cfg) == (0, 0)  # a window hit at a point: nothing rewritten
    assert [step_limit(L, 1000, cfg, 0) for L in (0, 256, 479, 480, 512, 735, 736)] == [256, 224, 1, 32, 224, 1, 32]
    with pytest.raises(ValueError, match="stride"):
        WindowConfig(budget=100, block_size=32, stride=48)
    with pytest.raises(ValueError):
        WindowConfig(budget=0, block_size=32)


@given(
    cfg=configs("chunked"),
    chunk=st.sampled_from([16, 64, 100, 512]),
    batches=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**32),
)
def test_bound_holds_under_in_flight_steps(cfg, chunk, batches, seed):
    """What the engine core holds for a request (blocks [E(processed)/bs, L_scheduled/bs)) never
    exceeds window_bound_blocks, with up to ``batches`` steps of at most ``chunk`` tokens in flight."""
    rng = random.Random(seed)
    cfg = dataclasses.replace(cfg, decode=True)  # decode=False: unbounded while decoding (no admission cap)
    prompt, total = 2000, 2400
    bound = window_bound_blocks(cfg, batches * chunk, chunk)
    processed, in_flight = 0, []
    while processed < total:
        scheduled = in_flight[-1] if in_flight else processed
        if len(in_flight) < batches and scheduled < total and rng.random() < 0.8:
            n = min(rng.randint(1, chunk), total - scheduled)
            limit = step_limit(scheduled, prompt, cfg)
            n = min(n, limit) if limit is not None else n
            in_flight.append(scheduled + n)
            held = -(-in_flight[-1] // cfg.block_size) - evicted_tokens(processed, prompt, cfg) // cfg.block_size
            assert held <= bound, (processed, in_flight)
        elif in_flight:
            processed = in_flight.pop(0)
    assert peak_blocks(prompt, total, cfg, batches * chunk, chunk) <= bound


@given(
    cfg=configs("once"),
    chunk=st.sampled_from([16, 64, 100, 512]),
    batches=st.sampled_from([1, 2]),
    prompt=st.integers(1, 700),
    generated=st.integers(0, 300),
    seed=st.integers(0, 2**32),
)
def test_a_resumed_once_request_stays_within_its_peak(cfg, chunk, batches, prompt, generated, seed):
    """A ``once`` window holds its whole prompt until the compaction at its end is processed. A
    request resumed after preemption recomputes its prompt and what it generated; with a step in
    flight (asynchronous scheduling) the next step is scheduled before that compaction's blocks
    come back, so it may take only what its last block has room for (``settle_limit``): the blocks
    held never exceed ``peak_blocks``, which the API checks against the pool (an admitted request
    that exceeded it, alone in the pool, would be preempted at every attempt, forever)."""
    rng = random.Random(seed)
    total = prompt + generated + 1  # what it recomputes, then one more token
    bs, peak = cfg.block_size, peak_blocks(prompt, total, cfg, batches * chunk, chunk)
    processed, in_flight = 0, []
    while processed < total:
        scheduled = in_flight[-1] if in_flight else processed
        if len(in_flight) < batches and scheduled < total and rng.random() < 0.8:
            n = min(chunk, total - scheduled)  # a resumed request takes all the budget gives
            for limit in (step_limit(scheduled, prompt, cfg), settle_limit(scheduled, processed, prompt, cfg)):
                n = min(n, limit) if limit is not None else n
            in_flight.append(scheduled + n)
            held = -(-in_flight[-1] // bs) - evicted_tokens(processed, prompt, cfg) // bs
            assert held <= peak, (processed, in_flight, held, peak)
        elif in_flight:
            processed = in_flight.pop(0)


def test_settle_limit_examples():
    once = WindowConfig(budget=100, block_size=32, trigger="once")
    assert settle_limit(1000, 999, 1000, once) == 24  # the prompt's last block has 24 free slots
    assert settle_limit(1024, 1000, 1024, once) == 1  # a full last block: one token, one block more
    assert settle_limit(1000, 1000, 1000, once) is None  # the compaction is processed
    assert settle_limit(900, 800, 1000, once) is None  # before the prompt's end: step_limit cuts there
    assert settle_limit(1000, 999, 1000, WindowConfig(budget=100, block_size=32)) is None  # chunked
    assert settle_limit(64, 0, 64, once) is None  # a prompt within the budget evicts nothing
    # asynchronous scheduling: one token's block beside a prompt that fills its last block
    assert peak_blocks(1024, 1100, once, 1024, 512) == 33 and peak_blocks(1024, 1100, once, 512, 512) == 32


@given(cfg=configs(), prompt=st.integers(1, 300), k=st.integers(1, 6), seed=st.integers(0, 2**32))
def test_a_step_with_drafts_never_compacts(cfg, prompt, k, seed):
    """Speculative decoding: every decode step offers the last sampled token and ``k`` drafts, cut at
    the next compaction point (``step_limit``) and by ``draft_cut``; the sampler accepts a random
    prefix of the drafts. A step that compacts holds verified tokens only, and the request
    compacts at exactly the points a request without drafts compacts at."""
    rng = random.Random(seed)
    total = prompt + 400
    L, known = prompt, prompt + 1  # the prompt is computed; the token sampled from it is known
    points = []
    while L < total:
        n = min(1 + k, total - L)
        limit = step_limit(L, prompt, cfg)
        n = draft_cut(L, min(n, limit) if limit is not None else n, known, prompt, cfg)
        if step_window(L, L + n, prompt, cfg).compacts:
            assert L + n <= known, f"a step [{L}, {L + n}) compacts with drafts past {known}"
            points.append(L + n)
        accepted = min(n - 1, rng.randint(0, n - 1))  # of the step's drafts
        L = L + 1 + accepted  # the verified tokens computed; the next sampled token is known
        known = L + 1
    plain = [
        q for q in range(prompt + 1, total + 1) if evicted_tokens(q, prompt, cfg) > evicted_tokens(q - 1, prompt, cfg)
    ]
    assert points == [q for q in plain if q <= L]
