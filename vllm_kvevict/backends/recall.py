# SPDX-License-Identifier: Apache-2.0
"""The recall tier: evicted tokens kept outside vLLM's pool, recalled when the prompt completes.

Chunk-wise eviction decides what to keep before the end of the prompt is seen; in a long-context
request the question usually comes last. With recall on, every compaction hands the tokens it drops
(their K and V, positions, per-slot policy state and the score they were dropped with) to this tier,
per request, layer and KV head, instead of discarding them. In the step that completes the prompt,
the window is selected again from the kept tokens and the tier together, by the attention the
prompt's last ``window`` queries pay them (max-pooled over neighbouring positions, as SnapKV pools),
keeping the same count per KV head, and written back into the window (``[E, L)``, in position
order) with the backend's own writer. The contract is unchanged: ``E`` does not move, only what the
window holds does, so the engine core never knows.

The tier lives in host memory, never in vLLM's pool: on the CPU engine beside the KV cache; on a
GPU server in pinned host memory, copied from the device asynchronously (the copy is ordered on the
step's stream and waited for only when the tier next merges, a step later, or at recall, when it is
copied back the same way). It is bounded by ``recall.max_bytes`` per worker (every request and
layer) and, where set, by ``recall.cap`` tokens per request, layer and KV head (plus, on a GPU, the
newest compaction's tokens while their copy is in flight): when full, every request keeps at
least its share of the budget and drops its own lowest-scored tokens first (scores of different
policies are not comparable, and one tenant must not empty another's tier). It is part of the request's state in the worker
(:class:`~vllm_kvevict.request.LayerState`), so it goes when the request finishes, is aborted or
restarts after preemption.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from vllm_kvevict import envs, metrics, profiling
from vllm_kvevict._logging import logger
from vllm_kvevict.backends import fault
from vllm_kvevict.backends.dump import dump_kept
from vllm_kvevict.backends.layout import CacheLayout, Heads
from vllm_kvevict.backends.queries import QueryWindows, Renewal
from vllm_kvevict.backends.slots import SlotStore
from vllm_kvevict.backends.tier_store import TIERS, Candidates, Tier, TierEntry, best_entries, merge_entries
from vllm_kvevict.kernels import ops, torch_ops
from vllm_kvevict.kernels.torch_ops import Ragged
from vllm_kvevict.policies.attention import pool1d
from vllm_kvevict.request import WORKER


def worker_tiers() -> list[Tier]:
    """Every recall tier of this worker process (all requests and layers)."""
    return [t for req in request_tiers().values() for t in req]


def request_tiers() -> dict[str, list[Tier]]:
    """This worker's recall tiers, its layers' per request that holds any."""
    out = {rid: [ls.tier for ls in st.layers.values() if ls.tier is not None] for rid, st in WORKER.items()}
    return {rid: req for rid, req in out.items() if req}


def fair_shares(held: list[int], max_bytes: int) -> list[int]:
    """How many of ``max_bytes`` each request may hold, ``held`` what each holds: an equal share,
    and what a request holding less leaves is shared by the others (max-min fairness)."""
    shares = [0] * len(held)
    left = max_bytes
    order = sorted(range(len(held)), key=held.__getitem__)
    for n, i in enumerate(order):
        shares[i] = min(held[i], left // (len(held) - n))
        left -= shares[i]
    return shares


def trim_tiers(requests: list[list[Tier]], max_bytes: int) -> int:
    """Keep a worker's tiers (``requests``: each request's tiers, one per layer) within
    ``max_bytes``; returns the bytes dropped. Each request keeps at least its share
    (:func:`fair_shares`), so one tenant's long requests cannot empty the others' tiers, and what a
    request drops is ranked within it alone: the scores of different policies are not comparable
    (StreamingLLM's are positions, SnapKV's attention shares). Within a request a tier keeps its
    ``k`` best tokens of each KV head: its ``j``-th row is worth the mean over heads of each head's
    ``j``-th best score, and rows are kept, best first across the request's layers, while they fit."""
    held = [sum(t.nbytes for t in req) for req in requests]
    if sum(held) <= max_bytes:
        return 0
    for req, has, share in zip(requests, held, fair_shares(held, max_bytes)):
        if has > share:
            _trim_request(req, share)
    return sum(held) - sum(t.nbytes for req in requests for t in req)


