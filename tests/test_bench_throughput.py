# SPDX-License-Identifier: Apache-2.0
"""kvevict-bench throughput's plot, on a measured report (docs/img/throughput_recall_b0.1.json)."""

import json
from pathlib import Path

from vllm_kvevict.bench.throughput import plot, plot_series

REPORT = Path(__file__).parent.parent / "docs" / "img" / "throughput_recall_b0.1.json"


def test_recall_servers_are_their_own_series(tmp_path):
    report = json.loads(REPORT.read_text())
    assert set(report["results"]) == {"stock", "kvevict-0.1", "kvevict-0.1+recall"}
    series = plot_series(report)
    assert list(series) == ["kvevict (keydiff)", "kvevict (keydiff), recall"]
    assert series["kvevict (keydiff)"] == [report["results"]["kvevict-0.1"]]
    assert series["kvevict (keydiff), recall"] == [report["results"]["kvevict-0.1+recall"]]
    # without recall servers, one series
    del report["results"]["kvevict-0.1+recall"]
    assert list(plot_series(report)) == ["kvevict (keydiff)"]
    plot(report, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 10_000
