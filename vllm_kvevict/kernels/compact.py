"""One step's eviction work on the paged cache: observe, score, select per KV head, write
right-aligned (torch reference).

For every row that observes (policies with per-slot state) or compacts in this step
(``e_new > e_prev``): read the KV of logical slots ``[e_prev, L)`` through the block table (one
batched gather for all rows), build the policy's :class:`KVView`, let it update its per-slot state,
and, for compacting rows, let it choose (and, for merging policies, rewrite) ``L - e_new`` slots
per KV head, written in slot order into ``[e_new, L)``. Reads complete before any write, so
overlapping source and destination are safe. Per-slot positions and state move with the tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_kvevict.policies.base import KVView, Policy

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
    compacting row, in order."""
    if not work:
        return []
    src = [logical_slots(plan.block_table[w.row], plan.e_prev[w.row], plan.seq_lens[w.row], block_size) for w in work]
    blocks = torch.cat([b for b, _ in src])
    offs = torch.cat([o for _, o in src])
    slots_all = blocks * block_size + offs
    K_all, V_all = gather(blocks, offs)  # [N, H, D], one batched read for every row
    pos_all = slot_pos[slots_all]  # [N, H]
    out_slots, out_K, out_V, out_pos, out_state = [], [], [], [], {k: [] for k in slot_state}
    start = 0
    for w, (_, o) in zip(work, src, strict=True):
        r, n = w.row, o.numel()
        sl = slice(start, start + n)
        start += n
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
        keep = plan.seq_lens[r] - plan.e_new[r]
        kept, merged = w.policy.evict(view, keep)  # [H, keep], ascending per head
        h = torch.arange(K.shape[1], device=K.device)[None, :]
        idx = kept.transpose(0, 1)  # [keep, H]
        if merged is None:
            out_K.append(K[idx, h])
            out_V.append(V[idx, h])
        else:
            out_K.append(merged[0].transpose(0, 1).to(K.dtype))
            out_V.append(merged[1].transpose(0, 1).to(V.dtype))
        out_pos.append(pos[idx, h])
        for k in slot_state:  # every state tensor moves, whichever policy owns the row
            s = view.state[k].transpose(0, 1) if k in view.state else slot_state[k][slots_all[sl]]
            out_state[k].append(s[idx, h].to(slot_state[k].dtype))
        b, off = logical_slots(plan.block_table[r], plan.e_new[r], plan.seq_lens[r], block_size)
        out_slots.append(b * block_size + off)
    if out_slots:
        slots = torch.cat(out_slots)
        write(slots, torch.cat(out_K), torch.cat(out_V))
        slot_pos[slots] = torch.cat(out_pos)
        for k, parts in out_state.items():
            slot_state[k][slots] = torch.cat(parts)
    return out_pos

