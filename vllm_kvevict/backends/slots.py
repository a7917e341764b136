# SPDX-License-Identifier: Apache-2.0
"""What a layer keeps per physical slot of its KV cache, beside the cache: each token's position
(per KV head, moved with the token at every compaction), the per-slot state of policies that
observe (H2O's accumulated attention, TOVA's), and a snapshot of that state as each compaction
left a window that may be cached for other requests (docs/architecture.md, "Compressed windows").

Allocated the first time a layer needs them, after vLLM has sized its pool: an allocation that
fails falls back the requests of the step that needed it and never reaches the engine
(``KVEVICT_TEST_FAULT=@alloc:<site>`` makes :func:`per_slot` and :func:`rows_of` fail).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from vllm_kvevict.backends import fault
from vllm_kvevict.backends.evict import RowWork
from vllm_kvevict.backends.plan import StepPlan


def per_slot(site: str, kv_cache: torch.Tensor, dtype: torch.dtype, init: float) -> torch.Tensor:
    """A ``[num_slots, H]`` tensor beside a layer's KV cache, filled with ``init``: its slot
    positions (``site`` ``"positions"``), a policy's per-slot state (``"state"``) or its snapshot
    of compacted windows (``"snapshot"``)."""
    nb, H, bs = kv_cache.shape[:3]
    return torch.full((nb * bs, H), init, dtype=dtype, device=kv_cache.device)


def rows_of(site: str, t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]``, a copy: a request's own copy of a cached window's state (``site``
    ``"overlay"``), guarded like :func:`per_slot`."""
    return t[idx]


class SlotStore:
    """One layer's per-slot positions, policy state and window snapshots (``[num_slots, H]`` each)."""

    def __init__(self) -> None:
        self._positions: torch.Tensor | None = None
        #: per-slot policy state by name, like the positions
        self.state: dict[str, torch.Tensor] = {}
        #: the per-slot state of every window as its compaction left it (read by requests that
        #: start on the window once it is cached)
        self._snapshots: dict[str, torch.Tensor] = {}

    def positions(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """Per-slot, per-head absolute positions (int32), moved with the tokens at every compaction."""
        nb, _H, bs = kv_cache.shape[:3]
        if self._positions is None or self._positions.shape[0] != nb * bs:
            self._positions = per_slot("positions", kv_cache, torch.int32, 0)
        return self._positions

    def copy_blocks(self, kv_cache: torch.Tensor, plan: StepPlan) -> None:
        """What vLLM's block copies of this step (copy-on-write, before its forward) do to the KV,
        to the per-slot positions, state and snapshots: a copied window keeps its positions."""
        copied = plan.copied_slots(kv_cache.shape[2], kv_cache.device)
        if copied is None:
            return
        src, dst = copied
        for t in (self._positions, *self.state.values(), *self._snapshots.values()):
            if t is not None:
                t[dst] = t[src]

    def policy_state(
        self, kv_cache: torch.Tensor, name: str, dtype: torch.dtype, init: float, snapshot: bool = False
    ) -> torch.Tensor:
        """A policy's per-slot state ``name`` (``snapshot``: its copy as each window's compaction
        left it), allocated at first use."""
        store = self._snapshots if snapshot else self.state
        t = store.get(name)
        if t is None:
            t = store[name] = per_slot("snapshot" if snapshot else "state", kv_cache, dtype, init)
        return t

    def overlays(self, plan: StepPlan, work: list[RowWork], kv_cache, key: Hashable) -> dict[int, dict]:
        """The per-slot state of the cached windows requests started on, each request's own copy
        (a request whose copy cannot be made falls back: its item in ``work`` is replaced).

        A request that starts an attempt with ``e_prev > 0`` starts on a cached window (the engine
        core cuts a pure hit below the first compaction point): its first ``L_prev - e_prev`` slots
        are the window's blocks, shared, and their live state belongs to whoever compacted them
        (and goes on observing them). The request reads the state as the window's compaction left
        it (:meth:`snapshot_stores`), observes into its copy, and drops the copy once its next
        compaction has moved past the window."""
        out = {}
        req_ids = plan.req_ids or []
        for i, w in enumerate(work):
            needs, r = w.policy.needs, w.row
            if not needs.state:
                continue
            ls = plan.layer_state(r, key)
            if ls.window_state is None and req_ids[r] in plan.starts and plan.e_prev[r] > 0:
                try:
                    slots = plan.slots(((r, plan.e_prev[r], plan.L_prev[r]),), kv_cache.shape[2])
                    ls.window_state = {
                        k: rows_of("overlay", self.policy_state(kv_cache, k, dtype, init, snapshot=True), slots)
                        for k, (dtype, init) in needs.state.items()
                    }
                except Exception as err:  # noqa: BLE001 - e.g. out of memory: this request falls back
                    fault.fall_back(plan.states[r], req_ids[r], w.policy, err)
                    work[i] = RowWork(r, fault.SAFE_POLICY, w.compact, keep_evicted=w.keep_evicted)
                    continue
            if ls.window_state is not None:
                out[r] = ls.window_state
        return out

    def snapshot_stores(self, plan: StepPlan, work: list[RowWork], kv_cache) -> dict[str, torch.Tensor]:
        """Where the step keeps the per-slot state each compaction leaves in its window, for the
        requests that share their windows (``{name: [slots, H]}``; empty when no compacting row
        shares one). The compaction writes the kept tokens' state there as well as to their slots
        (every compacting row's: only a shared window is ever read). Requests whose snapshot
        cannot be had fall back (a window is cached with its state or not at all: the engine core
        hears of the fallback before it caches the window)."""
        rows = [w for w in work if w.compact and w.policy.needs.state and plan.states[w.row].settings.shares_windows]
        try:
            return {
                k: self.policy_state(kv_cache, k, dtype, init, snapshot=True)
                for w in rows
                for k, (dtype, init) in w.policy.needs.state.items()
            }
        except Exception as err:  # noqa: BLE001 - their windows go without their state: not cached
            fault.fall_back_rows(plan, err, [w.row for w in rows])
            return {}

    def drop_window_copies(self, plan: StepPlan, work: list[RowWork], key: Hashable) -> None:
        """A row's copy of the window it started on, dropped once it has compacted past it."""
        for w in work:
            ls = plan.states[w.row].layers.get(key) if w.compact and w.policy.needs.state else None
            if ls is not None:
                ls.window_state = None
