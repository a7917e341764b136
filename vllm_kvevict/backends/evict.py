# SPDX-License-Identifier: Apache-2.0
"""One step's eviction work on the paged cache: observe, score, select per KV head, write
right-aligned. Engine code (it drives the policies over a step); the kernels it calls know
nothing of policies.

For every row that observes (policies with per-slot state) or compacts in this step
(``e_new > e_prev``): read the KV of logical slots ``[e_prev, L)`` through the block table (one
batched gather for all rows), build the policy's :class:`KVView`, let it update its per-slot state,
and, for compacting rows, let it choose (and, for merging policies, rewrite) ``L - e_new`` slots
per KV head, written in slot order into ``[e_new, L)``. Reads complete before any write, so
overlapping source and destination are safe. Per-slot positions and state move with the tokens.
Policies that score from keys and positions alone are scored for all their rows at once, the
attention rows the others read are computed for all rows at once, and every row with the default
selection is selected in one call (:mod:`vllm_kvevict.kernels.ops`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vllm_kvevict import envs
from vllm_kvevict.kernels import ops, torch_ops
from vllm_kvevict.kernels.torch_ops import PagedKeys, Ragged, StateWrite, dense_positions, on_device
from vllm_kvevict.policies.base import Columns, KVView, Packed, Policy, RowInputs

Gather = Callable[
    [torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]  # (blocks, offsets) -> K, V [n, H, D]
Write = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (slots, K, V)


@dataclass(frozen=True)
class Geometry:
    """Where a set of rows' windows are, the same in every layer of a step: computed once per step
    from the plan's host lists (:func:`step_geometry`), so a layer's eviction does only its math
    and never reads the device to learn a size."""

    rows: torch.Tensor  # [R] the rows, in work order
    starts: torch.Tensor  # [R] e_prev
    ends: torch.Tensor  # [R] L
    cu: Ragged  # the rows' packed tokens: row r owns [cu.host[r], cu.host[r + 1])
    blocks: torch.Tensor  # [N] physical block of every window token, packed by row
    offsets: torch.Tensor  # [N]
    slots: torch.Tensor  # [N] blocks * block_size + offsets
    out: list[int]  # the compacting rows
    cu_keep: Ragged  # over their kept counts L - e_new
    out_rows: torch.Tensor  # [len(out)]
    dst: torch.Tensor  # [len(out)] e_new of each
    dst_slots: torch.Tensor  # [sum keep] the slots of their logical tokens [e_new, L), packed

    @property
    def bounds(self) -> tuple[int, ...]:
        return self.cu.host


def step_geometry(plan, work: list[RowWork], block_size: int) -> Geometry:
    """The windows of ``work``'s rows (and where the compacting ones write), computed by the step's
    first layer and kept on the plan for the others."""
    key = (block_size, *((w.row, w.compact) for w in work))
    geo = plan.geometries.get(key)
    if geo is not None:
        return geo
    dev, table = plan.block_table.device, plan.block_table
    starts_h = [plan.e_prev[w.row] for w in work]
    ends_h = [plan.seq_lens[w.row] for w in work]
    cu = Ragged.of([b - a for a, b in zip(starts_h, ends_h)], dev)
    rows, starts, ends = (on_device(v, dev) for v in ([w.row for w in work], starts_h, ends_h))
    blocks, offs, _ = torch_ops.logical_tokens(table, rows, starts, ends, block_size, cu)
    out = [w.row for w in work if w.compact]
    cu_keep = Ragged.of([plan.seq_lens[r] - plan.e_new[r] for r in out], dev)
    out_rows, dst = on_device(out, dev), on_device([plan.e_new[r] for r in out], dev)
    b, o, _ = torch_ops.logical_tokens(table, out_rows, dst, dst + cu_keep.dev.diff(), block_size, cu_keep)
    geo = plan.geometries[key] = Geometry(
        rows,
        starts,
        ends,
        cu,
        blocks,
        offs,
        blocks * block_size + offs,
        out,
        cu_keep,
        out_rows,
        dst,
        b * block_size + o,
    )
    return geo


@dataclass
class RowWork:
    """One row's part of the step: its policy and what the backend knows besides the KV."""

    row: int
    policy: Policy
    compact: bool
    inputs: RowInputs = field(default_factory=RowInputs)
    keep_evicted: bool = False  # recall: hand what this row drops to ``evicted``


