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

Every series carries vLLM's own labels, so one dashboard or rule serves a fleet: ``model_name``
(the served model name, as on ``vllm:*``) and, on what an engine core or its workers record,
``engine`` (the engine's data-parallel index, as on ``vllm:*``; "0" without data parallelism). The
API server knows the model name (:func:`set_model_name`, from the configuration check); each
engine core learns its index before its KV cache manager is made (:func:`set_engine`, from the
scheduler's construction), each worker from the configuration vLLM sets while it initialises its
KV cache; both are in the file name (``<role>-e<engine>-r<rank>-<pid>.f64``).

| metric | type | labels (besides model_name) | recorded by |
|---|---|---|---|
| ``kvevict:tokens_evicted_total`` | counter | engine, policy | engine core, when a window moves |
| ``kvevict:blocks_freed_total`` | counter | engine, policy | engine core, when a window moves |
| ``kvevict:compactions_total`` | counter | engine, policy | engine core, when a window moves |
| ``kvevict:fallbacks_total`` | counter | engine, policy, rank | workers, when a request's policy fails |
| ``kvevict:prefix_hits_total`` | counter | engine, policy | engine core, when an evicting request starts on a hit |
| ``kvevict:prefix_hit_tokens_total`` | counter | engine, policy | engine core, the tokens of those hits |
| ``kvevict:compressed_hits_total`` | counter | engine, policy | engine core, when an evicting request starts on a cached compacted window |
| ``kvevict:compressed_hit_tokens_total`` | counter | engine, policy | engine core, the tokens of those hits |
| ``kvevict:requests_released_total`` | counter | engine, policy | engine core, when a request's blocks are freed |
| ``kvevict:peak_blocks_held_total`` | counter | engine, policy | engine core, the peak blocks of those requests |
| ``kvevict:eviction_seconds`` | histogram | engine, rank | workers, per model step (every layer and request) |
| ``kvevict:window_blocks_held`` | gauge | engine | engine core: blocks held by requests with a bounded window |
| ``kvevict:window_blocks_bound`` | gauge | engine | engine core: the sum of those requests' window bounds |
| ``kvevict:recalled_tokens_total`` | counter | engine, policy | workers: evicted token slots recall brought back |
| ``kvevict:recall_tier_tokens`` | gauge | engine | workers: token slots held in recall tiers |
| ``kvevict:recall_tier_bytes`` | gauge | engine | workers: host memory those tiers hold (bytes) |
| ``kvevict:recall_cached_tier_bytes`` | gauge | engine | workers: host memory the tiers of cached windows hold (bytes) |
| ``kvevict:requests_refused_total`` | counter | key, reason | API server: requests refused with HTTP 400 |

``peak_blocks_held`` over ``requests_released`` is the mean peak per request (``policy`` ``none``:
requests that do not evict); with one request in flight, its increase is that request's exact peak.
``tokens_evicted`` counts token slots per sequence (every layer and KV head evicts the same
number); ``policy`` is the request's own policy (its override, else the server's). A window is
bounded when the request evicts in ``chunked`` mode with a policy that also evicts while decoding:
its bound is ``window.window_bound_blocks`` (the budget rounded up to a block plus a stride, and a
step per extra concurrent batch). ``requests_refused`` counts the API server's refusals
(plugin.py): ``key`` is the request key the 400 names, without its ``kvevict_`` prefix, from a fixed
set (:data:`REFUSED_KEYS`; anything else is ``other``), ``reason`` is ``invalid`` (a bad value, an
unknown key, a combination the server refuses) or ``too_large`` (it could hold more KV blocks than
the pool).
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
from vllm_kvevict.config import REQUEST_KEYS
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
    "requests_released": "Requests released by the engine core (finished, aborted or preempted: each attempt once)",
    "peak_blocks_held": "Sum over released requests of the most KV blocks each held at once (its peak)",
}
GAUGES = {
    "window_blocks_held": "KV blocks held by the requests whose window is bounded (chunked eviction, also while decoding)",
    "window_blocks_bound": "Sum of the window bounds (most blocks each may hold) of those requests",
    "recall_tier_tokens": "Evicted token slots held in recall tiers (all layers and KV heads; outside vLLM's pool)",
    "recall_tier_bytes": "Host memory held by recall tiers, bytes (bounded by recall.max_bytes per worker)",
    "recall_cached_tier_bytes": "Host memory held by the recall tiers of cached windows, bytes (at most half of recall.max_bytes)",
}
HISTOGRAM = ("eviction_seconds", "Time spent evicting (scoring, selecting, compacting) per model step, all layers")
REFUSED = (
    "requests_refused",
    "Requests refused with HTTP 400 by the plugin's checks, by the request key named: a bad value (reason "
    "invalid) or a request that could hold more KV blocks than the pool (reason too_large)",
)
#: the ``key`` label of ``requests_refused``: the request keys (less ``kvevict_``), vLLM's
#: ``max_tokens`` (named when no kvevict key made a request too large), anything else ``other``
_REQUEST_KEYS = tuple(REQUEST_KEYS.values())  # the per-request keys, less kvevict_
REFUSED_KEYS = (*_REQUEST_KEYS, "max_tokens", "other")
REFUSED_REASONS = ("invalid", "too_large")
#: vLLM's labels, first on every series (``engine`` only on what an engine core or its workers record)
MODEL_LABEL, ENGINE_LABEL = "model_name", "engine"


