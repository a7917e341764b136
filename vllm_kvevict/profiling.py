# SPDX-License-Identifier: Apache-2.0
"""Step-level timing of the eviction path, for ``kvevict-bench overhead`` (off unless asked).

With ``KVEVICT_PROFILE_DIR`` set, every worker process appends one JSON line per model step to
``<dir>/steps-<pid>.jsonl``: the step's wall time (the runner's ``execute_model``, timed through
:func:`vllm_kvevict.vllm_compat.runner.add_step_listener`), the time spent inside the attention
kernels, the time spent in eviction (observe, score, select, compact: everything the plugin adds
after attention, and recall's re-selection before it; recall's part of it also as ``recall_s``), the number of tokens and rows, how many
rows compacted, the bytes the recall tiers hold at their fullest in the step, before recall
takes them (``tier_bytes``, all layers), and the layers whose vLLM attention recall's replaced
(``attention_replaced``: ``recall.prefill: all`` computed every row). On CUDA the device is synchronised around each timed region
(profiling changes the timing it measures only by those synchronisations).
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager

from vllm_kvevict import envs
from vllm_kvevict.vllm_compat.runner import add_step_listener

_tls = threading.local()


def _sync(device) -> None:
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _acc() -> dict | None:
    return getattr(_tls, "acc", None)


@contextmanager
def timed(kind: str, device=None):
    """Add the wall time of the block to the current step's ``kind`` total (no-op outside a step)."""
    acc = _acc()
    if acc is None:
        yield
        return
    _sync(device)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _sync(device)
        acc[kind] = acc.get(kind, 0.0) + time.perf_counter() - t0


def add(**fields) -> None:
    """Add to the current step's totals (e.g. bytes summed over layers)."""
    acc = _acc()
    if acc is not None:
        for k, v in fields.items():
            acc[k] = acc.get(k, 0) + v


def note(**fields) -> None:
    """Record facts about the current step (the first value of each field wins)."""
    acc = _acc()
    if acc is not None:
        for k, v in fields.items():
            acc.setdefault(k, v)


def install_profile_hook() -> None:
    """Time every model step (the runner's ``execute_model``) when ``KVEVICT_PROFILE_DIR`` is set."""
    directory = envs.KVEVICT_PROFILE_DIR
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"steps-{os.getpid()}.jsonl")

    def begin() -> dict:
        acc: dict = {}
        _tls.acc = acc
        return acc

    def end(acc: object, wall: float) -> None:
        assert isinstance(acc, dict)
        _tls.acc = None
        if acc.get("rows"):
            with open(path, "a") as f:
                f.write(json.dumps({"wall_s": wall, **acc}) + "\n")

    add_step_listener("profile", begin, end, sync=True)


def enabled() -> bool:
    return bool(envs.KVEVICT_PROFILE_DIR)