def evict_step(
    plan,
    work: list[RowWork],
    block_size: int,
    gather: Gather,
    write: Write,
    slot_pos: torch.Tensor,
    slot_state: dict[str, torch.Tensor],
    layer: int = 0,
    G: int = 1,
    views: tuple[torch.Tensor, torch.Tensor] | None = None,
    evicted: dict | None = None,
    overlays: dict[int, dict[str, torch.Tensor]] | None = None,
    positions: bool = True,
    snapshots: dict[str, torch.Tensor] | None = None,
) -> list[torch.Tensor | None]:
    """Observe and compact the rows of ``work``; returns the kept positions ``[keep, H]`` of each
    compacting row, in order (``positions=False``: None for each, not computed).

    ``evicted``: when given, every compacting row with ``RowWork.keep_evicted`` gets what it drops
    there (the recall tier's), ``{row: (K, V, pos, score, state)}`` (``[n, H, ...]``, ``score``: -inf
    where its policy selects without one).

    ``views``: the cache's ``[num_blocks, block_size, H, D]`` K and V views where the layout has
    them: rows read and written by block-table kernels (in place, :func:`_in_place`); otherwise
    through ``gather``/``write`` at explicit slots. Rows of a ``Policy.ragged`` policy are scored
    together; the others through their policy, their attention by one ``column_sums``. Every
    scored row is selected by one ``select_topk``; merging policies select and rewrite K/V.
    ``overlays``: ``{row: {name: [n, H]}}``, the per-slot state of the first ``n`` slots of a row's
    window held outside ``slot_state`` (a request started on a cached window: those blocks are
    shared, their state its own copy), read and observed there, never written to ``slot_state``.
    ``snapshots``: ``{name: [slots, H]}``, where compacted windows' state is kept as the compaction
    left it (read by requests starting on them once cached): the kept state is written there too.
    """
    if not work:
        return []
    batched = bool(envs.KVEVICT_BATCHED)  # 0: every row through its policy one by one (A/B timing, debugging)
    geo = step_geometry(plan, work, block_size)
    in_place = views is not None and batched and _in_place(work)
    t = _read(plan, geo, work, gather, views, slot_pos, slot_state, overlays or {}, in_place)
    sel = _Selection()
    groups, row_views = _row_views(work, t, layer, G, batched)
    attn = _attention(plan, work, row_views, groups, t, G) if batched else {}  # every row's in one call
    observed = _score_rows(plan, work, row_views, t, sel, batched)
    observed_groups = _score_groups(plan, work, groups, t, sel, layer, G, attn)
    _select(plan, work, t, sel, evicted is not None)
    # Nothing written before every row is scored and selected: a raise leaves all as it was (retried row by row).
    _write_observed(work, t, observed, slot_state, overlays or {})
    _write_group_observed(plan, work, t, observed_groups, slot_state, overlays or {})
    if evicted is not None:  # read before anything is written (the window's slots are rewritten)
        _hand_to_recall(plan, work, t, sel, evicted)
    if not geo.out:
        return []
    kept = _kept(geo, sel)
    dst = (block_size, write, slot_pos, slot_state, views, snapshots or {})
    taken = _write_kept(plan, geo, kept, sel, (t.K, t.V, t.pos, t.state), dst)
    if not positions:
        return [None] * len(geo.out)
    kept_pos = taken if taken is not None else torch_ops.per_head(dense_positions(t.pos), kept)
    return list(kept_pos.split([sel.kept_tok[r].shape[0] for r in geo.out]))


def _in_place(work: list[RowWork]) -> bool:
    """Every row is scored (or observed) with the others of its policy (:func:`_grouped`): its keys
    are scored where they are and only the kept tokens (and what recall keeps) are copied, nothing
    of the window gathered; but a merging policy reads every key and value it merges."""
    return all(_grouped(w, True) and not (w.compact and w.policy.needs.merges) for w in work)


def _grouped(w: RowWork, batched: bool) -> bool:
    """Whether the row is scored with every other row of its policy: a compacting row of a policy
    that scores from keys and positions (``Policy.ragged``), or any row of one that scores (and
    observes) from its queries' attention (``Policy.columnar``)."""
    p = w.policy
    return batched and ((p.ragged and w.compact) or (p.columnar and (w.compact or p.needs.observes)))


