# SPDX-License-Identifier: Apache-2.0
"""Per-step planning on the worker: which window each request attends over, and which compact.

Device-agnostic (every builder shares it). The runner's ``CommonAttentionMetadata`` carries
*logical* sequence lengths and block tables; for the kernel we hand it the physical window
``[e_prev, L)``: ``block_table[r, e_prev/bs:]`` and ``seq_lens - e_prev`` (docs/architecture.md,
"The contract"). Positions and slot_mapping stay logical, so RoPE and the KV write are untouched.
Each row's window comes from its request's own settings, resolved the first time a step schedules
the request and kept in the worker's registry (:data:`vllm_kvevict.request.WORKER`) while the model
runner holds it; the rows' requests come from the runner's step hook
(:func:`vllm_kvevict.vllm_compat.runner.current_step`); a step without it is never planned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from vllm_kvevict.backends import fault
from vllm_kvevict.backends.tier_store import TIERS, Tier
from vllm_kvevict.config import KVEvictConfig
from vllm_kvevict.kernels import torch_ops
from vllm_kvevict.request import WORKER, LayerState, RequestState, resolve
from vllm_kvevict.vllm_compat.runner import RunnerStep
from vllm_kvevict.window import last_boundary, step_window

#: ``(row, start, end)``: a row's logical tokens ``[start, end)``
Ranges = tuple[tuple[int, int, int], ...]


@dataclass
class StepPlan:
    """The window of every row in this step; shared by all layers of the KV cache group."""

    L_prev: list[int]  # logical tokens computed before this step
    e_prev: list[int]
    e_new: list[int]
    seq_lens: list[int]  # logical L after this step
    block_table: torch.Tensor  # the runner's unshifted [rows, max_blocks] table
    slot_mapping: torch.Tensor  # [num_actual_tokens] logical slots of this step's tokens
    positions: torch.Tensor  # [num_actual_tokens]
    req_ids: list[str] | None
    #: per row: the request's state in this worker (its settings, shared prefix, per-layer state);
    #: empty in a dummy batch, whose rows have no request behind them (nothing is evicted)
    states: list[RequestState]
    query_start_loc: list[int]  # [rows + 1] this step's tokens of row r: [qsl[r], qsl[r + 1])
    prompt_lens: list[int] | None = None  # per row (None in a dummy batch)
    starts: frozenset[str] = frozenset()  # requests starting an attempt in this step
    #: blocks copied before this step's forward (vLLM's copy-on-write), ``(source, destination)``
    block_copies: tuple[tuple[int, int], ...] = ()
    #: the windows of each set of rows the eviction step works on, the same in every layer: computed
    #: by the step's first layer (:func:`vllm_kvevict.backends.evict.step_geometry`)
    geometries: dict[tuple, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    _slots: dict[tuple[int, Ranges], torch.Tensor] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    _copied: tuple[torch.Tensor, torch.Tensor] | None = dataclasses.field(default=None, compare=False, repr=False)

    def completes_prompt(self, r: int) -> bool:
        """Whether row ``r``'s prompt is completed in this step."""
        return self.prompt_lens is not None and self.L_prev[r] < self.prompt_lens[r] <= self.seq_lens[r]

    def copied_slots(self, block_size: int, device=None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The slots of the blocks copied before this step (:attr:`block_copies`): sources and
        destinations, in the same order (None: none), on ``device`` (the block table's by
        default); made once for every layer of the step."""
        if not self.block_copies:
            return None
        if self._copied is None:
            self._copied = self._copied_slots(block_size, device if device is not None else self.block_table.device)
        return self._copied

    def _copied_slots(self, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        src, dst = (torch_ops.on_device([p[i] for p in self.block_copies], device) for i in (0, 1))
        within = torch.arange(block_size, device=device)
        return (src[:, None] * block_size + within).flatten(), (dst[:, None] * block_size + within).flatten()

    @property
    def compact_rows(self) -> list[int]:
        return [r for r, (a, b) in enumerate(zip(self.e_prev, self.e_new)) if b > a]

    def layer_state(self, r: int, key: Hashable) -> LayerState:
        """What this worker keeps of row ``r``'s request in the layer ``key`` (it starts empty with
        every attempt: :meth:`~vllm_kvevict.request.RequestState.restart`)."""
        if not self.states:
            raise RuntimeError("kvevict: query-window policies and recall need the runner hook (request ids)")
        return self.states[r].layer(key)

    @cached_property
    def written(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots this step's tokens were written to and their positions ``[n, 1]`` (int32). A
        token vLLM writes nowhere (a padding slot, -1) is sent to slot 0, in vLLM's null block,
        which no request holds and nothing reads: filtering it out would read the device."""
        return self.slot_mapping.clamp(min=0), self.positions.to(torch.int32)[:, None]

    @cached_property
    def arange(self) -> torch.Tensor:
        """``[max L]`` int64 ``0, 1, ...`` on the device: a row's positions ``[a, b)`` are a view of
        it (``arange[a:b]``), made once per step, not once per row and layer."""
        return torch.arange(max(self.seq_lens, default=0), device=self.block_table.device)

    @cached_property
    def recall_ends(self) -> list[int]:
        """Rows whose prompt completes in this step with recall on."""
        if self.prompt_lens is None:
            return []
        return [
            r
            for r, st in enumerate(self.states)
            if st.settings.evicts and st.settings.recall.enabled and self.completes_prompt(r)
        ]

    def slots(self, ranges: Ranges, block_size: int) -> torch.Tensor:
        """The physical slots of each ``(row, start, end)``'s logical tokens ``[start, end)``, packed;
        computed by the step's first layer that asks, kept for the others."""
        key = (block_size, ranges)
        slots = self._slots.get(key)
        if slots is None:
            dev = self.block_table.device
            rows, starts, ends = (torch_ops.on_device(col, dev) for col in zip(*ranges))
            cu = torch_ops.Ragged.of([b - a for _, a, b in ranges], dev)
            blocks, offs, _ = torch_ops.logical_tokens(self.block_table, rows, starts, ends, block_size, cu)
            slots = self._slots[key] = blocks * block_size + offs
        return slots

    def in_order(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The slots and positions of the tokens that requests starting an attempt on a prefix-cache
        hit hold in their logical order: past the last compaction point of the window they start on
        (all of a pure hit). Their blocks may be copies the engine core made (vLLM's
        ``kv_cache_block_copies``: the KV, not this plugin's per-slot positions), so every layer
        writes their positions, whatever the request's own settings (a pure copy is any request's
        hit); a block read where it is cached gets the same positions again."""
        ranges = self._in_order_ranges
        if not ranges:
            return None
        return self.slots(ranges, block_size), self._in_order_positions

    @cached_property
    def _in_order_ranges(self) -> Ranges:
        if self.req_ids is None or self.prompt_lens is None:
            return ()
        ranges: list[tuple[int, int, int]] = []
        for r, rid in enumerate(self.req_ids):
            L0 = self.L_prev[r]
            if rid not in self.starts or L0 <= 0:
                continue
            window, prompt = self.states[r].settings.window, self.prompt_lens[r]
            start = last_boundary(L0 if window.decode else min(L0, prompt), window) if self.e_prev[r] > 0 else 0
            if start < L0:
                ranges.append((r, start, L0))
        return tuple(ranges)

    @cached_property
    def _in_order_positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(a, b) for _, a, b in self._in_order_ranges])


#: Called with every step's plan, before the step's forward (none by default; the engine tests
#: install one through :mod:`vllm_kvevict.testing.hooks` to stop a step at a point of their choosing).
_planned: list[Callable[[StepPlan], None]] = []


def add_plan_listener(listener: Callable[[StepPlan], None]) -> None:
    """Call ``listener(plan)`` with every step's plan, before the step's forward (once per listener)."""
    if listener not in _planned:
        _planned.append(listener)


def notify_planned(plan: StepPlan) -> None:
    for listener in _planned:
        listener(plan)


class MissingStepContext(RuntimeError):
    """Attention metadata was built outside the model runner's step hook."""


def request_states(step: RunnerStep, L_prev: list[int], server: KVEvictConfig, block_size: int) -> list[RequestState]:
    """The worker's state of each row's request: made (its settings resolved) the first time a step
    schedules the request; restarted in the step an attempt starts, on the prefix-cache hit it
    starts on (its computed tokens at the step's start: the engine core records the same number
    when it hands the hit over, kv_manager.py). Requests the runner no longer holds go."""
    WORKER.retain(step.live)
    TIERS.retain(step.live)
    states = []
    for r, rid in enumerate(step.req_ids[: len(L_prev)]):
        extra = step.extra_args[r]
        st = WORKER.open(rid, lambda: resolve(server, extra, block_size))  # called here, if at all
        if rid in step.starts:
            st.restart(L_prev[r])
            for key, snap in (TIERS.started(rid) or {}).items():  # a cached window's recall tier
                ls = st.layer(key)
                ls.tier, ls.recall_queries = Tier.of(snap.entries, st.settings.recall.cap), snap.queries
            if TIERS.lost(rid):  # its window's tier is not here: the engine core hears of it
                fault.fall_back(st, rid, st.settings.policy, RuntimeError("its window's recall tier is missing"))
        states.append(st)
    return states


def plan_step(cm, server_config, block_size: int, step: RunnerStep | None) -> StepPlan:
    """Each row's window for this step, from its request's own settings.

    ``step``: the rows' requests as the runner hook published them. A dummy batch (profiling,
    warm-up, graph capture) has no requests behind its rows: nothing is evicted. Without ``step``
    the rows' configurations are unknown: refused (:class:`MissingStepContext`), never guessed.
    """
    n = cm.num_reqs
    seq_lens = cm.seq_lens[:n].tolist()
    qsl = cm.query_start_loc_cpu[: n + 1].tolist()
    L_prev = [seq_lens[r] - (qsl[r + 1] - qsl[r]) for r in range(n)]
    T = cm.num_actual_tokens
    common = dict(
        seq_lens=seq_lens,
        block_table=cm.block_table_tensor[:n],
        slot_mapping=cm.slot_mapping[:T],
        positions=cm.positions[:T] if cm.positions is not None else None,
        query_start_loc=qsl,
        L_prev=L_prev,
    )
    if step is not None and step.dummy:
        return StepPlan(e_prev=[0] * n, e_new=[0] * n, req_ids=None, states=[], **common)
    if step is None or len(step.req_ids) < n:
        raise MissingStepContext(
            "kvevict: attention metadata built without the model runner's step hook (no request ids, prompt "
            "lengths or per-request configuration); this model runner is not supported"
        )
    states = request_states(step, L_prev, server_config, block_size)
    steps = [
        step_window(L_prev[r], seq_lens[r], step.prompt_lens[r], st.settings.window) for r, st in enumerate(states)
    ]
    return StepPlan(
        e_prev=[s.e_prev for s in steps],
        e_new=[s.e_new for s in steps],
        req_ids=step.req_ids[:n],
        states=states,
        prompt_lens=step.prompt_lens[:n],
        starts=step.starts,
        block_copies=step.block_copies,
        **common,
    )


def cascade_prefix_len(plan: StepPlan, common_prefix_len: int) -> int:
    """The common prefix vLLM's cascade attention may use in this step: none once any row attends
    over a shifted window (``e_prev > 0``): the runner measured the prefix on the logical block
    tables, and a shifted row's table no longer starts with those blocks."""
    return 0 if any(plan.e_prev) else common_prefix_len


def shift_block_table(block_table: torch.Tensor, shift_blocks: torch.Tensor) -> torch.Tensor:
    """Row r of the result is ``block_table[r, shift_blocks[r]:]``, padded with the null block 0."""
    rows, width = block_table.shape
    idx = torch.arange(width, device=block_table.device)[None, :] + shift_blocks[:, None]
    out = torch.gather(block_table, 1, idx.clamp(max=width - 1))
    return out.masked_fill(idx >= width, 0)


def shifted_metadata(cm, plan: StepPlan, block_size: int):
    """``cm`` with the kernel's view of the window: shifted block table and physical lengths."""
    if not any(plan.e_prev):
        return cm
    n = cm.num_reqs
    e_prev = torch_ops.on_device(plan.e_prev, cm.seq_lens.device, cm.seq_lens.dtype)
    seq_lens = cm.seq_lens.clone()
    seq_lens[:n] -= e_prev
    bt = cm.block_table_tensor.clone()
    bt[:n] = shift_block_table(cm.block_table_tensor[:n], (e_prev // block_size).to(torch.long))
    longest = max(L - e for L, e in zip(plan.seq_lens, plan.e_prev))  # on the host: no device read
    return dataclasses.replace(cm, seq_lens=seq_lens, block_table_tensor=bt, max_seq_len=longest)
