"""Compaction of a step's windows: score, select per KV head, write right-aligned (torch reference).

For every row that compacts in this step (``e_new > e_prev``): read the KV of logical slots
``[e_prev, L)`` through the block table, let the policy score and select ``L - e_new`` slots per
KV head (heads may keep different tokens), and write them, in slot order, into ``[e_new, L)``.
Reads complete before any write, so overlapping source and destination are safe. Per-slot
positions (``slot_pos``) move with the tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_kvevict.policies.base import KVView, Policy

Gather = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (blocks, offsets) -> K, V [n, H, D]
Write = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (slots, K, V)


def logical_slots(block_table_row: torch.Tensor, start: int, end: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(physical block, offset) of logical token indices ``[start, end)`` of one request."""
    i = torch.arange(start, end, device=block_table_row.device)
    return block_table_row[i // block_size].long(), i % block_size


def compact_step(
    plan, rows: list[int], policies: list[Policy], block_size: int, gather: Gather, write: Write,
    slot_pos: torch.Tensor, layer: int = 0, G: int = 1,
) -> list[torch.Tensor]:
    """Compact ``rows`` of ``plan`` (``policies[i]`` scores ``rows[i]``); returns the kept positions
    ``[keep, H]`` per row."""
    if not rows:
        return []
    src = [logical_slots(plan.block_table[r], plan.e_prev[r], plan.seq_lens[r], block_size) for r in rows]
    blocks = torch.cat([b for b, _ in src])
    offs = torch.cat([o for _, o in src])
    K_all, V_all = gather(blocks, offs)  # [N, H, D], one batched read for every compacting row
    pos_all = slot_pos[blocks * block_size + offs]  # [N, H]
    out_slots, out_K, out_V, out_pos = [], [], [], []
    start = 0
    for r, policy, (_, o) in zip(rows, policies, src, strict=True):
        n = o.numel()
        K, V, pos = K_all[start:start + n], V_all[start:start + n], pos_all[start:start + n]
        start += n
        view = KVView(K=K.transpose(0, 1), V=V.transpose(0, 1), pos=pos.transpose(0, 1).long(), layer=layer, G=G)
        keep = plan.seq_lens[r] - plan.e_new[r]
        kept = policy.select(policy.score(view), keep, view)  # [H, keep], ascending per head
        h = torch.arange(K.shape[1], device=K.device)[None, :]
        idx = kept.transpose(0, 1)  # [keep, H]
        out_K.append(K[idx, h])
        out_V.append(V[idx, h])
        out_pos.append(pos[idx, h])
        b, off = logical_slots(plan.block_table[r], plan.e_new[r], plan.seq_lens[r], block_size)
        out_slots.append(b * block_size + off)
    slots = torch.cat(out_slots)
    write(slots, torch.cat(out_K), torch.cat(out_V))
    slot_pos[slots] = torch.cat(out_pos)
    return out_pos