@dataclass
class _Tokens:
    """Every token of the step's rows, packed row after row (``bounds``: each row's first)."""

    K: torch.Tensor | PagedKeys  # [N, H, D], or read in place (the in-place step)
    V: torch.Tensor | PagedKeys
    pos: torch.Tensor | PagedKeys  # [N, H] int64, or the slot positions read in place
    state: dict[str, torch.Tensor]  # [N, H] each, the rows' overlays applied
    slots: torch.Tensor  # [N] physical slots
    bounds: tuple[int, ...]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V gathered: what rows scored through their policy objects read (never in place)."""
        assert isinstance(self.K, torch.Tensor) and isinstance(self.V, torch.Tensor), "read in place"
        return self.K, self.V


@dataclass
class _Selection:
    """What the step keeps: row -> kept indices into the packed tokens ``[keep, H]``; rows a
    merging policy rewrote (row -> new K, V ``[keep, H, D]``); the rows still to select by their
    scores (index into ``work``, scores ``[n, H]``: one selection for all)."""

    kept_tok: dict[int, torch.Tensor] = field(default_factory=dict)
    merged: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    to_select: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    scores: torch.Tensor | None = (
        None  # every score of ``to_select`` in one tensor (one call made them, or the selection)
    )
    packed: torch.Tensor | None = None  # the selection's kept tokens of rows ``packed_rows``, in order
    packed_rows: list[int] = field(default_factory=list)
    dropped: torch.Tensor | None = None  # the tokens the selection dropped, where recall takes all of them
    rewritten: list[tuple[torch.Tensor | slice, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """merging groups' packed tokens and their new K, V (``[n, H, D]``: what a kept one is written as)"""


def _read(plan, geo: Geometry, work, gather, views, slot_pos, slot_state, overlays, in_place: bool) -> _Tokens:
    """The rows' K, V, positions and per-slot state: through the block table where the layout has
    views, else gathered at explicit slots; ``in_place``: K and V not copied, read where they are."""
    K: torch.Tensor | PagedKeys
    V: torch.Tensor | PagedKeys
    pos: torch.Tensor | PagedKeys
    if in_place:  # nothing copied: keys, values and positions read where they are
        K, V = PagedKeys(views[0], geo.blocks, geo.offsets), PagedKeys(views[1], geo.blocks, geo.offsets)
        pos = PagedKeys(slot_pos.view(*views[0].shape[:3]), geo.blocks, geo.offsets)
    elif views is not None:  # one read for every row, through the block table
        K, V, _ = ops.gather_paged(views[0], views[1], plan.block_table, geo.rows, geo.starts, geo.ends, geo.cu)
    else:
        K, V = gather(geo.blocks, geo.offsets)  # [N, H, D]
    if not in_place:
        pos = slot_pos[geo.slots].long()
    state = {k: s[geo.slots] for k, s in slot_state.items()}
    for i, w in enumerate(work):
        for k, t in overlays.get(w.row, {}).items():
            state[k][geo.bounds[i] : geo.bounds[i] + t.shape[0]] = t
    return _Tokens(K, V, pos, state, geo.slots, geo.bounds)


def _row_views(work, t: _Tokens, layer: int, G: int, batched: bool):
    """The rows scored together by their policy (``Policy.ragged`` or ``Policy.columnar``: policy
    -> indices into ``work``), and the others' views, each scored (or observed) through its policy."""
    groups: dict[int, list[int]] = {}
    row_views: list[tuple[int, KVView]] = []
    for i, w in enumerate(work):
        if _grouped(w, batched):
            groups.setdefault(id(w.policy), []).append(i)
            continue
        sl = slice(t.bounds[i], t.bounds[i + 1])
        state = {k: t.state[k][sl].transpose(0, 1).contiguous() for k in w.policy.needs.state}
        K, V = t.dense()
        view = KVView(
            K=K[sl].transpose(0, 1),
            V=V[sl].transpose(0, 1),
            pos=dense_positions(t.pos)[sl].transpose(0, 1).long(),
            layer=layer,
            G=G,
            state=state,
            **w.inputs.inputs(),
        )
        row_views.append((i, view))
    return groups, row_views


