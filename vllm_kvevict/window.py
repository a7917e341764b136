# SPDX-License-Identifier: Apache-2.0
"""The physical window: the one contract the scheduler and the workers share (docs/architecture.md).

A request whose KV has been computed for ``L`` tokens keeps its KV in logical slots ``[E, L)``
with ``E = evicted_tokens(L, prompt_len, cfg)``; logical blocks ``[0, E / block_size)`` have been
handed back to vLLM (the null block stands in their place). Both sides evaluate this pure
function on the same integers, so they agree without talking to each other:

* the scheduler's KV cache manager frees blocks ``[E(L_prev)/bs, E(L)/bs)`` once ``L`` tokens are
  processed;
* the worker, in the step that takes a request from ``L_prev`` to ``L`` tokens, runs attention over
  ``[E(L_prev), L)`` and then compacts the best ``L - E(L)`` of those tokens into ``[E(L), L)``.

Trigger modes:

``chunked`` (default)
    A request compacts at fixed token boundaries, the multiples of its ``stride`` (a whole number
    of blocks; by default its budget rounded up to a block, ``W``): at a boundary ``b``,
    ``E(b) = bs * floor(max(0, b - budget) / bs)``, which keeps exactly ``min(b, W)`` tokens, and
    ``E`` stays there until the next boundary. The scheduler never lets a step cross a boundary
    (:func:`step_limit`; ``kv_manager.py``), so every query attends to the window compacted at the
    last boundary before it plus the tokens since, and the window at ``b`` is a function of the
    first ``b`` tokens and the configuration alone, whatever chunks the scheduler cut: it can be
    cached and reused (docs/architecture.md, "Compressed windows"). With ``decode=True`` this
    continues while decoding (a compaction every ``stride`` generated tokens); with
    ``decode=False`` ``E`` stops at the last boundary inside the prompt.
``once``
    Nothing is evicted until the prompt is complete; then ``E = floor_bs(prompt_len - budget)``,
    fixed during decoding (CriticalKV and KVMerger as published).

A prefix-cache hit of pure blocks (computed without eviction) is cut to the first compaction's
``E`` (:func:`pure_hit_limit`): the first compaction frees those blocks and writes only above them,
so a request behaves exactly as if it had computed them itself. A request that caches its tails
may go on to :func:`hit_end` with its own copies of what its next compaction rewrites
(:func:`copy_range`).

``E`` is a multiple of ``block_size`` and non-decreasing in ``L`` for a fixed configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Trigger = Literal["chunked", "once"]
TRIGGERS: tuple[str, ...] = ("chunked", "once")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class WindowConfig:
    """The integers that determine ``E``; identical in the scheduler and in every worker."""

    budget: int
    block_size: int
    trigger: Trigger = "chunked"
    decode: bool = True
    enabled: bool = True
    #: tokens between compaction points (``chunked``), a multiple of ``block_size``; 0: ``W``, the
    #: budget rounded up to a whole block
    stride: int = 0

    def __post_init__(self) -> None:
        if self.budget < 1 or self.block_size < 1:
            raise ValueError(f"budget and block_size must be positive, got {self.budget}, {self.block_size}")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"trigger must be one of {TRIGGERS}, got {self.trigger!r}")
        if self.stride < 0 or self.stride % self.block_size:
            raise ValueError(f"stride must be a multiple of the block size {self.block_size}, got {self.stride}")

    @property
    def window(self) -> int:
        """``W``: the tokens kept right after a compaction (the budget rounded up to a block)."""
        return round_up(self.budget, self.block_size)

    @property
    def step(self) -> int:
        """The stride in tokens (``W`` when unset)."""
        return self.stride or self.window


def _floor_evict(n: int, cfg: WindowConfig) -> int:
    return cfg.block_size * (max(0, n - cfg.budget) // cfg.block_size)


def last_boundary(L: int, cfg: WindowConfig) -> int:
    """The last compaction point at or below ``L`` (``chunked``)."""
    return L - L % cfg.step


def evicted_tokens(L: int, prompt_len: int, cfg: WindowConfig) -> int:
    """Number of leading logical tokens (a multiple of ``block_size``) evicted at ``L`` computed tokens."""
    if not cfg.enabled:
        return 0
    if cfg.trigger == "once":
        return _floor_evict(prompt_len, cfg) if L >= prompt_len else 0
    return _floor_evict(last_boundary(L if cfg.decode else min(L, prompt_len), cfg), cfg)


def first_boundary(cfg: WindowConfig) -> int:
    """The first compaction point of a ``chunked`` window: the first boundary with ``E > 0``."""
    return round_up(cfg.budget + cfg.block_size, cfg.step)


def tail_end(b: int, cfg: WindowConfig, query_window: int = 0) -> int:
    """Where the *tail* of the window compacted at ``b`` ends: the blocks ``[b, tail_end)`` a
    request computes after ``b`` that its next compaction (at ``p = b + stride``, writing
    ``[p - W, p)``) never rewrites, and from which a request starting there still sees the
    ``query_window`` queries its next compaction reads. Their KV is a function of the window and
    the tokens up to them: cacheable beside the window (docs/architecture.md, "Compressed
    windows"). Empty (``b``) when the stride is ``W``."""
    p = b + cfg.step
    return max(b, cfg.block_size * ((p - max(cfg.window, query_window)) // cfg.block_size))


def next_point(L: int, cfg: WindowConfig) -> int:
    """The first compaction point above ``L`` at which a ``chunked`` window evicts."""
    return max(last_boundary(L, cfg) + cfg.step, first_boundary(cfg))


def hit_end(p: int, cfg: WindowConfig, query_window: int = 0) -> int:
    """The most tokens before compaction point ``p`` a request that caches its tails may start on
    (a prefix-cache hit): it still computes the last block before ``p`` and the ``query_window``
    queries its compaction at ``p`` reads. The scheduler ends the step before the one reaching
    ``p`` here (:func:`step_limit`), so that the blocks ``[E(p), hit_end)``, which the compaction
    at ``p`` rewrites, are complete before it and are copied aside to be cached
    (docs/architecture.md, "Compressed windows")."""
    bs = cfg.block_size
    return bs * ((p - max(bs, query_window)) // bs)


def copy_range(hit: int, prompt_len: int, total_len: int, cfg: WindowConfig) -> tuple[int, int]:
    """The tokens ``[lo, hi)`` of a ``hit``-token prefix-cache hit that the request's next
    compaction rewrites: it gets its own copies of those blocks before its first step (the
    cached ones are read-only). Empty when it never compacts again."""
    if not cfg.enabled or cfg.trigger != "chunked":
        return (0, 0)
    p = next_point(hit, cfg)
    if p > (total_len if cfg.decode else prompt_len):
        return (0, 0)
    lo = evicted_tokens(p, prompt_len, cfg)
    return (lo, hit) if hit > lo else (0, 0)


def pure_hit_limit(prompt_len: int, total_len: int, cfg: WindowConfig) -> int | None:
    """The most tokens of a pure prefix-cache hit a request may start on without changing what it
    computes: the ``E`` of its first compaction (``None``: it never compacts, any hit), for a
    request of ``prompt_len`` prompt tokens that computes at most ``total_len``."""
    if not cfg.enabled:
        return None
    if cfg.trigger == "once":
        return _floor_evict(prompt_len, cfg)
    b1 = first_boundary(cfg)
    if b1 > (total_len if cfg.decode else prompt_len):
        return None
    return _floor_evict(b1, cfg)


def prompt_tail(prompt_len: int, cfg: WindowConfig, query_window: int) -> tuple[int, int] | None:
    """With recall, the tail ``[b, end)`` of the window at the last point ``b`` before the prompt's
    end that is copied aside before the step completing the prompt (which re-selects the window
    and tail ``[E, L)`` in place): the blocks up to where a request starting on them still computes
    recall's ``query_window`` queries (and a block) itself. None when no window lies before it."""
    if not cfg.enabled or cfg.trigger != "chunked" or prompt_len < 1:
        return None
    bs = cfg.block_size
    b, end = last_boundary(prompt_len - 1, cfg), bs * ((prompt_len - max(bs, query_window)) // bs)
    return (b, end) if first_boundary(cfg) <= b < end else None


def step_limit(
    L: int, prompt_len: int, cfg: WindowConfig, saves: int | None = None, recall_tail: int | None = None
) -> int | None:
    """The most tokens a step may compute from ``L`` without crossing a compaction point (``None``:
    no limit: eviction off, or a ``once`` or ``decode=False`` window past its prompt). A
    ``once`` window compacts at the end of its prompt, which a request resumed after preemption
    (prompt and generated tokens to recompute) must reach at the end of a step too. ``saves``
    (the query window of a request whose tails are cached): nor past :func:`hit_end` of the next
    point, when the blocks before it are copied aside; ``recall_tail`` (recall's query window, for
    such a request with recall, whose windows from its prompt's end on are not cached): instead,
    at the points from there on, nor past the end of its :func:`prompt_tail`, so that the step
    completing the prompt starts there."""
    if not cfg.enabled or (not cfg.decode and L >= prompt_len):
        return None
    if cfg.trigger != "chunked":  # the prompt's end, where it compacts (if anything is evicted there)
        return prompt_len - L if L < prompt_len and _floor_evict(prompt_len, cfg) > 0 else None
    limit = cfg.step - L % cfg.step
    if saves is not None and (recall_tail is None or L + limit < prompt_len):  # recall: no windows after
        p = L + limit
        cut = hit_end(p, cfg, saves)
        if L < cut and evicted_tokens(L, prompt_len, cfg) < evicted_tokens(p, prompt_len, cfg) < cut:
            limit = cut - L
    tail = prompt_tail(prompt_len, cfg, recall_tail) if recall_tail is not None else None
    if tail is not None and L < tail[1] < L + limit:
        limit = tail[1] - L
    return limit


def draft_cut(L: int, n: int, known: int, prompt_len: int, cfg: WindowConfig) -> int:
    """Speculative decoding: ``n``, the tokens of a step from ``L`` (cut at compaction points
    already), or one fewer when the step would end at a compaction point with unverified draft
    tokens in it (those past the ``known`` tokens). A compaction runs in the step's forward, before
    its drafts are verified: one that kept a draft the sampler then rejects would leave it in the
    window. Such a step stops one short of the point; the step that reaches it holds only the
    verified token sampled last (``n = 1``), so a request compacts at the same points, on the same
    tokens, with speculation or without."""
    if n > 1 and L + n > known and step_window(L, L + n, prompt_len, cfg).compacts:
        return n - 1
    return n


def settle_limit(L: int, processed: int, prompt_len: int, cfg: WindowConfig) -> int | None:
    """The most tokens a ``once`` window's step may compute from ``L`` while its compaction at the
    end of its prompt is in flight (``processed`` tokens below the prompt's end): what its last
    block has room for, at least one. The compaction's blocks go back only once its step is
    processed, so a step scheduled before that (asynchronous scheduling: a request resumed after
    preemption recomputes its generated tokens in one step) holds at most one block beyond its
    prompt's (:func:`peak_blocks`). ``None``: no limit."""
    if not cfg.enabled or cfg.trigger == "chunked" or L < prompt_len or processed >= prompt_len:
        return None
    if _floor_evict(prompt_len, cfg) == 0:
        return None
    return max(1, -L % cfg.block_size)


def window_bound_blocks(cfg: WindowConfig, max_in_flight: int, max_chunk: int | None = None) -> int:
    """Most blocks a request holds at any time in ``chunked`` mode.

    Right after a compaction point the window holds at most ``W`` tokens; it grows by at most a
    stride before the next, and no step crosses one: ``W + stride`` once the step is processed.
    vLLM frees on processed tokens, so under asynchronous scheduling (``max_in_flight`` is
    ``max_concurrent_batches * max_chunk``) each further step in flight adds at most
    ``min(stride, max_chunk)`` tokens before a compaction's blocks come back."""
    chunk = max_chunk or max_in_flight
    extra_steps = max(0, max_in_flight // max(1, chunk) - 1)
    tokens = cfg.window + cfg.step + extra_steps * min(cfg.step, chunk)
    return -(-tokens // cfg.block_size)


def admission_blocks(cfg: WindowConfig, max_in_flight: int, max_chunk: int | None = None) -> int | None:
    """The blocks vLLM's admission gate reserves for a request with this window: its bound in
    ``chunked`` mode with decode-time eviction; ``None`` (the whole sequence) otherwise."""
    if not cfg.enabled or cfg.trigger != "chunked" or not cfg.decode:
        return None
    return window_bound_blocks(cfg, max_in_flight, max_chunk)


def peak_blocks(
    prompt_len: int, total_len: int, cfg: WindowConfig, max_in_flight: int, max_chunk: int | None = None
) -> int:
    """Most blocks a request with this window ever holds, computing ``total_len`` tokens
    (prompt plus the most it may generate) of which ``prompt_len`` are prompt. A ``once`` window
    holds its whole prompt until the compaction at its end is processed, and under asynchronous
    scheduling (``max_in_flight`` beyond one chunk) one more token's block beside it
    (:func:`settle_limit`)."""
    bs = cfg.block_size
    full = -(-total_len // bs)
    if not cfg.enabled:
        return full
    if cfg.trigger == "chunked":
        prefill = min(window_bound_blocks(cfg, max_in_flight, max_chunk), full)
        if cfg.decode:
            return prefill
        # E stays at its last boundary inside the prompt while the request decodes.
        return min(full, max(prefill, full - evicted_tokens(prompt_len, prompt_len, cfg) // bs))
    in_flight = 1 if max_in_flight > (max_chunk or max_in_flight) and total_len > prompt_len else 0
    return min(full, max(-(-(prompt_len + in_flight) // bs), full - _floor_evict(prompt_len, cfg) // bs))


@dataclass(frozen=True)
class StepWindow:
    """What one step does to one request: attend over ``[e_prev, L)``, then keep ``[e_new, L)``."""

    e_prev: int
    e_new: int
    L: int

    @property
    def compacts(self) -> bool:
        return self.e_new > self.e_prev

    @property
    def kept(self) -> int:
        return self.L - self.e_new


def step_window(L_prev: int, L: int, prompt_len: int, cfg: WindowConfig) -> StepWindow:
    return StepWindow(evicted_tokens(L_prev, prompt_len, cfg), evicted_tokens(L, prompt_len, cfg), L)
