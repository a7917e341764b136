# SPDX-License-Identifier: Apache-2.0
"""One attention layer's eviction, composed into vLLM's attention impl
(:class:`~vllm_kvevict.backends.base.KVEvictImplMixin` calls :meth:`LayerEviction.before` and
:meth:`LayerEviction.after` around the impl's ``forward``).

After attention, a short pipeline over the step's plan: each row's policy (the safe one where its
state cannot be had; recall's score where a prompt completes with a compaction after recall
re-selected its window) -> the step's slot positions recorded and its policies' per-slot state reset
(one write) -> (``recall.prefill: all``) the prefill chunks' attention over the window and the
tier -> the rows with work, their inputs prepared (a row whose inputs cannot be, falls back) -> the
eviction step, one request's failure isolated -> what the step dropped to recall -> recall's
re-selection at a prompt's end -> report.
Before attention, in a step that completes a prompt with recall on, recall re-selects the window
the prompt's last tokens attend to. Whatever escapes the guards of each part falls back the step's
evicting requests and never reaches vLLM.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch

from vllm_kvevict import envs, metrics, profiling
from vllm_kvevict._logging import logger
from vllm_kvevict.backends import fault
from vllm_kvevict.backends.dump import dump_kept
from vllm_kvevict.backends.evict import RowWork, evict_step
from vllm_kvevict.backends.layout import CacheLayout, Heads
from vllm_kvevict.backends.plan import StepPlan
from vllm_kvevict.backends.projection import output_projection
from vllm_kvevict.backends.queries import QueryWindows, Renewal
from vllm_kvevict.backends.recall import Recall
from vllm_kvevict.backends.slots import SlotStore
from vllm_kvevict.kernels import ops
from vllm_kvevict.policies.base import RowInputs, step_queries


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


class LayerEviction:
    """One attention layer's eviction: its per-slot positions and state (:class:`SlotStore`), its
    requests' query windows, its output projection for policies that read W_O, and its recall
    (:class:`~vllm_kvevict.backends.recall.Recall`). ``layout``: how the layer's cache holds a
    token; ``heads``: its attention on this rank; ``name``: vLLM's layer name (the key of the
    layer in a request's per-layer state, and where W_O is found); ``index``: its index in the model."""

    def __init__(self, layout: CacheLayout, heads: Heads, name: str, index: int) -> None:
        self.layout, self.heads, self.name, self.index = layout, heads, name, index
        self.key = name or f"layer@{id(self)}"
        self.slots = SlotStore()
        self.recall = Recall(layout, self.slots, heads, self.key, index)
        self.windows = QueryWindows("queries")
        self._w_o: torch.Tensor | None = None

    def before(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: StepPlan) -> None:
        """Before the layer's attention: the per-slot positions and state of the blocks vLLM copied
        for this step, and the positions of the hits of requests starting in it (before recall
        re-selects a window and tail a request starts on: they then hold other tokens); recall's
        re-selection of the windows of prompts that complete in it."""
        if plan.block_copies:
            with _guarded(plan):
                self.slots.copy_blocks(kv_cache, plan)
        in_order = plan.in_order(kv_cache.shape[2]) if plan.starts and plan.states else None
        if in_order is not None:
            with _guarded(plan):
                self.slots.positions(kv_cache)[in_order[0]] = in_order[1].to(torch.int32)[:, None]
        if plan.states and plan.recall_ends:
            with _eviction_time(query.device), profiling.timed("recall_s", query.device), _guarded(plan):
                self.recall.before_attention(query, kv_cache, plan)

    def attend_instead(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: StepPlan, out: torch.Tensor) -> bool:
        """In place of vLLM's attention, when the step's K/V is already in the cache and recall's
        (``recall.prefill: all``) computes every row of the step over its window and tier: vLLM's
        would be replaced row by row. True when ``out`` holds every row; False when nothing was
        skipped or a row's recall failed (vLLM's attention then runs, and :meth:`after` replaces
        what it can)."""
        if not plan.states or not self.recall.attends_every_row(plan):
            return False
        done = False
        with _eviction_time(query.device), _guarded(plan):
            done = self.recall.attend_all(query, out, kv_cache, plan)
        if done and profiling.enabled():
            profiling.add(attention_replaced=1)  # layers whose vLLM attention did not run
        return done

    def after(
        self, query: torch.Tensor, kv_cache: torch.Tensor, plan: StepPlan, out: torch.Tensor, attended: bool = False
    ) -> None:
        """After the layer's attention (``out``: its output, ``[tokens, H_q * d]``; ``attended``:
        computed by :meth:`attend_instead`): the pipeline of the module's doc."""
        if not plan.states:  # a dummy batch: no request behind its rows
            return
        with _eviction_time(query.device), _guarded(plan):
            policies = self._policies(kv_cache, plan)
            slot_pos = self._record(kv_cache, plan, policies)
            if slot_pos is None:
                return
            if not attended:
                self.recall.attend_all(query, out, kv_cache, plan)
            scored = self.recall.score_prompt_ends(plan, policies)
            recall_rows = self.recall.rows(plan, policies, query)
            work = self._work(plan, policies, query, recall_rows - scored)  # what those drop is not recalled
            if not work and not recall_rows:
                return
            evicted: dict = {}
            kept = self._run(kv_cache, plan, work, slot_pos, evicted if recall_rows else None)
            self.recall.stash(plan, evicted)
            kept.update(self.recall.at_prompt_end(kv_cache, plan, recall_rows))
            self._report(kv_cache, plan, kept)

    def _record(self, kv_cache, plan: StepPlan, policies: list) -> torch.Tensor | None:
        """The slot positions with this step's written slots recorded (those of hits were, before
        attention), and the per-slot state of the rows' policies reset there to its initial value;
        None when the positions cannot be had (their rows fall back, windows left as they are)."""
        try:
            slot_pos = self.slots.positions(kv_cache)
        except Exception as err:  # noqa: BLE001 - no positions to score by: windows left as they are
            fault.fall_back_rows(plan, err)
            return None
        needs = {name: init for p in policies if p is not None for name, (_, init) in p.needs.state.items()}
        ops.record_slots(slot_pos, *plan.written, [(self.slots.state[k], init) for k, init in needs.items()])
        return slot_pos

    def _policies(self, kv_cache, plan: StepPlan) -> list:
        """Each row's policy (None: it does not evict), its per-slot state allocated the first time
        a policy needs it; a request whose policy's state cannot be had (out of memory) falls back
        to the safe policy, which keeps none."""
        done = plan.prompt_lens  # a row decoding: its prompt was complete before this step
        policies = [
            fault.policy_of(st, done is not None and plan.L_prev[r] >= done[r]) if st.settings.evicts else None
            for r, st in enumerate(plan.states)
        ]
        for p in {id(p): p for p in policies if p is not None}.values():
            try:
                for name, (dtype, init) in p.needs.state.items():
                    self.slots.policy_state(kv_cache, name, dtype, init)
            except Exception as err:  # noqa: BLE001 - those requests fall back, the engine goes on
                for r, q in enumerate(policies):
                    if q is p:
                        fault.fall_back(plan.states[r], plan.req_ids[r] if plan.req_ids else None, p, err)
                        policies[r] = fault.SAFE_POLICY
        return policies

    def _work(self, plan: StepPlan, policies: list, query, recall_rows: set[int]) -> list[RowWork]:
        """The rows with something to do in this step, each with what its policy reads; a row whose
        inputs cannot be prepared (e.g. no W_O on this model) falls back to the safe policy."""
        compact = set(plan.compact_rows)
        windows = self.query_windows(plan, policies, query)
        work = []
        for r, policy in enumerate(policies):
            if policy is None:
                continue
            try:
                item = self._row_work(plan, r, policy, r in compact, query, windows.get(r))
            except Exception as err:  # noqa: BLE001 - e.g. no W_O on this model: that request falls back
                fault.fall_back(plan.states[r], plan.req_ids[r] if plan.req_ids else None, policy, err)
                try:
                    item = self._row_work(plan, r, fault.SAFE_POLICY, r in compact, query, None)
                except Exception:  # noqa: BLE001 - the safe policy reads nothing it prepares
                    item = RowWork(r, fault.SAFE_POLICY, True) if r in compact else None
            if item is not None:
                if r in recall_rows:
                    item.keep_evicted = True
                work.append(item)
        return work

    def query_windows(self, plan: StepPlan, policies: list, query) -> dict[int, torch.Tensor]:
        """The query windows of the rows whose policy keeps one (they move every step), renewed
        together: row -> its last ``w`` queries ``[H_q, <=w, d]``, this step's included. Queries
        kept from an earlier step at positions this step computes again go first: speculative
        decoding's draft tokens that the sampler rejected (their positions are now other
        tokens'). If they cannot be renewed (out of memory), those rows fall back."""
        rows = [r for r, p in enumerate(policies) if p is not None and p.needs.query_window]
        if not rows:
            return {}
        qsl, renewals = plan.query_start_loc, []
        for r in rows:
            ls = plan.layer_state(r, self.key)
            Q = query[qsl[r] : qsl[r + 1]].transpose(0, 1)  # [H_q, m, d]
            renewals.append(Renewal(ls, Q, policies[r].needs.query_window, max(0, ls.queries_end - plan.L_prev[r])))
        try:
            got = self.windows.renew(renewals)
        except Exception as err:  # noqa: BLE001 - e.g. out of memory: those requests fall back
            for r in rows:
                fault.fall_back(plan.states[r], plan.req_ids[r] if plan.req_ids else None, policies[r], err)
                policies[r] = fault.SAFE_POLICY
            return {}
        for r in rows:
            plan.layer_state(r, self.key).queries_end = plan.seq_lens[r]
        return dict(zip(rows, got))

    def _row_work(
        self, plan: StepPlan, r: int, policy, compacts: bool, query, window: torch.Tensor | None
    ) -> RowWork | None:
        """What row ``r``'s policy needs besides the KV (its :class:`~vllm_kvevict.policies.Needs`:
        queries, W_O), or None when it has nothing to do in this step. ``window``: its query window
        (a policy with one)."""
        needs = policy.needs
        if not compacts and not needs.observes:
            return None
        qsl, L = plan.query_start_loc, plan.seq_lens[r]
        Q_sel: torch.Tensor | None
        q_pos: torch.Tensor | None
        if needs.query_window:
            if window is None:
                raise RuntimeError("kvevict: the row's query window was not renewed")
            Q_sel, q_pos = window, plan.arange[L - window.shape[1] : L]
        else:
            Q = query[qsl[r] : qsl[r + 1]].transpose(0, 1)  # [H_q, m, d]
            Q_sel, q_pos = step_queries(needs, Q, plan.positions[qsl[r] : qsl[r + 1]].long())
        h = self.heads
        inputs = RowInputs(
            L=L,
            budget=plan.states[r].settings.budget,
            scale=h.scale,
            softcap=h.softcap,
            sinks=h.sinks,
            Q=Q_sel,
            q_pos=q_pos,
            W_O=self.w_o() if needs.w_o and compacts else None,
        )
        return RowWork(r, policy, compacts, inputs)

    def w_o(self) -> torch.Tensor:
        """The layer's output projection ``[H_q, d, D]`` on this rank, read the first time a policy asks."""
        if self._w_o is None:
            w = output_projection(self.name)  # [H_q d, D]
            self._w_o = w.reshape(self.heads.num_heads, -1, w.shape[-1]).contiguous()
        return self._w_o

    def _run(self, kv_cache, plan: StepPlan, work: list[RowWork], slot_pos, evicted: dict | None) -> dict:
        """Run the eviction step over ``work`` (one request's failure isolated: fault.isolate),
        keep the windows' per-slot state for requests that share them; returns each compacted
        row's kept positions. ``evicted`` gathers what recall keeps of the dropped tokens."""
        if not work:
            return {}
        bs, state = kv_cache.shape[2], self.slots.state
        overlays = self.slots.overlays(plan, work, kv_cache, self.key) if state else None
        snapshots = self.slots.snapshot_stores(plan, work, kv_cache) if state else {}
        views = self.layout.views(kv_cache)

        def step(items: list[RowWork]) -> list[torch.Tensor | None]:
            return evict_step(
                plan,
                items,
                bs,
                gather=partial(self.layout.gather, kv_cache),
                write=partial(self.layout.write, kv_cache),
                slot_pos=slot_pos,
                slot_state=state,
                layer=self.index,
                G=self.heads.G,
                views=views,
                evicted=evicted,
                overlays=overlays,
                positions=bool(envs.KVEVICT_DUMP_DIR),  # read by the dump only
                snapshots=snapshots,
            )

        def in_place(r: int) -> torch.Tensor:
            """Row ``r``'s window left as it is (the last resort): its slots ``[E_new, L)``."""
            e = plan.e_new[r]
            return slot_pos[plan.slots(((r, e, plan.seq_lens[r]),), bs)].long()

        try:
            kept = step(work)
        except Exception as err:  # noqa: BLE001 - one request's policy must never kill the engine
            work, kept = fault.isolate(plan, work, step, err, in_place)
        if state:
            self.slots.drop_window_copies(plan, work, self.key)
        return dict(zip([w.row for w in work if w.compact], kept))

    def _report(self, kv_cache, plan: StepPlan, kept_by_row: dict) -> None:
        """The kept positions to the dump (``KVEVICT_DUMP_DIR``) and, at DEBUG, each compaction."""
        rows = sorted(kept_by_row)
        if envs.KVEVICT_DUMP_DIR and rows:
            heads = list(self.heads.model_kv_heads)
            dump_kept(plan, rows, self.index, [kept_by_row[r] for r in rows], heads, kv_cache.shape[2])
        if self.index == 0:
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