def _score_rows(plan, work, row_views, t: _Tokens, sel: _Selection, batched: bool) -> list[tuple[int, dict]]:
    """Each view's policy observes its queries and scores its row (selected with every other row
    by :func:`_select`), or evicts it itself (merging policies, and every policy unbatched);
    returns the per-slot state to write back once every row is scored."""
    observed: list[tuple[int, dict]] = []
    for i, view in row_views:
        w = work[i]
        r = w.row
        if w.policy.needs.observes:
            w.policy.observe(view)
            observed.append((i, view.state))
        if not w.compact:
            continue
        keep = plan.seq_lens[r] - plan.e_new[r]
        if batched and not w.policy.needs.merges:
            view.keep = keep
            sel.to_select.append((i, w.policy.score(view).transpose(0, 1)))
            continue
        kept, new_kv = w.policy.evict(view, keep)  # [H, keep], ascending per head
        sel.kept_tok[r] = kept.transpose(0, 1) + t.bounds[i]
        if new_kv is not None:
            K, V = t.dense()
            sel.merged[r] = (new_kv[0].transpose(0, 1).to(K.dtype), new_kv[1].transpose(0, 1).to(V.dtype))
    return observed


def _score_groups(plan, work, groups: dict, t: _Tokens, sel: _Selection, layer: int, G: int, attn: dict) -> list:
    """Policies that score from keys and positions (``Policy.ragged``), or from their queries'
    attention, positions and per-slot state (``Policy.columnar``, its column sums in ``attn``): all
    their rows at once, a columnar policy's rows observed first (in ``t.state``). Returns the
    groups observed, ``(indices into work, their packed tokens)``, whose state is written back
    once every row is scored."""
    observed = []
    for key, idxs in groups.items():
        policy = work[idxs[0]].policy
        tok, g_cu = _packed(plan, t.bounds, idxs, t.K.device)
        lens = tuple(plan.seq_lens[work[i].row] for i in idxs)
        L = _per_step(plan, ("L", lens), lambda: on_device(lens, t.K.device))
        K, pos = t.K[tok], t.pos[tok]
        if policy.columnar:
            m = tuple(work[i].inputs.Q.shape[1] for i in idxs)
            keep = tuple(plan.seq_lens[work[i].row] - plan.e_new[work[i].row] if work[i].compact else 0 for i in idxs)
            budget = tuple(work[i].inputs.budget or 0 for i in idxs)
            cols = _per_step(
                plan,
                ("columns", g_cu.host, lens, m, G, keep, budget),
                lambda: _columns(g_cu, L, m, G, lens, keep, budget),
            )
            x = _packed_rows(plan, work, idxs, t, (tok, pos), attn.get(key), layer)
            state = x.state  # views of ``t.state`` where ``tok`` is a slice
            if policy.needs.observes:
                policy.observe_columns(x, cols)
                if not isinstance(tok, slice):
                    for k, v in state.items():
                        t.state[k][tok] = v
                observed.append((idxs, tok))
            if not any(work[i].compact for i in idxs):
                continue
            if policy.needs.merges:
                scores, K_new, V_new = policy.merge_columns(x, cols)
                sel.rewritten.append((tok, K_new, V_new))
            else:
                scores = policy.score_columns(x, cols)
        elif isinstance(K, PagedKeys):
            scores = policy.score_paged(K, pos, g_cu.dev, L, layer)
        else:
            scores = policy.score_ragged(K, pos, g_cu.dev, L, layer)
        every = all(work[i].compact for i in idxs)
        sel.scores = scores if not sel.to_select and len(groups) == 1 and every else None
        sel.to_select += [(i, sc) for i, sc in zip(idxs, scores.split(g_cu.lengths)) if work[i].compact]
    return observed