def _trim_request(tiers: list[Tier], max_bytes: int) -> None:
    """One request's tiers within ``max_bytes``, its lowest-scored rows first (see :func:`trim_tiers`)."""
    rows = []  # (worth, tier index, bytes of one row)
    entries: list[TierEntry | None] = []
    for i, t in enumerate(tiers):
        e = merge_entries(t.chunks, t.cap)  # a copy still in flight is waited for
        entries.append(e)
        if e is None or not e.tokens:
            continue
        worth = torch.sort(e.score.float(), dim=0, descending=True).values.nan_to_num(neginf=-1e30).mean(dim=1)
        row_bytes = sum(x.nbytes for x in e.tensors()) / e.tokens
        rows += [(float(v), i, row_bytes) for v in worth.tolist()]
    rows.sort(key=lambda x: -x[0])
    keep = [0] * len(tiers)
    used = 0.0
    for _worth, i, b in rows:
        if used + b > max_bytes:
            break
        used += b
        keep[i] += 1
    for t, e, k in zip(tiers, entries, keep):
        t.chunks = [best_entries(e, k)] if e is not None and k else []


def recall_scores(
    Q: torch.Tensor,
    q_pos: torch.Tensor,
    K: torch.Tensor,
    pos: torch.Tensor,
    G: int,
    scale: float,
    softcap: float | None,
    kernel: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[n, H]`` float32: what the queries ``Q [H_q, w, d]`` (at ``q_pos [w]``) pay each candidate
    ``K [n, H, d]`` (at ``pos [n, H]``), softmax over the candidates, causal by position, summed
    over the queries and averaged over each KV head's query group, then max-pooled over the
    ``kernel`` nearest candidates in position order (SnapKV's pooling); ``sinks`` ``[H_q]``: the
    model's learned attention sinks in each softmax. One ragged
    :func:`~vllm_kvevict.kernels.ops.column_sums` (never ``[H, w, n]`` at once)."""
    dev = K.device
    cu_q, cu_k = Ragged.of([Q.shape[1]], dev), Ragged.of([K.shape[0]], dev)  # one row
    A = ops.column_sums(Q.transpose(0, 1), K, q_pos.to(dev), pos, cu_q, cu_k, G, scale, softcap, sinks)  # [n, H_q]
    s = A.view(A.shape[0], -1, G).mean(-1)  # [n, H]
    if kernel > 1 and s.shape[0] > 1:
        order = torch.argsort(pos, dim=0, stable=True)  # [n, H]: candidates by position, per head
        pooled = pool1d(torch.gather(s, 0, order).T, kernel, "max").T  # SnapKV's pooling, by position
        s = torch.empty_like(s).scatter_(0, order, pooled)
    return s


def select_recalled(scores: torch.Tensor, pos: torch.Tensor, keep: int, protect_from: int) -> torch.Tensor:
    """``[keep, H]`` indices of the candidates to keep per KV head, in position order: the
    observation window itself (positions ``>= protect_from``) always, then the best scores (ties:
    the newer)."""
    s = scores.masked_fill(pos >= protect_from, float("inf"))
    idx, _ = ops.select_topk(s, pos, Ragged.of([s.shape[0]], s.device), [keep])  # ascending index
    return torch.gather(idx, 0, torch.argsort(torch.gather(pos, 0, idx), dim=0, stable=True))


class Recall:
    """One layer's recall, composed by :class:`~vllm_kvevict.backends.layer.LayerEviction`: which
    rows keep a tier in a step (their prompt's latest queries kept per layer), what their
    compactions drop into it, and the re-selection of a row's window from what it kept and its
    tier when its prompt completes. Reads and writes the layer's cache through ``layout`` and its
    per-slot positions and state through ``slots``; ``key`` is the layer's key in a request's
    per-layer state, ``index`` its index in the model."""

    def __init__(self, layout: CacheLayout, slots: SlotStore, heads: Heads, key: Hashable, index: int) -> None:
        self.layout, self.slots, self.heads, self.key, self.index = layout, slots, heads, key, index
        self.queries = QueryWindows("recall_queries")

    def rows(self, plan, policies, query) -> set[int]:
        """Rows whose request keeps a recall tier in this step (recall on, its prompt not complete
        before this step, a policy that drops rather than merges), with their query buffers
        updated."""
        rows: set[int] = set()
        if not plan.states or plan.prompt_lens is None:
            return rows
        qsl, renewals = plan.query_start_loc, []
        for r, (st, policy) in enumerate(zip(plan.states, policies)):
            recall = st.settings.recall
            if policy is None or not recall.enabled or policy.needs.merges or plan.L_prev[r] >= plan.prompt_lens[r]:
                continue
            rows.add(r)
            Q = query[qsl[r] : qsl[r + 1]].transpose(0, 1)  # [H_q, m, d]
            renewals.append(Renewal(plan.layer_state(r, self.key), Q, recall.window))
        try:
            self.queries.renew(renewals)  # one copy for every row
        except Exception as err:  # noqa: BLE001 - e.g. out of memory: those rows keep what their policy keeps
            for r in sorted(rows):
                plan.layer_state(r, self.key).tier = None
                self.failed(plan, r, err)
            return set()
        return rows

    def stash(self, plan, evicted: dict) -> None:
        """Hand the tokens this step dropped to their requests' tiers (a tier that cannot take
        them, e.g. out of host memory, is dropped: that layer recalls nothing), bound the tiers'
        memory, record their size at its fullest, and leave a snapshot of the tier of each request
        that shares its windows and compacted at a point before its prompt's end
        (``backends/tier_store.py``)."""
        for r, (K, V, pos, score, state) in evicted.items():
            ls = plan.layer_state(r, self.key)
            try:
                if ls.tier is None:
                    ls.tier = Tier()
                ls.tier.add(TierEntry(K, V, pos, score, state), plan.states[r].settings.recall.cap)
            except Exception as err:  # noqa: BLE001 - e.g. no host memory: this layer recalls nothing
                ls.tier = None
                self.failed(plan, r, err)
        if evicted:
            self._bound_tiers(plan, sorted(evicted))
            self._snapshot(plan, sorted(evicted))
        if profiling.enabled():  # the tiers at their fullest: before this step's recalls take them
            profiling.add(
                tier_bytes=sum(
                    st.layers[self.key].tier.nbytes
                    for st in WORKER.states()
                    if self.key in st.layers and st.layers[self.key].tier is not None
                )
            )

    def _snapshot(self, plan, rows: list[int]) -> None:
        """A snapshot of this layer's tier of each of ``rows`` whose request shares its windows,
        compacted at a point before its prompt's end in this step, with its latest queries (this
        step's among them: :meth:`rows` ran before the compaction)."""
        if not plan.req_ids or plan.prompt_lens is None:
            return
        for r in rows:
            st = plan.states[r]
            b = plan.seq_lens[r]
            if st.settings.shares_windows and b < plan.prompt_lens[r] and not st.recall_failed:
                ls = st.layers[self.key]
                entries = ls.tier.snapshot() if ls.tier is not None else ()
                TIERS.take(plan.req_ids[r], b, self.key, entries, ls.recall_queries)

    def _bound_tiers(self, plan, rows: list[int]) -> None:
        """Keep every tier of this worker within ``recall.max_bytes`` (the server's; the default
        a sixteenth of the machine's memory), less what the cached windows' tiers hold, after ``rows`` added
        to theirs: each request keeps at least its share, and drops its own lowest-scored tokens
        first (:func:`trim_tiers`). A request trimmed so no longer holds what its configuration
        computes: nothing more of it is cached."""
        limit = plan.states[rows[0]].settings.config.recall.host_bytes
        try:
            tiers = request_tiers()
            held = {rid: sum(t.nbytes for t in req) for rid, req in tiers.items()}
            budget = limit - TIERS.nbytes
            dropped = trim_tiers(list(tiers.values()), max(0, budget))
            if dropped:
                logger.debug("kvevict: recall tiers over their budget: %d bytes dropped", dropped)
                for rid, req in tiers.items():
                    if sum(t.nbytes for t in req) < held[rid]:
                        fault.stop_caching(rid)
        except Exception as err:  # noqa: BLE001 - memory first: these rows' tiers go
            for r in rows:
                for ls in plan.states[r].layers.values():
                    ls.tier = None
                self.failed(plan, r, err)

    @staticmethod
    def failed(plan, r: int, err: BaseException) -> None:
        """Recall or its tier raised for row ``r`` (this layer keeps what its policy kept): one
        WARNING per request, the rest at DEBUG."""
        st = plan.states[r]
        rid = plan.req_ids[r] if plan.req_ids else "?"
        if st.settings.shares_windows:
            fault.stop_caching(rid)  # its tier is no longer what its configuration computes
        if st.recall_failed:
            logger.debug("kvevict: request %s: recall failed again (%r)", rid, err)
            return
        st.recall_failed = True
        logger.warning(
            "kvevict: request %s: recall failed (%s: %s); it keeps what its policy kept",
            rid,
            type(err).__name__,
            str(err)[:200],
        )

    def attends(self, plan, r: int) -> bool:
        """Whether :meth:`attend_all` computes row ``r`` in this step: a prompt chunk of a request
        with ``recall.prefill: all`` whose tier in this layer holds tokens."""
        st = plan.states[r]
        recall = st.settings.recall
        if plan.prompt_lens is None or not (st.settings.evicts and recall.enabled and recall.prefill == "all"):
            return False
        ls = st.layers.get(self.key)
        return plan.L_prev[r] < plan.prompt_lens[r] and ls is not None and ls.tier is not None and ls.tier.tokens > 0

    def attends_every_row(self, plan) -> bool:
        """Whether :meth:`attend_all` computes every row of this step (vLLM's attention over the
        windows would be replaced row by row)."""
        rows = len(plan.query_start_loc) - 1
        return bool(plan.states) and len(plan.states) == rows and all(self.attends(plan, r) for r in range(rows))

    def attend_all(self, query, out, kv_cache, plan) -> bool:
        """``recall.prefill: all``: a prefill chunk of a row whose tier holds tokens attends to them
        too. Its rows of ``out`` (vLLM's attention over the window ``[E_prev, L)``) are replaced by
        the attention over the window and the tier: with every token a compaction dropped in the
        tier, each chunk is computed as without eviction. A failure leaves vLLM's output (logged
        once, like recall's). True when every such row was computed."""
        done = True
        for r in range(len(plan.states)):
            if not self.attends(plan, r):
                continue
            try:
                with profiling.timed("recall_s", kv_cache.device):
                    done = (
                        self._attend_all(query, out, kv_cache, plan, r, plan.states[r].layers[self.key].tier) and done
                    )
            except Exception as err:  # noqa: BLE001 - the chunk keeps vLLM's attention over its window
                self.failed(plan, r, err)
                done = False
        return done

    def _attend_all(self, query, out, kv_cache, plan, r: int, tier_of: Tier) -> bool:
        parts = tier_of.parts(kv_cache.device)
        if not parts:
            return False
        a, b = plan.query_start_loc[r], plan.query_start_loc[r + 1]
        bs, m, hd = kv_cache.shape[2], b - a, self.heads
        Q = query[a:b].transpose(0, 1)  # [H_q, m, d]
        if hd.softcap or hd.sinks is not None:  # per-score terms: the general statement, by position
            slots, K, V, pos = self._with_tier(kv_cache, plan, r, plan.e_prev[r], plan.seq_lens[r], parts)
            own = plan.positions[a:b].long()  # the chunk's: its slots' positions may not be recorded yet
            n = slots.shape[0]  # the window's slots, the chunk's own tokens its last m, in order
            pos[n - m : n] = own[:, None].to(pos.device)
            o = torch_ops.attend(
                Q, K.transpose(0, 1), V.transpose(0, 1), own, pos.T, hd.G, hd.scale, hd.softcap, hd.sinks
            )
        else:  # the window's kept tokens and the tier precede the chunk, its own tokens the last m slots
            slots = plan.slots(((r, plan.e_prev[r], plan.seq_lens[r]),), bs)
            K_w, V_w = self.layout.gather(kv_cache, slots // bs, slots % bs)  # [n, H, d]
            K = torch.cat([K_w[:-m], *(p.K.to(K_w.dtype) for p in parts), K_w[-m:]]).transpose(0, 1)
            V = torch.cat([V_w[:-m], *(p.V.to(V_w.dtype) for p in parts), V_w[-m:]]).transpose(0, 1)
            o = torch_ops.attend_after(Q, K, V, hd.G, hd.scale)
        out.view(out.shape[0], hd.num_heads, -1)[a:b] = o.transpose(0, 1).to(out.dtype)
        return True

    def _with_tier(self, kv_cache, plan, r: int, start: int, end: int, parts: list[TierEntry]):
        """Row ``r``'s window slots ``[start, end)`` and the tier's tokens (``parts``, on the cache's
        device) after them: ``(slots, K, V, positions)`` (``[n, H, ...]``, the window's first)."""
        slots, w = self._window(kv_cache, plan, r, start, end)
        K = torch.cat([w.K, *(p.K.to(w.K.dtype) for p in parts)])
        V = torch.cat([w.V, *(p.V.to(w.V.dtype) for p in parts)])
        return slots, K, V, torch.cat([w.pos, *(p.pos for p in parts)])

    def _window(self, kv_cache, plan, r: int, start: int, end: int) -> tuple[torch.Tensor, TierEntry]:
        """Row ``r``'s window slots ``[start, end)`` and what they hold as an entry (K, V,
        positions, per-slot state; no score: -inf)."""
        bs = kv_cache.shape[2]
        slots = plan.slots(((r, start, end),), bs)
        K, V = self.layout.gather(kv_cache, slots // bs, slots % bs)  # [n, H, d]
        pos = self.slots.positions(kv_cache)[slots].long()
        state = {k: t[slots] for k, t in self.slots.state.items()}
        return slots, TierEntry(K, V, pos, torch.full_like(pos, float("-inf"), dtype=torch.float32), state)

    def at_prompt_end(self, kv_cache, plan, rows: set[int]) -> dict[int, torch.Tensor]:
        """Each of ``rows`` whose prompt completes in this step, its window re-selected
        (:meth:`_recall`): the kept positions ``[keep, H]`` of those that recalled."""
        kept = {}
        for r in sorted(rows):
            if plan.completes_prompt(r):
                with profiling.timed("recall_s", kv_cache.device):
                    got = self._recall(kv_cache, plan, r)
                if got is not None:
                    kept[r] = got
        return kept

    def _recall(self, kv_cache, plan, r: int) -> torch.Tensor | None:
        """At the end of row ``r``'s prompt: re-select its window ``[E, L)`` from what it kept and its
        tier, by the attention of the prompt's last queries (unless the window stands:
        :meth:`window_stands`); the tier goes. Returns the kept
        positions ``[keep, H]`` (None when there is nothing to recall). A failure leaves the window
        as it is (logged once, like a policy's)."""
        ls = plan.layer_state(r, self.key)
        tier_of, ls.tier = ls.tier, None
        Qw, ls.recall_queries = ls.recall_queries, None
        settings = plan.states[r].settings
        if settings.decode_policy is not settings.policy and Qw is not None:
            if ls.queries is None or ls.queries.shape[1] < Qw.shape[1]:
                ls.queries = Qw  # recall's score compacts from now on: from the prompt's last queries
                ls.queries_end = plan.seq_lens[r]
        stands = self.window_stands(plan, r)
        before, ls.reselected = ls.reselected, None
        if stands:
            # re-selected before this step's attention by these queries, then either nothing compacted
            # (the step's own tokens joined the window, as they join any window between points) or the
            # compaction chose by recall's score (:meth:`score_prompt_ends`): the window stands
            self._count(plan, r, before[1])
            return None
        if tier_of is None or Qw is None:
            return None
        got = self._reselect(kv_cache, plan, r, tier_of, Qw, plan.e_new[r], plan.seq_lens[r])
        if got is None:
            return None
        pos_sel, recalled, _ = got
        self._count(plan, r, recalled)
        return pos_sel

    def window_stands(self, plan, r: int) -> bool:
        """Whether row ``r``'s window after this step is recall's last choice for its prompt: the
        prompt completes in this step, :meth:`before_attention` re-selected this layer's window by
        the prompt's last queries, and the step compacted nothing or compacted by recall's score
        (:meth:`score_prompt_ends`)."""
        st = plan.states[r]
        ls = st.layers.get(self.key)
        before = None if ls is None else ls.reselected
        if before is None or before[0] != plan.seq_lens[r] or not plan.completes_prompt(r):
            return False
        return self._leaves_choice(plan, r)

    def _leaves_choice(self, plan, r: int) -> bool:
        """Whether row ``r``'s step leaves what recall chose before its attention as it is: it
        compacts nothing, or compacts by recall's score."""
        return plan.e_new[r] == plan.e_prev[r] or self._scores_end(plan.states[r])

    @staticmethod
    def _scores_end(st) -> bool:
        """Whether a request's compaction in the step completing its prompt scores by recall's
        equation: it decodes by it (its policy's view is not read again) and has not fallen back."""
        return st.fell_back_from is None and st.settings.decode_policy is st.settings.recall_policy

    def score_prompt_ends(self, plan, policies: list) -> set[int]:
        """The rows whose prompt completes in this step with a compaction after
        :meth:`before_attention` re-selected their window: the compaction scores by recall's
        equation (``policies[r]`` set to it), from the re-selected window and the step's own
        tokens, by the prompt's last queries (the query window seeded with recall's), so that it is
        the window's last choice; the re-selection from the whole tier is not repeated after it
        (its candidates beyond the window ranked below every token the window holds)."""
        out: set[int] = set()
        for r in plan.recall_ends if plan.states else ():
            st = plan.states[r]
            if plan.e_new[r] == plan.e_prev[r] or policies[r] is not st.settings.policy:
                continue
            if not self.window_stands(plan, r):
                continue
            ls = st.layers[self.key]
            policies[r] = st.settings.recall_policy
            ls.queries, ls.queries_end = ls.recall_queries, plan.L_prev[r]  # this step's are added to them
            out.add(r)
        return out

    @staticmethod
    def _count(plan, r: int, recalled) -> None:
        rec = metrics.worker_recorder()
        if rec is not None:
            rec.inc_later("recalled_tokens", plan.states[r].settings.config.policy, recalled)

    def before_attention(self, query, kv_cache, plan) -> None:
        """In the step that completes a prompt, before this layer's attention: re-select the cached
        window ``[E_prev, L_prev)`` from itself and the tier by the prompt's last queries (this
        step's included), so that the prompt's last tokens (the question) attend to what recall
        chose, in this layer and, through their outputs, in every layer above. What loses goes
        back to the tier. Where this step compacts the row, the compaction chooses by recall's
        score (:meth:`score_prompt_ends`); with ``recall.decode: policy`` the policy compacts and
        :meth:`_recall` re-selects ``[E_new, L)`` from all of it after attention."""
        qsl = plan.query_start_loc
        kept = {}
        for r in plan.recall_ends:
            st = plan.states[r]
            ls = st.layers.get(self.key)
            start, end = plan.e_prev[r], plan.L_prev[r]
            if ls is None or ls.tier is None or end <= start:
                continue
            if st.settings.recall.prefill == "all":  # the question attends to window and tier after all
                continue
            Q = query[qsl[r] : qsl[r + 1]].transpose(0, 1)  # [H_q, m, d]
            if ls.recall_queries is not None:  # a request started on a window: those cached with its tier
                Q = torch.cat([ls.recall_queries, Q], dim=1)
            Qw = Q[:, -st.settings.recall.window :]
            tier_of, ls.tier = ls.tier, None
            # the losers go back to the tier only where :meth:`_recall` re-selects again after attention
            losers = not self._leaves_choice(plan, r)
            got = self._reselect(kv_cache, plan, r, tier_of, Qw, start, end, plan.seq_lens[r], losers)
            if got is None:
                continue
            kept[r], recalled, lost = got
            ls.reselected = (plan.seq_lens[r], recalled)
            if lost is not None:
                try:
                    ls.tier = Tier()
                    ls.tier.add(lost, st.settings.recall.cap)
                except Exception as err:  # noqa: BLE001 - e.g. no host memory: the window stays as chosen
                    ls.tier = None
                    self.failed(plan, r, err)
        if envs.KVEVICT_DUMP_DIR and kept:
            rs = sorted(kept)
            dump_kept(
                plan,
                rs,
                self.index,
                [kept[r] for r in rs],
                list(self.heads.model_kv_heads),
                kv_cache.shape[2],
                before_attention=True,
            )

    def _reselect(
        self,
        kv_cache,
        plan,
        r: int,
        tier_of: Tier,
        Qw: torch.Tensor,
        start: int,
        end: int,
        q_end: int | None = None,
        losers: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, TierEntry | None] | None:
        """Re-select row ``r``'s window slots ``[start, end)`` from what they hold and ``tier_of``, by
        the attention of the queries ``Qw`` (the last before ``q_end``, default ``end``), and write
        the winners there in position order. Returns the kept positions ``[end - start, H]``, how
        many came from the tier and, with ``losers``, the candidates not kept (scored by this
        recall) as a tier entry; None when the tier is empty or on a failure (logged once, the
        window as it was)."""
        q_end = end if q_end is None else q_end
        try:
            chosen = self._choice(kv_cache, plan, r, tier_of, Qw, start, end, q_end, losers)
        except Exception as err:  # noqa: BLE001 - recall must never kill the engine either
            self.failed(plan, r, err)
            return None
        if chosen is None:
            return None
        slots, won, recalled, lost = chosen
        self.layout.write(kv_cache, slots, won.K, won.V)
        self.slots.positions(kv_cache)[slots] = won.pos.to(torch.int32)
        for k, v in won.state.items():
            self.slots.state[k][slots] = v
        return won.pos, recalled, lost

    def _choice(self, kv_cache, plan, r, tier_of: Tier, Qw, start: int, end: int, q_end: int, losers):
        """What :meth:`_reselect` writes, chosen among the window's slots ``[start, end)`` and the
        tier by recall's score, nothing written yet: ``(slots, the winners' entry, how many from the
        tier, the losers' entry)``; None when the tier is empty."""
        cfg = plan.states[r].settings.config
        parts = tier_of.take(kv_cache.device)
        if not parts:
            return None
        slots, window = self._window(kv_cache, plan, r, start, end)
        cand = Candidates([window, *parts])
        q_pos = torch.arange(q_end - Qw.shape[1], q_end, device=cand.K.device)
        hd = self.heads
        scores = recall_scores(
            Qw.float(), q_pos, cand.K.float(), cand.pos, hd.G, hd.scale, hd.softcap, cfg.recall.kernel, hd.sinks
        )
        # the recall's own queries and the policy's observation window (SnapKV's may be longer,
        # and its next compaction reads every position of it) are kept whatever their scores
        protect = max(Qw.shape[1], plan.states[r].settings.policy.needs.window)
        idx = select_recalled(scores, cand.pos, end - start, q_end - protect)  # [keep, H]
        lost = None
        if losers and cand.tokens > idx.shape[0]:
            lost = cand.pick(torch_ops.complement(cand.tokens, idx), scores)
        recalled = (idx >= slots.shape[0]).sum()  # on the device: read when the step ends (metrics)
        return slots, cand.pick(idx, scores), recalled, lost
