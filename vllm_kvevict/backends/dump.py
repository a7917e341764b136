# SPDX-License-Identifier: Apache-2.0
"""``KVEVICT_DUMP_DIR`` (debugging, tests): every compaction's kept positions and every attempt's
start, as JSON lines, one file per worker process (``kept-<pid>.jsonl``)."""

from __future__ import annotations

import json
import os

import torch

from vllm_kvevict import envs
from vllm_kvevict.vllm_compat import distributed as vllm_distributed
from vllm_kvevict.window import last_boundary


def _write(records: list[dict]) -> None:
    directory = envs.KVEVICT_DUMP_DIR
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"kept-{os.getpid()}.jsonl"), "a") as f:
        f.writelines(json.dumps(rec) + "\n" for rec in records)


def _blocks(plan, r: int, start: int, end: int, block_size: int) -> list[int]:
    """Row ``r``'s physical blocks of logical tokens ``[start, end)`` (whole blocks)."""
    return plan.block_table[r, start // block_size : end // block_size].tolist()


def dump_kept(
    plan,
    rows: list[int],
    layer: int,
    kept: list[torch.Tensor],
    heads: list[int],
    block_size: int,
    before_attention: bool = False,
) -> None:
    """``kept[i]``: the positions ``[keep, H]`` row ``rows[i]`` kept in ``layer``; ``heads``: the
    model's indices of this rank's KV heads; ``blocks``: the physical blocks of the window (a
    later request may start on them: a cached compacted window). ``before_attention``: the window
    ``[E_prev, L_prev)`` as recall re-selected it before this step's attention (recorded at
    ``L_prev``: this step's tokens attend to it; no blocks, such a window is never cached)."""
    rank = vllm_distributed.tensor_parallel()[0]
    _write(
        [
            {
                "req_id": plan.req_ids[r] if plan.req_ids else None,
                "layer": layer,
                "e_prev": plan.e_prev[r],
                "e_new": plan.e_prev[r] if before_attention else plan.e_new[r],
                "L": plan.L_prev[r] if before_attention else plan.seq_lens[r],
                "rank": rank,
                "heads": heads,
                "kept": pos.transpose(0, 1).tolist(),
                "blocks": [] if before_attention else _blocks(plan, r, plan.e_new[r], plan.seq_lens[r], block_size),
            }
            for r, pos in zip(rows, kept)
        ]
    )


def _window_start(plan, r: int, block_size: int) -> dict:
    window, L = plan.states[r].settings.window, plan.L_prev[r]
    b = last_boundary(L if window.decode else min(L, plan.prompt_lens[r]), window)
    return {"window_point": b, "window_blocks": _blocks(plan, r, plan.e_prev[r], b, block_size)}


def dump_starts(plan, step, block_size: int) -> None:
    """A request's first step (also after preemption, when vLLM recomputes it), which may start
    on a prefix-cache hit (``shared`` tokens): pure blocks, or a cached compacted window
    (``window_point`` ``b`` and ``window_blocks``, the physical blocks of ``[e_prev, b)``, which
    the compaction that made them recorded as its ``blocks``), with the blocks of its tail up to
    ``shared``."""
    if step is None or step.dummy:
        return
    rank = vllm_distributed.tensor_parallel()[0]
    _write(
        [
            {
                "req_id": plan.req_ids[r],
                "start": True,
                "num_tokens": step.num_tokens[r],
                "rank": rank,
                "shared": plan.L_prev[r],
                **(_window_start(plan, r, block_size) if plan.e_prev[r] else {}),
            }
            for r in range(len(plan.seq_lens))
            if plan.req_ids[r] in step.starts
        ]
    )
