"""One step's eviction work on the paged cache: observe, score, select per KV head, write
right-aligned.

For every row that observes (policies with per-slot state) or compacts in this step
(``e_new > e_prev``): read the KV of logical slots ``[e_prev, L)`` through the block table (one
batched gather for all rows), build the policy's :class:`KVView`, let it update its per-slot state,
and, for compacting rows, let it choose (and, for merging policies, rewrite) ``L - e_new`` slots
per KV head, written in slot order into ``[e_new, L)``. Reads complete before any write, so
overlapping source and destination are safe. Per-slot positions and state move with the tokens.
Policies that score from keys and positions alone are scored and selected for all their rows at
once (:mod:`vllm_kvevict.kernels.ops`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_kvevict.kernels import ops, reference
from vllm_kvevict.policies.base import KVView, Policy

#: ``KVEVICT_BATCHED=0`` sends every row through its policy one by one (A/B timing, debugging).
BATCHED = os.environ.get("KVEVICT_BATCHED", "1") != "0"

Gather = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (blocks, offsets) -> K, V [n, H, D]
Write = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (slots, K, V)


def logical_slots(block_table_row: torch.Tensor, start: int, end: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(physical block, offset) of logical token indices ``[start, end)`` of one request."""
    i = torch.arange(start, end, device=block_table_row.device)
    return block_table_row[i // block_size].long(), i % block_size


@dataclass
class RowWork:
    """One row's part of the step: its policy and what the backend knows besides the KV."""

    row: int
    policy: Policy
    compact: bool
    extra: dict  # KVView fields beyond K/V/pos/state: Q, q_pos, Q_window, w_pos, W_O, L, budget, ...


def evict_step(
    plan, work: list[RowWork], block_size: int, gather: Gather, write: Write,
    slot_pos: torch.Tensor, slot_state: dict[str, torch.Tensor], layer: int = 0, G: int = 1,
) -> list[torch.Tensor]:
    """Observe and compact the rows of ``work``; returns the kept positions ``[keep, H]`` of each
    compacting row, in order.

    Compacting rows whose policy is :attr:`~vllm_kvevict.policies.base.Policy.batched` are scored
    and selected together, one call per policy for all its rows (:mod:`vllm_kvevict.kernels.ops`:
    Triton on CUDA, vectorised torch on CPU); the others go through the policy row by row.
    """
    if not work:
        return []
    src = [logical_slots(plan.block_table[w.row], plan.e_prev[w.row], plan.seq_lens[w.row], block_size) for w in work]
    blocks = torch.cat([b for b, _ in src])
    offs = torch.cat([o for _, o in src])
    slots_all = blocks * block_size + offs
    K_all, V_all = gather(blocks, offs)  # [N, H, D], one batched read for every row
    pos_all = slot_pos[slots_all]  # [N, H]
    lens = [o.numel() for _, o in src]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    H = K_all.shape[1]
    h = torch.arange(H, device=K_all.device)[None, :]
    kept_pos: dict[int, torch.Tensor] = {}
    out_slots, out_K, out_V, out_pos, out_state = [], [], [], [], {k: [] for k in slot_state}

    def emit(r: int, tok: torch.Tensor, K_new=None, V_new=None, state_new=None) -> None:
        """Row r keeps the packed tokens ``tok [keep, H]`` (optionally with new K/V/state)."""
        out_K.append(K_all[tok, h] if K_new is None else K_new)
        out_V.append(V_all[tok, h] if V_new is None else V_new)
        kept_pos[r] = pos_all[tok, h]
        out_pos.append(kept_pos[r])
        for k in slot_state:  # every state tensor moves, whichever policy owns the row
            s = state_new[k] if state_new and k in state_new else slot_state[k][slots_all[tok], h]
            out_state[k].append(s.to(slot_state[k].dtype))
        b, off = logical_slots(plan.block_table[r], plan.e_new[r], plan.seq_lens[r], block_size)
        out_slots.append(b * block_size + off)

    groups: dict[int, list[int]] = {}  # batched policy -> indices into work
    for i, w in enumerate(work):
        if w.compact and BATCHED and w.policy.batched:
            groups.setdefault(id(w.policy), []).append(i)
            continue
        r, sl = w.row, slice(starts[i], starts[i] + lens[i])
        K, V, pos = K_all[sl], V_all[sl], pos_all[sl]
        names = list(w.policy.slot_state)
        state = {k: slot_state[k][slots_all[sl]].transpose(0, 1).contiguous() for k in names}
        view = KVView(
            K=K.transpose(0, 1), V=V.transpose(0, 1), pos=pos.transpose(0, 1).long(), layer=layer, G=G,
            state=state, **w.extra,
        )
        if w.policy.observes:
            w.policy.observe(view)
            for k in names:
                slot_state[k][slots_all[sl]] = view.state[k].transpose(0, 1).to(slot_state[k].dtype)
        if not w.compact:
            continue
        kept, merged = w.policy.evict(view, plan.seq_lens[r] - plan.e_new[r])  # [H, keep], ascending per head
        tok = kept.transpose(0, 1) + starts[i]
        new_state = {k: view.state[k].transpose(0, 1)[kept.transpose(0, 1), h] for k in names}
        if merged is None:
            emit(r, tok, state_new=new_state)
        else:
            emit(r, tok, merged[0].transpose(0, 1).to(K.dtype), merged[1].transpose(0, 1).to(V.dtype), new_state)
    for idxs in groups.values():
        policy = work[idxs[0]].policy
        rows = [work[i].row for i in idxs]
        tok = torch.cat([torch.arange(starts[i], starts[i] + lens[i], device=K_all.device) for i in idxs])
        cu = reference.cu_from_lengths(torch.tensor([lens[i] for i in idxs], device=K_all.device))
        K, pos = K_all[tok], pos_all[tok].long()
        L = torch.tensor([plan.seq_lens[r] for r in rows])
        scores = policy.score_ragged(K, pos, cu, L, layer)
        keep = torch.tensor([plan.seq_lens[r] - plan.e_new[r] for r in rows], device=K_all.device)
        idx, cu_keep = ops.select_topk(scores, pos, cu, keep)
        for j, (i, r) in enumerate(zip(idxs, rows)):
            emit(r, idx[int(cu_keep[j]):int(cu_keep[j + 1])] + starts[i])
    if out_slots:
        slots = torch.cat(out_slots)
        write(slots, torch.cat(out_K), torch.cat(out_V))
        slot_pos[slots] = torch.cat(out_pos)
        for k, parts in out_state.items():
            slot_state[k][slots] = torch.cat(parts)
    return [kept_pos[w.row] for w in work if w.compact]
