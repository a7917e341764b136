# SPDX-License-Identifier: Apache-2.0
"""The metrics files and their collector (vllm_kvevict/metrics.py), across real processes: each
writes only its own file; the collector adds counters up (also of processes that have exited),
keeps gauges of live processes only, and builds cumulative histogram buckets per rank."""

from __future__ import annotations

import multiprocessing as mp

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_kvevict import metrics


def _child(directory: str, role: str, rank: int, go, done) -> None:
    import os

    os.environ[metrics.METRICS_DIR_ENV] = directory
    metrics._recorder = None
    rec = metrics.recorder(role, rank)
    if role == "core":
        rec.inc("blocks_freed", "keydiff", 3)
        rec.inc("tokens_evicted", "keydiff", 96)
        rec.inc("compactions", "snapkv")
        rec.set("window_blocks_held", 7)
    else:
        rec.inc("fallbacks", "tova")
        rec.observe(0.002)
        rec.observe(10.0)
    done.set()
    go.wait(30)  # stay alive until the parent has read the live gauges


MODEL = "smollm2"


def _scrape(directory: str, full: bool = False) -> dict:
    """Every sample; unless ``full``, keyed without the ``model_name`` and ``engine`` labels (one
    model, engine 0: checked by their own tests)."""
    registry = CollectorRegistry()
    registry.register(metrics.Collector(directory, MODEL))
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            labels = dict(s.labels)
            if not full:
                assert labels.pop("model_name") == MODEL
                assert labels.pop("engine", "0") == "0"
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def test_processes_add_up(tmp_path):
    ctx = mp.get_context("spawn")
    go, procs = ctx.Event(), []
    for role, rank in (("core", 0), ("worker", 0), ("worker", 1)):
        done = ctx.Event()
        p = ctx.Process(target=_child, args=(str(tmp_path), role, rank, go, done))
        p.start()
        assert done.wait(60)
        procs.append(p)
    live = _scrape(str(tmp_path))
    assert live[("kvevict:blocks_freed_total", (("policy", "keydiff"),))] == 3
    assert live[("kvevict:tokens_evicted_total", (("policy", "keydiff"),))] == 96
    assert live[("kvevict:compactions_total", (("policy", "snapkv"),))] == 1
    assert live[("kvevict:fallbacks_total", (("policy", "tova"), ("rank", "0")))] == 1
    assert live[("kvevict:fallbacks_total", (("policy", "tova"), ("rank", "1")))] == 1
    assert live[("kvevict:window_blocks_held", ())] == 7
    for rank in ("0", "1"):
        assert live[("kvevict:eviction_seconds_count", (("rank", rank),))] == 2
        assert live[("kvevict:eviction_seconds_sum", (("rank", rank),))] == pytest.approx(10.002)
        assert live[("kvevict:eviction_seconds_bucket", (("le", "0.001"), ("rank", rank)))] == 0
        assert live[("kvevict:eviction_seconds_bucket", (("le", "0.0025"), ("rank", rank)))] == 1
        assert live[("kvevict:eviction_seconds_bucket", (("le", "5.0"), ("rank", rank)))] == 1
        assert live[("kvevict:eviction_seconds_bucket", (("le", "+Inf"), ("rank", rank)))] == 2
    go.set()
    for p in procs:
        p.join(30)
    gone = _scrape(str(tmp_path))
    assert gone[("kvevict:blocks_freed_total", (("policy", "keydiff"),))] == 3  # totals outlive processes
    assert gone[("kvevict:window_blocks_held", ())] == 0  # gauges of exited processes are dropped


def test_no_directory_no_recorder(monkeypatch):
    monkeypatch.setenv(metrics.METRICS_DIR_ENV, "x")
    monkeypatch.delenv(metrics.METRICS_DIR_ENV)
    monkeypatch.setattr(metrics, "_recorder", None)
    assert metrics.recorder("worker") is None


def test_unknown_policy_label_is_ignored(tmp_path):
    rec = metrics.Recorder(str(tmp_path), "core")
    rec.inc("blocks_freed", "not-a-policy", 5)
    assert not rec.values.any()


def test_cpu_eviction_timer_adds_layers_up(tmp_path):
    import torch

    rec = metrics.Recorder(str(tmp_path), "worker")
    for _ in range(3):
        with rec.eviction_timer(torch.device("cpu")):
            sum(range(1000))
    rec.end_step()
    rec.end_step()  # a step without eviction records nothing
    h = _scrape(str(tmp_path))
    assert h[("kvevict:eviction_seconds_count", (("rank", "0"),))] == 1