@dataclass(frozen=True)
class _Layout:
    """Offsets into a process's float64 array."""

    counters: dict[str, int]
    refused: int  # len(REFUSED_KEYS) * len(REFUSED_REASONS) counts, key-major
    gauges: dict[str, int]
    buckets: int  # len(BUCKETS) + 1 counts (the last one: +Inf), then sum, then count
    size: int


def _layout() -> _Layout:
    off, counters, gauges = 0, {}, {}
    for name in COUNTERS:
        counters[name] = off
        off += len(POLICY_LABELS)
    refused = off
    off += len(REFUSED_KEYS) * len(REFUSED_REASONS)
    for name in GAUGES:
        gauges[name] = off
        off += 1
    buckets = off
    off += len(BUCKETS) + 1 + 2
    return _Layout(counters, refused, gauges, buckets, off)


LAYOUT = _layout()


def labels(sample: str) -> tuple[str, ...]:
    """The labels the plugin exports a sample with (``kvevict:blocks_freed_total``,
    ``kvevict:eviction_seconds_bucket``...); () for a name it does not export."""
    base = sample.removeprefix(PREFIX)
    for suffix in ("_total", "_bucket", "_sum", "_count"):
        base = base.removesuffix(suffix)
    if not sample.startswith(PREFIX):
        return ()
    if base in COUNTERS and sample.endswith("_total"):
        return (
            (MODEL_LABEL, ENGINE_LABEL, "policy", "rank")
            if base == "fallbacks"
            else (MODEL_LABEL, ENGINE_LABEL, "policy")
        )
    if base == REFUSED[0] and sample.endswith("_total"):
        return (MODEL_LABEL, "key", "reason")
    if base in GAUGES and sample == PREFIX + base:
        return (MODEL_LABEL, ENGINE_LABEL)
    if base == HISTOGRAM[0] and sample != PREFIX + base + "_total":
        return (
            (MODEL_LABEL, ENGINE_LABEL, "rank", "le")
            if sample.endswith("_bucket")
            else (MODEL_LABEL, ENGINE_LABEL, "rank")
        )
    return ()


def refused_key(key: str | None) -> str:
    """The ``key`` label of a refusal naming ``key`` (``kvevict_params.window`` -> ``params``)."""
    if key == "max_tokens":
        return key
    short = key.removeprefix("kvevict_").split(".", 1)[0] if key and key.startswith("kvevict_") else ""
    return short if short in _REQUEST_KEYS else "other"