def _packed_rows(plan, work, idxs: list[int], t: _Tokens, at: tuple, attn: torch.Tensor | None, layer: int) -> Packed:
    """What a columnar policy reads of its rows' packed tokens (``at``: which, and their
    positions): ``attn``, their attention, where it reads that; else its queries themselves
    (packed, no copy where they lie back to back) and the keys."""
    policy, (tok, pos) = work[idxs[0]].policy, at
    state = {k: t.state[k][tok] for k in policy.needs.state}
    W_O = next((work[i].inputs.W_O for i in idxs if work[i].compact), None)
    x = Packed(attn, pos, state, t.V, tok, W_O, layer=layer)
    if policy.needs.merges:
        x.K = t.K
    if not policy.needs.attention:
        lens = tuple(plan.seq_lens[work[i].row] for i in idxs)
        m = tuple(work[i].inputs.Q.shape[1] for i in idxs)
        x.K, x.Q = t.K, torch_ops.joined([work[i].inputs.Q.transpose(0, 1) for i in idxs])
        x.q_pos = _per_step(plan, ("query positions", lens, m), lambda: _last_positions(lens, m, t.slots.device))
    return x


def _columns(
    g_cu: Ragged, L: torch.Tensor, m: tuple[int, ...], G: int, lens: tuple, keep: tuple, budget: tuple
) -> Columns:
    """The rows of a columnar group (made once per step, shared by the layers)."""
    dev = L.device
    queries, budgets = Ragged.of(m, dev), on_device(budget, dev)
    return Columns(torch_ops.row_ids(g_cu), L, on_device(m, dev), G, g_cu, lens, keep, queries, budgets)


def _hand_to_recall(plan, work, t: _Tokens, sel: _Selection, evicted: dict) -> None:
    """What each compacting row that keeps its evicted tokens drops, with the score it was dropped
    by (``-inf`` where its policy selected without one): found for all of them at once, every
    row's dropped tokens a slice of one packed set (``[n - keep, H]``, ascending per head)."""
    idxs = [i for i, w in enumerate(work) if w.compact and w.keep_evicted and w.row in sel.kept_tok]
    if not idxs:
        return
    dev, N, b = t.slots.device, t.bounds[-1], t.bounds
    counts = [b[i + 1] - b[i] - sel.kept_tok[work[i].row].shape[0] for i in idxs]
    if sel.dropped is not None and sel.packed_rows == [work[i].row for i in idxs]:
        drop = sel.dropped  # the selection's own
    else:
        fixed = _per_step(plan, ("to recall", b, tuple(idxs)), lambda: _unmarked(b, idxs, dev))
        kept = torch_ops.joined([sel.kept_tok[work[i].row] for i in idxs])
        drop = torch_ops.complement(N, kept, fixed, sum(counts))
    if isinstance(t.K, PagedKeys) and isinstance(t.V, PagedKeys) and isinstance(t.pos, PagedKeys):  # in place
        columns = (_packed_scores(plan, t, sel), *t.state.values())
        parts = list(ops.take_paged(t.K.cache, t.V.cache, t.pos.cache, t.K.blocks, t.K.offsets, drop, columns))
    else:
        K, V = t.dense()
        every = (K, V, dense_positions(t.pos), _packed_scores(plan, t, sel), *t.state.values())
        parts = torch_ops.per_head_all(every, drop)
    at = 0
    for i, n in zip(idxs, counts):
        sl = slice(at, at + n)
        evicted[work[i].row] = (*(x[sl] for x in parts[:4]), {k: s[sl] for k, s in zip(t.state, parts[4:])})
        at += n


def _unmarked(bounds: tuple[int, ...], idxs: list[int], device) -> torch.Tensor:
    """``[N]`` int8: 1 for the packed tokens outside work rows ``idxs`` (made on the host)."""
    mark = [1] * bounds[-1]
    for i in idxs:
        mark[bounds[i] : bounds[i + 1]] = [0] * (bounds[i + 1] - bounds[i])
    return on_device(mark, device, torch.int8)


def _packed_scores(plan, t: _Tokens, sel: _Selection) -> torch.Tensor:
    """``[N, H]`` float32: every packed token's score as selected, ``-inf`` for rows selected
    without one (their policy's own eviction) or not scored."""
    H, N = (t.K.cache.shape[2] if isinstance(t.K, PagedKeys) else t.K.shape[1]), t.bounds[-1]
    if sel.scores is None:
        return torch.full((N, H), float("-inf"), device=t.slots.device)
    tok, _ = _packed(plan, t.bounds, [i for i, _ in sel.to_select], t.slots.device)
    if isinstance(tok, slice) and (tok.start, tok.stop) == (0, N):
        return sel.scores.float()  # every token selected by its score, in order
    out = torch.full((N, H), float("-inf"), device=t.slots.device)
    out[tok] = sel.scores  # every selected row's, packed by the selection
    return out


