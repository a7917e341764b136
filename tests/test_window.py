# SPDX-License-Identifier: Apache-2.0
"""The physical-window contract: evicted_tokens() properties, checked exhaustively on small ranges."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_kvevict.window import WindowConfig, evicted_tokens, step_window, window_bound_blocks

configs = st.builds(
    WindowConfig,
    budget=st.integers(1, 300),
    block_size=st.sampled_from([16, 32, 64]),
    trigger=st.sampled_from(["chunked", "once"]),
    decode=st.booleans(),
)


@given(cfg=configs, prompt_len=st.integers(1, 800))
def test_multiple_of_block_and_monotone(cfg, prompt_len):
    prev = 0
    for L in range(0, prompt_len + 200):
        e = evicted_tokens(L, prompt_len, cfg)
        assert e % cfg.block_size == 0
        assert e >= prev
        assert L - e >= min(L, cfg.budget)  # never keeps fewer than the budget
        prev = e


@given(budget=st.integers(1, 300), bs=st.sampled_from([16, 32]), prompt_len=st.integers(1, 800))
def test_chunked_window_between_steps(budget, bs, prompt_len):
    cfg = WindowConfig(budget=budget, block_size=bs)
    for L in range(budget, prompt_len + 100):
        assert budget <= L - evicted_tokens(L, prompt_len, cfg) < budget + bs


def test_examples():
    cfg = WindowConfig(budget=256, block_size=32)
    assert [evicted_tokens(L, 1000, cfg) for L in (0, 256, 287, 288, 319, 320, 1000)] == [0, 0, 0, 32, 32, 64, 736]
    once = WindowConfig(budget=256, block_size=32, trigger="once")
    assert [evicted_tokens(L, 1000, once) for L in (999, 1000, 5000)] == [0, 736, 736]
    no_decode = WindowConfig(budget=256, block_size=32, decode=False)
    assert evicted_tokens(2000, 1000, no_decode) == 736
    assert evicted_tokens(5000, 1000, WindowConfig(budget=1, block_size=32, enabled=False)) == 0


def test_step_window_and_bound():
    cfg = WindowConfig(budget=100, block_size=32)
    s = step_window(64, 192, 1000, cfg)
    assert (s.e_prev, s.e_new, s.kept, s.compacts) == (0, 64, 128, True)
    assert not step_window(120, 121, 1000, cfg).compacts
    # peak inside a step: window before compaction = L - e_prev <= budget + bs - 1 + chunk
    chunk = 64
    for L_prev in range(0, 2000, 7):
        s = step_window(L_prev, L_prev + chunk, 10_000, cfg)
        assert -(-(s.L - s.e_prev) // 32) <= window_bound_blocks(cfg, chunk)  # e_prev is block-aligned
    with pytest.raises(ValueError):
        WindowConfig(budget=0, block_size=32)