class Recorder:
    """This process's metrics file (``<dir>/<role>-e<engine>-r<rank>-<pid>.f64``; ``e`` alone: no
    engine, the API server's)."""

    def __init__(self, directory: str, role: str, rank: int = 0, engine: str | None = "0"):
        self.engine = engine
        self.path = Path(directory) / f"{role}-e{engine if engine is not None else ''}-r{rank}-{os.getpid()}.f64"
        tmp = self.path.with_suffix(".tmp")
        np.zeros(LAYOUT.size, dtype=np.float64).tofile(tmp)
        os.replace(tmp, self.path)  # a reader sees a whole file or none
        self.values = np.memmap(self.path, dtype=np.float64, mode="r+", shape=(LAYOUT.size,))
        self._step_seconds = 0.0
        self._cuda_events: list = []
        self._later: list = []  # (name, policy, tensor): counts read when the step ends

    def inc(self, name: str, policy: str, amount: float = 1.0) -> None:
        if policy in POLICY_LABELS:
            self.values[LAYOUT.counters[name] + POLICY_LABELS.index(policy)] += amount

    def inc_later(self, name: str, policy: str, amount) -> None:
        """:meth:`inc` by a count still on the device (a tensor): read when the step ends
        (:meth:`end_step`), so nothing waits for the device mid-step."""
        self._later.append((name, policy, amount))

    def refused(self, key: str | None, reason: str) -> None:
        """Count a request refused with a 400 naming ``key`` (any string: bounded here)."""
        if reason in REFUSED_REASONS:
            i = REFUSED_KEYS.index(refused_key(key)) * len(REFUSED_REASONS) + REFUSED_REASONS.index(reason)
            self.values[LAYOUT.refused + i] += 1

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
        for name, policy, amount in self._later:
            self.inc(name, policy, float(amount))
        self._later.clear()
        self._step_seconds = 0.0
        if seconds > 0:
            self.observe(seconds)


_recorder: Recorder | None = None
_engine: str | None = None  # this engine core's index (set_engine), inherited by no other process
_model_name: str | None = None  # the served model name (set_model_name; read by the API server's collector)


def set_engine(index: object) -> None:
    """This process is (part of) the engine core with data-parallel index ``index`` (vLLM's
    ``engine`` label); called before it makes its recorder."""
    global _engine
    if isinstance(index, int):
        _engine = str(index)


def set_model_name(name: object) -> None:
    """The served model name vLLM labels its own series with (``model_config.served_model_name``:
    a string, or a list whose first name vLLM uses)."""
    global _model_name
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    if isinstance(name, str) and name:
        _model_name = name