def test_counters_are_exported_at_zero_before_any_event(tmp_path):
    """Every counter has a series per policy (fallbacks: per policy and rank) from the first
    scrape, at 0: ``increase(kvevict:fallbacks_total[1h]) > 0`` then sees the first fallback (a
    series that appears at 1 has not increased)."""
    recorders = [
        metrics.Recorder(str(tmp_path), role, rank) for role, rank in (("core", 0), ("worker", 0), ("worker", 1))
    ]
    first = _scrape(str(tmp_path))
    for name in metrics.COUNTERS:
        for policy in metrics.POLICY_LABELS:
            if name == "fallbacks":
                for rank in ("0", "1"):
                    assert first[(f"kvevict:{name}_total", (("policy", policy), ("rank", rank)))] == 0
            else:
                assert first[(f"kvevict:{name}_total", (("policy", policy),))] == 0
    recorders[2].inc("fallbacks", "keydiff")
    assert _scrape(str(tmp_path))[("kvevict:fallbacks_total", (("policy", "keydiff"), ("rank", "1")))] == 1


def test_model_and_engine_labels_as_vllms(tmp_path, monkeypatch):
    """Every series carries ``model_name`` (the served model name, as ``vllm:*``) and, on what an
    engine core or its workers record, ``engine`` (vLLM's engine index): two data-parallel engines
    are two series; the API server's file (no engine) adds to none of them."""
    monkeypatch.setattr(metrics, "_model_name", None)
    metrics.set_model_name(["served-a", "alias"])  # vLLM labels with the first name
    core0, core1 = (metrics.Recorder(str(tmp_path), "core", 0, e) for e in ("0", "1"))
    worker1 = metrics.Recorder(str(tmp_path), "worker", 0, "1")
    api = metrics.Recorder(str(tmp_path), "api", 0, None)
    core0.inc("blocks_freed", "keydiff", 2)
    core1.inc("blocks_freed", "keydiff", 5)
    core1.set("window_blocks_held", 4)
    worker1.observe(0.01)
    api.inc("blocks_freed", "keydiff", 100)  # never happens; ignored if it did
    registry = CollectorRegistry()
    registry.register(metrics.Collector(str(tmp_path)))
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
    }
    m = ("model_name", "served-a")
    assert got[("kvevict:blocks_freed_total", (("engine", "0"), m, ("policy", "keydiff")))] == 2
    assert got[("kvevict:blocks_freed_total", (("engine", "1"), m, ("policy", "keydiff")))] == 5
    assert got[("kvevict:window_blocks_held", (("engine", "0"), m))] == 0
    assert got[("kvevict:window_blocks_held", (("engine", "1"), m))] == 4
    assert got[("kvevict:eviction_seconds_count", (("engine", "1"), m, ("rank", "0")))] == 1
    assert ("kvevict:eviction_seconds_count", (("engine", "0"), m, ("rank", "0"))) not in got  # no step timed
    for (name, labels), _ in got.items():
        assert dict(labels)["model_name"] == "served-a", name
        assert set(dict(labels)) == set(metrics.labels(name)), name


def test_refusals_counted_by_a_bounded_key(tmp_path):
    """``kvevict:requests_refused_total{key, reason}``: the key a 400 names, less ``kvevict_``,
    from a fixed set (a client's made-up key is ``other``); every key and reason exported at 0."""
    from vllm_kvevict.config import REQUEST_KEYS

    assert set(metrics.REFUSED_KEYS[:-2]) == {k.removeprefix("kvevict_") for k in REQUEST_KEYS}
    rec = metrics.Recorder(str(tmp_path), "api", 0, None)
    first = _scrape(str(tmp_path), full=True)
    for key in metrics.REFUSED_KEYS:
        for reason in metrics.REFUSED_REASONS:
            labels = (("key", key), ("model_name", MODEL), ("reason", reason))
            assert first[("kvevict:requests_refused_total", labels)] == 0
    rec.refused("kvevict_budget", "invalid")
    rec.refused("kvevict_budget", "too_large")
    rec.refused("kvevict_params.window", "invalid")
    rec.refused("max_tokens", "too_large")
    for made_up in ("kvevict_" + "x" * 64, "vllm_xargs", None, "budget", "kvevict_max_tokens", "kvevict_other"):
        rec.refused(made_up, "invalid")
    rec.refused("kvevict_budget", "not-a-reason")  # ignored
    got = _scrape(str(tmp_path), full=True)
    refused = {dict(k)["key"] + "/" + dict(k)["reason"]: v for (n, k), v in got.items() if n.endswith("refused_total")}
    assert {k: v for k, v in refused.items() if v} == {
        "budget/invalid": 1,
        "budget/too_large": 1,
        "params/invalid": 1,
        "max_tokens/too_large": 1,
        "other/invalid": 6,
    }
    assert len(refused) == len(metrics.REFUSED_KEYS) * len(metrics.REFUSED_REASONS)


