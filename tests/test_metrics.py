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


def _scrape(directory: str) -> dict:
    registry = CollectorRegistry()
    registry.register(metrics.Collector(directory))
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
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