def _select(plan, work, t: _Tokens, sel: _Selection, recall: bool) -> None:
    """One top-k for every row with the default selection, whatever its policy; ``recall``: the
    step hands what rows drop to recall (the selection writes the dropped tokens too where recall
    takes every row's)."""
    if not sel.to_select:
        return
    idxs = [i for i, _ in sel.to_select]
    sel_rows = [work[i].row for i in idxs]
    tok, s_cu = _packed(plan, t.bounds, idxs, t.K.device)
    keep = [plan.seq_lens[r] - plan.e_new[r] for r in sel_rows]
    if sel.scores is None:  # kept: recall reads them again
        sel.scores = torch.cat([s for _, s in sel.to_select])
    scores = sel.scores
    if isinstance(tok, slice) and recall and all(work[i].keep_evicted for i in idxs):
        sel.packed, sel.dropped = ops.select_split(scores, t.pos[tok], s_cu, keep, packed_offset=tok.start)
    elif isinstance(tok, slice):  # consecutive rows: the selection gives indices into the packed tokens
        sel.packed, _ = ops.select_topk(scores, t.pos[tok], s_cu, keep, packed_offset=tok.start)
    else:  # each row's first packed token added, once per kept token (made by the step's first layer)
        idx, _ = ops.select_topk(scores, t.pos[tok], s_cu, keep)
        firsts = tuple(t.bounds[i] for i in idxs)
        base = _per_step(plan, ("firsts", firsts, tuple(keep)), lambda: _repeat(firsts, keep, t.K.device))
        sel.packed = idx + base[:, None]
    sel.packed_rows, at = sel_rows, 0
    for r, k in zip(sel_rows, keep):
        sel.kept_tok[r] = sel.packed[at : at + k]
        at += k


def _kept(geo: Geometry, sel: _Selection) -> torch.Tensor:
    """``[sum keep, H]`` into the packed tokens, the rows of ``geo.out`` in order: as selected when
    one selection made every row's."""
    packed, whole = sel.packed, sel.packed_rows == geo.out
    return packed if packed is not None and whole else torch.cat([sel.kept_tok[r] for r in geo.out])


def _repeat(values: tuple[int, ...], counts: list[int], device) -> torch.Tensor:
    """``[sum counts]``: each value ``counts[i]`` times, made on the device from host lists."""
    return torch.repeat_interleave(on_device(values, device), on_device(counts, device), output_size=sum(counts))


def _write_observed(work, t: _Tokens, observed, slot_state, overlays) -> None:
    """The per-slot state the policies observed, back to the slots (a row's overlay slots to its
    own copy), before the compaction, which moves the state from the packed tokens."""
    for i, state in observed:
        lo, hi = t.bounds[i], t.bounds[i + 1]
        own = overlays.get(work[i].row, {})
        for k in state:
            new = state[k].transpose(0, 1).to(slot_state[k].dtype)
            t.state[k][lo:hi] = new
            n = own[k].copy_(new[: own[k].shape[0]]).shape[0] if k in own else 0
            slot_state[k][t.slots[lo + n : hi]] = new[n:]


def _write_group_observed(plan, work, t: _Tokens, groups: list, slot_state, overlays) -> None:
    """The per-slot state the columnar policies observed for their rows together (already in
    ``t.state``), back to the slots of the rows that do not compact (a compacting row's kept
    tokens carry their state to their new slots): one write per state for a group, row by row
    where a row's window starts on a cached one (its first slots' state to its own copy)."""
    for idxs, tok in groups:
        rows = [i for i in idxs if not work[i].compact]
        if not rows:
            continue
        names = work[idxs[0]].policy.needs.state
        if any(overlays.get(work[i].row) for i in rows):
            own = [(i, {k: t.state[k][t.bounds[i] : t.bounds[i + 1]].T for k in names}) for i in rows]
            _write_observed(work, t, own, slot_state, overlays)
            continue
        if rows != idxs:
            tok = _packed(plan, t.bounds, rows, t.slots.device)[0]
        slots = t.slots[tok]
        for k in names:
            slot_state[k][slots] = t.state[k][tok].to(slot_state[k].dtype)


