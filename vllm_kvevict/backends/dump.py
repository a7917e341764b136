# SPDX-License-Identifier: Apache-2.0
"""``KVEVICT_DUMP_DIR`` (debugging, tests): every compaction's kept positions and every attempt's
start, as JSON lines, one file per worker process (``kept-<pid>.jsonl``)."""

from __future__ import annotations

import json
import os

import torch

from vllm_kvevict import envs
from vllm_kvevict.vllm_compat import distributed as vllm_distributed


def _write(records: list[dict]) -> None:
    directory = envs.KVEVICT_DUMP_DIR
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"kept-{os.getpid()}.jsonl"), "a") as f:
        f.writelines(json.dumps(rec) + "\n" for rec in records)


def dump_kept(plan, rows: list[int], layer: int, kept: list[torch.Tensor], heads: list[int]) -> None:
    """``kept[i]``: the positions ``[keep, H]`` row ``rows[i]`` kept in ``layer``; ``heads``: the
    model's indices of this rank's KV heads."""
    rank = vllm_distributed.tensor_parallel()[0]
    _write(
        [
            {
                "req_id": plan.req_ids[r] if plan.req_ids else None,
                "layer": layer,
                "e_prev": plan.e_prev[r],
                "e_new": plan.e_new[r],
                "L": plan.seq_lens[r],
                "rank": rank,
                "heads": heads,
                "kept": pos.transpose(0, 1).tolist(),
            }
            for r, pos in zip(rows, kept)
        ]
    )


def dump_starts(plan, step) -> None:
    """A request's first step (also after preemption, when vLLM recomputes it), which may start
    on a prefix-cache hit (``shared`` tokens)."""
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
            }
            for r in range(len(plan.seq_lens))
            if plan.req_ids[r] in step.starts
        ]
    )