def _engine_index() -> str | None:
    """This process's engine index: the one :func:`set_engine` was given, else the one of the
    configuration vLLM has set as current (a worker initialising its KV cache), else None."""
    if _engine is not None:
        return _engine
    from vllm_kvevict.vllm_compat import metrics as vllm_metrics

    index = vllm_metrics.current_engine_index()
    return str(index) if index is not None else None


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
    (the policies and kernels used outside a server). An engine core's or worker's carries its
    engine index ("0" when none is known: vLLM's single engine); the API server's none."""
    global _recorder
    if _recorder is None:
        directory = envs.KVEVICT_METRICS_DIR
        if not directory or not os.path.isdir(directory):
            return None
        engine = _engine_index()
        _recorder = Recorder(directory, role, rank, engine if engine is not None or role == "api" else "0")
    return _recorder


def count_refused(key: str | None, reason: str = "invalid") -> None:
    """The API server refused a request with a 400 naming ``key`` (``kvevict:requests_refused_total``)."""
    rec = recorder("api")
    if rec is not None:
        rec.refused(key, reason)


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


@dataclass(frozen=True)
class ProcessFile:
    """One process's records, as read at a scrape."""

    role: str
    engine: str | None  # None: the API server's (no engine)
    rank: int
    alive: bool
    values: np.ndarray


def read(directory: str) -> list[ProcessFile]:
    """Every process's file (one of another layout or name, a stale plugin's, is skipped)."""
    out = []
    for path in sorted(Path(directory).glob("*.f64")):
        parts = path.stem.rsplit("-", 3)
        if len(parts) != 4 or not parts[1].startswith("e") or not parts[2].startswith("r"):
            continue
        role, engine, rank, pid = parts
        try:
            values = np.fromfile(path, dtype=np.float64)
        except OSError:
            continue
        if values.shape[0] == LAYOUT.size and rank[1:].isdigit() and pid.isdigit():
            out.append(ProcessFile(role, engine[1:] or None, int(rank[1:]), _alive(int(pid)), values))
    return out


def _engine_order(engine: str) -> tuple[int, str]:
    return (int(engine), "") if engine.isdigit() else (1 << 30, engine)


class Collector:
    """The families above, added up over every process's file at each scrape (prometheus_client's
    custom-collector protocol: ``collect()`` yields metric families), labelled by model and engine."""

    def __init__(self, directory: str, model_name: str | None = None):
        self.directory = directory
        self.model_name = model_name  # None: the one set_model_name was given, read at each scrape

    def describe(self):
        return []  # no samples at registration time: the files may not exist yet

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        model = self.model_name or _model_name or ""
        files = read(self.directory)
        engine_files = [(f.engine, f) for f in files if f.engine is not None]
        engines = sorted({e for e, _ in engine_files}, key=_engine_order)
        for name, help_text in COUNTERS.items():
            per_rank = name == "fallbacks"
            fam = CounterMetricFamily(PREFIX + name, help_text, labels=list(labels(PREFIX + name + "_total")))
            sums: dict[tuple[str, ...], float] = {}
            for engine, f in engine_files:
                for i, policy in enumerate(POLICY_LABELS):
                    series: tuple[str, ...] = (engine, policy, str(f.rank)) if per_rank else (engine, policy)
                    sums[series] = sums.get(series, 0.0) + float(f.values[LAYOUT.counters[name] + i])
            # every policy's series from the start, zeros included: increase() sees the first
            # event (a series that appears at 1 has not increased), so "any fallback" alerts fire
            for series, value in sorted(sums.items(), key=lambda kv: (_engine_order(kv[0][0]), kv[0][1:])):
                fam.add_metric([model, *series], value)
            yield fam
        name, help_text = REFUSED
        fam = CounterMetricFamily(PREFIX + name, help_text, labels=list(labels(PREFIX + name + "_total")))
        n_refused = len(REFUSED_KEYS) * len(REFUSED_REASONS)
        refused = sum((f.values[LAYOUT.refused : LAYOUT.refused + n_refused] for f in files), np.zeros(n_refused))
        for k, key in enumerate(REFUSED_KEYS):  # every key and reason from the start, at 0 (as above)
            for r, reason in enumerate(REFUSED_REASONS):
                fam.add_metric([model, key, reason], float(refused[k * len(REFUSED_REASONS) + r]))
        yield fam
        for name, help_text in GAUGES.items():
            gauge = GaugeMetricFamily(PREFIX + name, help_text, labels=list(labels(PREFIX + name)))
            for engine in engines:  # of live processes only
                total = sum(float(f.values[LAYOUT.gauges[name]]) for e, f in engine_files if e == engine and f.alive)
                gauge.add_metric([model, engine], total)
            yield gauge
        name, help_text = HISTOGRAM
        hist = HistogramMetricFamily(PREFIX + name, help_text, labels=list(labels(PREFIX + name + "_sum")))
        b, n = LAYOUT.buckets, len(BUCKETS)
        by_rank: dict[tuple[str, int], np.ndarray] = {}
        for engine, f in engine_files:  # only workers time steps; the rest add zeros
            by_rank[engine, f.rank] = by_rank.get((engine, f.rank), 0) + f.values[b : b + n + 3]
        for (engine, rank), h in sorted(by_rank.items(), key=lambda kv: (_engine_order(kv[0][0]), kv[0][1])):
            if not h[n + 2]:
                continue
            cumulative = np.cumsum(h[: n + 1])
            buckets = [(str(le), float(c)) for le, c in zip(BUCKETS, cumulative)] + [("+Inf", float(cumulative[-1]))]
            hist.add_metric([model, engine, str(rank)], buckets, float(h[n + 1]))
        yield hist