def _attention(plan, work: list[RowWork], row_views: list[tuple[int, KVView]], groups: dict, t: _Tokens, G: int):
    """The attention each key receives from its row's queries, for every row whose policy reads it,
    in one ragged :func:`~vllm_kvevict.kernels.ops.column_sums` over all of them: set as
    ``view.attn`` of the rows scored through their policy (``Needs.attention``), returned as
    ``{group: [N_group, H_q]}`` for the columnar groups (their rows first, one slice each)."""
    columnar = [(key, idxs) for key, idxs in groups.items() if _reads_attention(work[idxs[0]].policy)]
    rows = [i for _, idxs in columnar for i in idxs]
    views = [(i, v) for i, v in row_views if work[i].policy.needs.attention]
    rows += [i for i, _ in views]
    if not rows:
        return {}
    K_all, pos_all = t.K, t.pos  # in place, or gathered
    dev, inputs = K_all.device, [work[i].inputs for i in rows]
    Q = torch_ops.joined([x.Q.transpose(0, 1) for x in inputs])  # [M, H_q, d]: no copy where renewed together
    m = tuple(x.Q.shape[1] for x in inputs)
    lens = tuple(plan.seq_lens[work[i].row] for i in rows)
    cu_q = _per_step(plan, ("queries", m), lambda: Ragged.of(m, dev))
    # a row's queries are its last positions (this step's, or its query window's): [L - m, L)
    q_pos = _per_step(plan, ("query positions", lens, m), lambda: _last_positions(lens, m, dev))
    tok, cu_k = _packed(plan, t.bounds, rows, dev)
    x0 = inputs[0]
    scale = x0.scale if x0.scale is not None else 1.0 / math.sqrt(x0.Q.shape[-1])
    A = ops.column_sums(Q, K_all[tok], q_pos, pos_all[tok], cu_q, cu_k, G, scale, x0.softcap, x0.sinks)  # [N, H_q]
    ck, out, j = cu_k.host, {}, 0
    for key, idxs in columnar:
        out[key] = A[ck[j] : ck[j + len(idxs)]]
        j += len(idxs)
    for _, view in views:
        view.attn = A[ck[j] : ck[j + 1]].T
        j += 1
    return out


def _reads_attention(policy: Policy) -> bool:
    """A columnar policy scored from its queries' attention (not from the queries themselves)."""
    return policy.columnar and policy.needs.attention


def _last_positions(lens: tuple[int, ...], m: tuple[int, ...], device) -> torch.Tensor:
    """``[sum m]`` int64: each row's last ``m`` positions ``[L - m, L)``, packed (from host lists)."""
    return on_device([p for L, k in zip(lens, m) for p in range(L - k, L)], device)


def _per_step(plan, key: tuple, make: Callable[[], object]):
    """What ``make`` returns, made by the step's first layer and kept on the plan for the others
    (host lists turned into device tensors: made once, not copied again in every layer)."""
    got = plan.geometries.get(key)
    if got is None:
        got = plan.geometries[key] = make()
    return got


def _packed(plan, bounds: tuple[int, ...], idxs: list[int], device) -> tuple[torch.Tensor | slice, Ragged]:
    """The packed tokens of work rows ``idxs`` (row ``i`` owns ``[bounds[i], bounds[i + 1])``), in
    that order, and their offsets: a slice (no copy) when the rows are consecutive, as when one
    policy serves every row."""

    def make():
        cu = Ragged.of([bounds[i + 1] - bounds[i] for i in idxs], device)
        if idxs == list(range(idxs[0], idxs[-1] + 1)):
            return slice(bounds[idxs[0]], bounds[idxs[-1] + 1]), cu
        starts = on_device([bounds[i] for i in idxs], device)
        return torch_ops.ranges(starts, starts + cu.dev.diff(), cu)[0], cu

    return _per_step(plan, ("packed", bounds, tuple(idxs)), make)


