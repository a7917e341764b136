"""Step-level timing of the eviction path, for ``kvevict-bench overhead`` (off unless asked).

With ``KVEVICT_PROFILE_DIR`` set, every worker process appends one JSON line per model step to
``<dir>/steps-<pid>.jsonl``: the step's wall time (the runner's ``execute_model``, written against
vLLM 0.32.0), the time spent inside the attention kernels, the time spent in eviction (observe,
score, select, compact: everything the plugin adds after attention), the number of tokens and
rows, and how many rows compacted. On CUDA the device is synchronised around each timed region
(profiling changes the timing it measures only by those synchronisations).
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager

PROFILE_DIR = os.environ.get("KVEVICT_PROFILE_DIR")

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


def note(**fields) -> None:
    """Record facts about the current step (the first value of each field wins)."""
    acc = _acc()
    if acc is not None:
        for k, v in fields.items():
            acc.setdefault(k, v)


def install_profile_hook() -> None:
    """Wrap the model runner's ``execute_model`` to time each step. Idempotent; profiling only."""
    if not PROFILE_DIR:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if GPUModelRunner.__dict__.get("_kvevict_profile_hook"):
        return
    orig = GPUModelRunner.execute_model
    os.makedirs(PROFILE_DIR, exist_ok=True)
    path = os.path.join(PROFILE_DIR, f"steps-{os.getpid()}.jsonl")

    def execute_model(self, scheduler_output, *args, **kwargs):
        _tls.acc = acc = {}
        device = getattr(self, "device", None)
        _sync(device)
        t0 = time.perf_counter()
        try:
            return orig(self, scheduler_output, *args, **kwargs)
        finally:
            _sync(device)
            wall = time.perf_counter() - t0
            _tls.acc = None
            if acc.get("rows"):
                with open(path, "a") as f:
                    f.write(json.dumps({"wall_s": wall, **acc}) + "\n")

    GPUModelRunner.execute_model = execute_model
    GPUModelRunner._kvevict_profile_hook = True