def test_engine_index_from_the_scheduler_or_the_current_config(tmp_path, monkeypatch):
    """An engine core learns its index where vLLM makes its scheduler (before the KV cache
    manager records), a worker from the configuration vLLM sets current while it initialises;
    without either, engine "0" (the API server's: none)."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config

    monkeypatch.setenv(metrics.METRICS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(metrics, "_engine", None)
    monkeypatch.setattr(metrics, "_recorder", None)
    assert metrics.recorder("core").engine == "0"
    monkeypatch.setattr(metrics, "_recorder", None)
    assert metrics.recorder("api").engine is None
    monkeypatch.setattr(metrics, "_recorder", None)
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=3))
    with set_current_vllm_config(cfg):  # type: ignore[arg-type]
        assert metrics.recorder("worker").engine == "3"
    monkeypatch.setattr(metrics, "_recorder", None)
    metrics.set_engine(2)
    assert metrics.recorder("core").engine == "2"
    assert {f.engine for f in metrics.read(str(tmp_path))} == {"0", None, "3", "2"}
    (tmp_path / "core-r0-1.f64").write_bytes(b"")  # an older plugin's name: skipped
    assert len(metrics.read(str(tmp_path))) == 4


def test_the_scheduler_hook_passes_the_engine_index():
    """vLLM's ``Scheduler.__init__`` takes ``vllm_config`` first (by keyword from the engine core):
    the hook reads its ``data_parallel_index`` before the original runs."""
    import inspect
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_kvevict.vllm_compat import metrics as vllm_metrics
    from vllm_kvevict.vllm_compat.patching import _lookup, is_wrapped, unwrap

    raw = _lookup(Scheduler, "__init__")
    assert list(inspect.signature(getattr(raw, "__wrapped__", raw)).parameters)[:2] == ["self", "vllm_config"]
    was = is_wrapped(Scheduler, "__init__")
    unwrap(Scheduler, "__init__")
    seen = []
    try:
        orig = Scheduler.__init__
        Scheduler.__init__ = lambda self, *a, **k: None  # type: ignore[method-assign]
        try:
            vllm_metrics.install_engine_index(seen.append)
            cfg = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=1))
            Scheduler(vllm_config=cfg)  # type: ignore[call-arg]
            Scheduler(cfg)  # type: ignore[call-arg]
        finally:
            unwrap(Scheduler, "__init__")
            Scheduler.__init__ = orig  # type: ignore[method-assign]
    finally:
        if was:
            vllm_metrics.install_engine_index(metrics.set_engine)
    assert seen == [1, 1]


def test_the_api_server_counts_every_refusal(monkeypatch):
    """plugin.check_request counts each 400 it raises by the key it names: a bad key before the
    prompt is processed (``invalid``), a request that could not fit the pool after (``too_large``);
    a request that passes is not counted."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_kvevict import plugin

    counted: list[tuple[str | None, str]] = []
    monkeypatch.setattr(metrics, "count_refused", lambda key, reason="invalid": counted.append((key, reason)))
    config = SimpleNamespace(
        attention_config=SimpleNamespace(backend=AttentionBackendEnum.CUSTOM),
        additional_config={"kvevict": {"policy": "keydiff", "budget": 96}},
        cache_config=SimpleNamespace(num_gpu_blocks=21, block_size=32),
        model_config=SimpleNamespace(max_model_len=4096, hf_text_config=SimpleNamespace()),
        parallel_config=SimpleNamespace(data_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=32),
        speculative_config=None,
        max_in_flight_tokens=32,
    )

    def params(**xargs):
        return SimpleNamespace(extra_args=xargs or None)

    with pytest.raises(plugin.RequestConfigError):
        plugin.check_request(config, params(kvevict_budget=0))
    with pytest.raises(plugin.RequestConfigError):
        plugin.check_request(config, params(kvevict_bugdet=96))
    then = plugin.check_request(config, params(kvevict_enabled=False))
    request = SimpleNamespace(prompt_token_ids=list(range(800)), sampling_params=SimpleNamespace(max_tokens=16))
    with pytest.raises(plugin.RequestConfigError):
        then(request)
    plugin.check_request(config, params())(request)  # evicts: fits
    assert counted == [("kvevict_budget", "invalid"), ("kvevict_bugdet", "invalid"), ("kvevict_enabled", "too_large")]
    assert [metrics.refused_key(k) for k, _ in counted] == ["budget", "other", "enabled"]