def _write_kept(plan, geo: Geometry, idx: torch.Tensor, sel: _Selection, src: tuple, dst: tuple) -> torch.Tensor | None:
    """Write each row's kept tokens ``idx`` (``[sum keep, H]`` into the packed tokens, the rows of
    ``geo.out`` in order) into its logical tokens ``[e_new, L)``, with their positions and per-slot
    state. ``src``: the packed tokens' ``(K, V, positions, state)`` (every state, whichever policy
    owns it); ``dst``: ``(block_size, write, slot_pos, slot_state, views, snapshots)``. Everything is read
    before anything is written, so overlapping source and destination are safe. Returns the kept
    positions where they were copied out (the in-place step), else None."""
    K_all, V_all, pos_all, state_all = src
    block_size, write, slot_pos, slot_state, views, snapshots = dst
    dev, out, kept_tok, merged = plan.block_table.device, geo.out, sel.kept_tok, sel.merged
    idx_kv, idx_pos, K_src, V_src, taken = idx, idx, K_all, V_all, None
    if isinstance(K_all, PagedKeys):  # the in-place step: the kept tokens copied out, then written
        K_src, V_src, taken = ops.take_paged(K_all.cache, V_all.cache, pos_all.cache, K_all.blocks, K_all.offsets, idx)
        M, H = idx.shape
        idx_kv = idx_pos = _per_step(
            plan, ("identity", M, H), lambda: torch.arange(M, device=dev)[:, None].expand(M, H).contiguous()
        )
        pos_all = taken
    if sel.rewritten:  # merging groups' kept tokens are written as they merged
        K_src, V_src = _rewritten(K_all, V_all, sel.rewritten)
    if merged:  # merging rows read their new K/V, appended after the packed tokens
        idx_kv, K_src, V_src = _merged_sources(out, kept_tok, merged, K_src, V_src)
    if views is not None:  # block-table kernels: K, V, positions and a state (with its snapshot) in one
        nb = views[0].shape[0]
        states = [
            StateWrite(
                state_all[k],
                idx,
                tuple(t.view(nb, block_size, -1) for t in (slot_state[k], snapshots.get(k)) if t is not None),
            )
            for k in slot_state
        ]
        where = (geo.cu_keep, plan.block_table, geo.out_rows, geo.dst)
        pos_cache = slot_pos.view(nb, block_size, -1)
        kv = (K_src, V_src, pos_all)
        ops.scatter_kv_paged(views[0], views[1], pos_cache, kv, idx_kv, idx_pos, *where, state=next(iter(states), None))
        for st in states[1:]:  # ``idx`` already indexes the packed tokens: every row's offset is 0
            zero = _per_step(plan, ("zero", len(out)), lambda: torch.zeros(len(out) + 1, dtype=torch.long, device=dev))
            for cache in st.dsts:
                ops.scatter_paged(cache, st.src, idx, zero, *where)
        return taken
    slots = geo.dst_slots
    write(slots, torch_ops.per_head(K_src, idx_kv), torch_ops.per_head(V_src, idx_kv))
    slot_pos[slots] = torch_ops.per_head(pos_all, idx_pos).to(slot_pos.dtype)
    for k in slot_state:
        kept_state = torch_ops.per_head(state_all[k], idx)
        slot_state[k][slots] = kept_state
        if k in snapshots:
            snapshots[k][slots] = kept_state
    return taken


def _rewritten(K: torch.Tensor, V: torch.Tensor, groups: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed K and V with each merging group's tokens replaced by their new values."""
    K, V = K.clone(), V.clone()
    for tok, K_new, V_new in groups:
        K[tok], V[tok] = K_new.to(K.dtype), V_new.to(V.dtype)
    return K, V


def _merged_sources(out, kept_tok, merged, K_all, V_all) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(idx_kv, K, V)``: the packed tokens with the merging rows' new K/V appended after them,
    and every row's kept indices into that (a merging row's: its new tokens, in order)."""
    parts, n = [], K_all.shape[0]
    for r in out:
        if r in merged:
            keep = kept_tok[r].shape[0]
            parts.append(torch.arange(n, n + keep, device=K_all.device)[:, None].expand_as(kept_tok[r]))
            n += keep
        else:
            parts.append(kept_tok[r])
    K = torch.cat([K_all, *(merged[r][0] for r in out if r in merged)])
    V = torch.cat([V_all, *(merged[r][1] for r in out if r in merged)])
    return torch.cat(parts), K, V
