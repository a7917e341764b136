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
    ``E = bs * floor(max(0, L - budget) / bs)`` after every step: between steps the window stays in
    ``[budget, budget + bs)``; inside a prefill step it peaks at ``budget + bs - 1 + chunk``.
    With ``decode=True`` this continues while decoding, so a compaction happens every ``bs``
    generated tokens; with ``decode=False`` ``E`` stops growing once the prompt is complete.
``once``
    Nothing is evicted until the prompt is complete; then ``E = E_chunked(prompt_len)``, fixed
    during decoding (CriticalKV and KVMerger as published).

Shared prefix (prefix caching):
    A request that starts (or restarts after preemption) on ``shared`` tokens found in vLLM's
    prefix cache holds their blocks read-only: other requests and the cache hold them too. Its
    window may only be written at or above ``shared``, so ``E`` stays 0 until the trigger's ``E``
    reaches ``shared`` (``E = E_trigger(L) if E_trigger(L) >= shared else 0``): the first
    compaction then frees every shared block at once and writes only into the request's own
    blocks. Until then the request holds its shared prefix on top of its window.

``E`` is a multiple of ``block_size`` and non-decreasing in ``L`` for a fixed configuration and
shared prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Trigger = Literal["chunked", "once"]
TRIGGERS: tuple[str, ...] = ("chunked", "once")


@dataclass(frozen=True)
class WindowConfig:
    """The integers that determine ``E``; identical in the scheduler and in every worker."""

    budget: int
    block_size: int
    trigger: Trigger = "chunked"
    decode: bool = True
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.budget < 1 or self.block_size < 1:
            raise ValueError(f"budget and block_size must be positive, got {self.budget}, {self.block_size}")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"trigger must be one of {TRIGGERS}, got {self.trigger!r}")


def _floor_evict(n: int, cfg: WindowConfig) -> int:
    return cfg.block_size * (max(0, n - cfg.budget) // cfg.block_size)


def evicted_tokens(L: int, prompt_len: int, cfg: WindowConfig, shared: int = 0) -> int:
    """Number of leading logical tokens (a multiple of ``block_size``) evicted at ``L`` computed
    tokens, for a request whose first ``shared`` tokens are in shared (prefix-cached) blocks."""
    if not cfg.enabled:
        return 0
    if cfg.trigger == "once":
        e = _floor_evict(prompt_len, cfg) if L >= prompt_len else 0
    else:
        e = _floor_evict(L if cfg.decode else min(L, prompt_len), cfg)
    return e if e >= shared else 0


def window_bound_blocks(cfg: WindowConfig, max_chunk: int) -> int:
    """Most blocks a request holds at any time in ``chunked`` mode: ``budget + bs - 1 + chunk`` tokens."""
    return -(-(cfg.budget + cfg.block_size - 1 + max_chunk) // cfg.block_size)


def admission_blocks(cfg: WindowConfig, max_chunk: int, shared: int = 0) -> int | None:
    """The blocks vLLM's admission gate reserves for a request with this window: its bound in
    ``chunked`` mode with decode-time eviction, plus its shared prefix's blocks (held until the
    window moves past them); ``None`` (the whole sequence) otherwise."""
    if not cfg.enabled or cfg.trigger != "chunked" or not cfg.decode:
        return None
    return window_bound_blocks(cfg, max_chunk) + shared // cfg.block_size


def peak_blocks(prompt_len: int, total_len: int, cfg: WindowConfig, max_chunk: int) -> int:
    """Most blocks a request with this window ever holds, computing ``total_len`` tokens
    (prompt plus the most it may generate) of which ``prompt_len`` are prompt."""
    bs = cfg.block_size
    full = -(-total_len // bs)
    if not cfg.enabled:
        return full
    prefill = min(window_bound_blocks(cfg, max_chunk), full) if cfg.trigger == "chunked" else -(-prompt_len // bs)
    if cfg.trigger == "chunked" and cfg.decode:
        return prefill
    # E stays at its value for the whole prompt while the request decodes.
    return min(full, max(prefill, full - _floor_evict(prompt_len, cfg) // bs))


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


def step_window(L_prev: int, L: int, prompt_len: int, cfg: WindowConfig, shared: int = 0) -> StepWindow:
    return StepWindow(evicted_tokens(L_prev, prompt_len, cfg, shared), evicted_tokens(L, prompt_len, cfg, shared), L)
