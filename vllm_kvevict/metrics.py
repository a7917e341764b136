# SPDX-License-Identifier: Apache-2.0
"""The plugin's Prometheus metrics, served by vLLM's own ``/metrics`` (no second port).

What eviction does happens in two kinds of process: the engine core frees blocks as windows move
(tokens evicted, blocks freed, compactions, blocks held), the workers run the compaction (its time)
and isolate faults (fallbacks). vLLM serves ``/metrics`` from the API server. So every process
records into a small shared-memory file of its own (a float64 array, one slot per metric, label
and bucket, written in place: no lock, no flush, visible to a reader at once), in a directory the
API server creates at start-up and passes on through ``KVEVICT_METRICS_DIR``; the API server's
collector, registered in the registry vLLM serves, adds the files up at every scrape. A process
writes only its own file, so this is safe for any number of engine cores, workers and
tensor-parallel ranks; counters of a process that has exited are kept (they are totals), its
gauges are dropped.

| metric | type | labels | recorded by |
|---|---|---|---|
| ``kvevict:tokens_evicted_total`` | counter | policy | engine core, when a window moves |
| ``kvevict:blocks_freed_total`` | counter | policy | engine core, when a window moves |
| ``kvevict:compactions_total`` | counter | policy | engine core, when a window moves |
| ``kvevict:fallbacks_total`` | counter | policy, rank | workers, when a request's policy fails |
| ``kvevict:prefix_hits_total`` | counter | policy | engine core, when an evicting request starts on a hit |
| ``kvevict:prefix_hit_tokens_total`` | counter | policy | engine core, the tokens of those hits |
| ``kvevict:compressed_hits_total`` | counter | policy | engine core, when an evicting request starts on a cached compacted window |
| ``kvevict:compressed_hit_tokens_total`` | counter | policy | engine core, the tokens of those hits |
| ``kvevict:eviction_seconds`` | histogram | rank | workers, per model step (every layer and request) |
| ``kvevict:window_blocks_held`` | gauge | | engine core: blocks held by requests with a bounded window |
| ``kvevict:window_blocks_bound`` | gauge | | engine core: the sum of those requests' window bounds |
| ``kvevict:recalled_tokens_total`` | counter | policy | workers: evicted token slots recall brought back |
| ``kvevict:recall_tier_tokens`` | gauge | | workers: token slots held in recall tiers |
| ``kvevict:recall_tier_bytes`` | gauge | | workers: host memory those tiers hold (bytes) |
| ``kvevict:recall_cached_tier_bytes`` | gauge | | workers: host memory the tiers of cached windows hold (bytes) |

``tokens_evicted`` counts token slots per sequence (every layer and KV head evicts the same
number); ``policy`` is the request's own policy (its override, else the server's). A window is
bounded when the request evicts in ``chunked`` mode with a policy that also evicts while decoding:
its bound is ``window.window_bound_blocks`` (the budget rounded up to a block plus a stride, and a
step per extra concurrent batch).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_kvevict import envs
from vllm_kvevict.policies import POLICIES

METRICS_DIR_ENV = "KVEVICT_METRICS_DIR"
PREFIX = "kvevict:"
POLICY_LABELS = tuple(sorted(POLICIES))
#: eviction time per model step, seconds (CPU steps of small models to GPU steps of large ones)
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

COUNTERS = {  # name -> help; one slot per policy
    "tokens_evicted": "Token slots evicted from sequences' windows (per sequence; every layer and KV head evicts as many)",
    "blocks_freed": "KV blocks freed by eviction and returned to vLLM's pool",
    "compactions": "Window moves: compactions of one request's KV (all layers)",
    "fallbacks": "Requests whose policy failed and that fell back to keeping the newest tokens (per rank)",
    "prefix_hits": "Requests that evict and started (or restarted) on a prefix-cache hit of pure blocks",
    "prefix_hit_tokens": "Prompt tokens those requests took from the prefix cache instead of computing them",
    "compressed_hits": "Requests that started (or restarted) on a cached compacted window (compressed-window reuse)",
    "compressed_hit_tokens": "Tokens those requests did not compute: the compaction point of the window they started on",
    "recalled_tokens": "Evicted token slots the recall tier brought back into windows (summed over layers and KV heads)",
}
GAUGES = {
    "window_blocks_held": "KV blocks held by the requests whose window is bounded (chunked eviction, also while decoding)",
    "window_blocks_bound": "Sum of the window bounds (most blocks each may hold) of those requests",
    "recall_tier_tokens": "Evicted token slots held in recall tiers (all layers and KV heads; outside vLLM's pool)",
    "recall_tier_bytes": "Host memory held by recall tiers, bytes (bounded by recall.max_bytes per worker)",
    "recall_cached_tier_bytes": "Host memory held by the recall tiers of cached windows, bytes (at most half of recall.max_bytes)",
}
HISTOGRAM = ("eviction_seconds", "Time spent evicting (scoring, selecting, compacting) per model step, all layers")


@dataclass(frozen=True)
class _Layout:
    """Offsets into a process's float64 array."""

    counters: dict[str, int]
    gauges: dict[str, int]
    buckets: int  # len(BUCKETS) + 1 counts (the last one: +Inf), then sum, then count
    size: int


def _layout() -> _Layout:
    off, counters, gauges = 0, {}, {}
    for name in COUNTERS:
        counters[name] = off
        off += len(POLICY_LABELS)
    for name in GAUGES:
        gauges[name] = off
        off += 1
    buckets = off
    off += len(BUCKETS) + 1 + 2
    return _Layout(counters, gauges, buckets, off)


LAYOUT = _layout()


class Recorder:
    """This process's metrics file (``<dir>/<role>-r<rank>-<pid>.f64``)."""

    def __init__(self, directory: str, role: str, rank: int = 0):
        self.path = Path(directory) / f"{role}-r{rank}-{os.getpid()}.f64"
        tmp = self.path.with_suffix(".tmp")
        np.zeros(LAYOUT.size, dtype=np.float64).tofile(tmp)
        os.replace(tmp, self.path)  # a reader sees a whole file or none
        self.values = np.memmap(self.path, dtype=np.float64, mode="r+", shape=(LAYOUT.size,))
        self._step_seconds = 0.0
        self._cuda_events: list = []

    def inc(self, name: str, policy: str, amount: float = 1.0) -> None:
        if policy in POLICY_LABELS:
            self.values[LAYOUT.counters[name] + POLICY_LABELS.index(policy)] += amount

    def set(self, name: str, value: float) -> None:
        self.values[LAYOUT.gauges[name]] = value

    def observe(self, seconds: float) -> None:
        b = LAYOUT.buckets
        i = next((k for k, le in enumerate(BUCKETS) if seconds <= le), len(BUCKETS))
        self.values[b + i] += 1
        self.values[b + len(BUCKETS) + 1] += seconds
        self.values[b + len(BUCKETS) + 2] += 1

    # -- eviction time, added up over a model step's layers (workers) ---------------------------

    @contextmanager
    def eviction_timer(self, device):
        """Time one layer's eviction. On CUDA the work is only queued here: it is timed by events,
        read when the step ends (:meth:`end_step`), so nothing waits for the device mid-step."""
        if getattr(device, "type", None) == "cuda":
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._cuda_events.append((start, end))
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._step_seconds += time.perf_counter() - t0

    def end_step(self) -> None:
        seconds = self._step_seconds
        if self._cuda_events:
            self._cuda_events[-1][1].synchronize()
            seconds += sum(s.elapsed_time(e) for s, e in self._cuda_events) / 1e3
            self._cuda_events.clear()
        self._step_seconds = 0.0
        if seconds > 0:
            self.observe(seconds)


_recorder: Recorder | None = None


def setup_directory() -> str:
    """The directory every process of this server records into: ``KVEVICT_METRICS_DIR`` when set
    (by the API server for the processes it starts, or by the operator), else a new one, made here
    (the first process: the API server) and removed when it exits."""
    directory = envs.KVEVICT_METRICS_DIR
    if directory:
        os.makedirs(directory, exist_ok=True)
        return directory
    directory = tempfile.mkdtemp(prefix="kvevict-metrics-")
    os.environ[METRICS_DIR_ENV] = directory  # inherited by the engine core and the workers
    atexit.register(shutil.rmtree, directory, True)
    return directory


def recorder(role: str, rank: int = 0) -> Recorder | None:
    """This process's recorder (made on first use), or None when no metrics directory is set up
    (the policies and kernels used outside a server)."""
    global _recorder
    if _recorder is None:
        directory = envs.KVEVICT_METRICS_DIR
        if not directory or not os.path.isdir(directory):
            return None
        _recorder = Recorder(directory, role, rank)
    return _recorder


def worker_recorder() -> Recorder | None:
    """A worker's recorder: its tensor-parallel rank in the labels."""
    if _recorder is not None:  # every layer asks: once made, the answer stands
        return _recorder
    from vllm_kvevict.vllm_compat import distributed as vllm_distributed

    return recorder("worker", vllm_distributed.tensor_parallel()[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read(directory: str) -> list[tuple[str, int, bool, np.ndarray]]:
    """``(role, rank, alive, values)`` of every process's file."""
    out = []
    for path in sorted(Path(directory).glob("*.f64")):
        role, rank, pid = path.stem.rsplit("-", 2)
        try:
            values = np.fromfile(path, dtype=np.float64)
        except OSError:
            continue
        if values.shape[0] == LAYOUT.size:
            out.append((role, int(rank[1:]), _alive(int(pid)), values))
    return out


class Collector:
    """The families above, added up over every process's file at each scrape (prometheus_client's
    custom-collector protocol: ``collect()`` yields metric families)."""

    def __init__(self, directory: str):
        self.directory = directory

    def describe(self):
        return []  # no samples at registration time: the files may not exist yet

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        files = read(self.directory)
        for name, help_text in COUNTERS.items():
            per_rank = name == "fallbacks"
            fam = CounterMetricFamily(PREFIX + name, help_text, labels=["policy", "rank"] if per_rank else ["policy"])
            sums: dict[tuple, float] = {}
            for _role, rank, _alive, values in files:
                for i, policy in enumerate(POLICY_LABELS):
                    key = (policy, str(rank)) if per_rank else (policy,)
                    sums[key] = sums.get(key, 0.0) + float(values[LAYOUT.counters[name] + i])
            # every policy's series from the start, zeros included: increase() sees the first
            # event (a series that appears at 1 has not increased), so "any fallback" alerts fire
            for key, value in sorted(sums.items()):
                fam.add_metric(list(key), value)
            yield fam
        for name, help_text in GAUGES.items():
            total = sum(float(v[LAYOUT.gauges[name]]) for _r, _k, alive, v in files if alive)
            yield GaugeMetricFamily(PREFIX + name, help_text, value=total)
        name, help_text = HISTOGRAM
        hist = HistogramMetricFamily(PREFIX + name, help_text, labels=["rank"])
        b, n = LAYOUT.buckets, len(BUCKETS)
        by_rank: dict[int, np.ndarray] = {}
        for _role, rank, _alive, values in files:  # only workers time steps; the rest add zeros
            by_rank[rank] = by_rank.get(rank, 0) + values[b : b + n + 3]
        for rank, h in sorted(by_rank.items()):
            if not h[n + 2]:
                continue
            cumulative = np.cumsum(h[: n + 1])
            buckets = [(str(le), float(c)) for le, c in zip(BUCKETS, cumulative)] + [("+Inf", float(cumulative[-1]))]
            hist.add_metric([str(rank)], buckets, float(h[n + 1]))
        yield hist
