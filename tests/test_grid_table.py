# SPDX-License-Identifier: Apache-2.0
"""scripts/grid_table.py: the shares in docs/policies.md's grid tables are of no eviction's score
on the same prompts, per task first, and the plot is drawn from the same cells."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("grid_table", ROOT / "scripts" / "grid_table.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["grid_table"] = mod  # dataclasses resolve annotations through the module
    spec.loader.exec_module(mod)
    return mod


def row(task, config, key, depth, seed, score, length=3000):
    return dict(task=task, length=length, config=config, budget_key=key, depth=depth, seed=seed, score=score)


def rows():
    out = []
    for seed in (1, 2):
        for depth in (0.0, 1.0):
            out.append(row("niah_single_varied", "none", "-", depth, seed, 1.0))
            out.append(row("niah_multikey", "none", "-", depth, seed, 0.5 if seed == 1 else 0.0))
            out.append(row("niah_single_varied", "keydiff", "0.1", depth, seed, 1.0 if depth == 1.0 else 0.0))
            out.append(row("niah_multikey", "keydiff", "0.1", depth, seed, 0.0))
    # a part measured on seed 1 only: its share is of the reference on seed 1's prompts
    for depth in (0.0, 1.0):
        out.append(row("niah_single_varied", "keydiff:recall=true", "0.1", depth, 1, 1.0))
        out.append(row("niah_multikey", "keydiff:recall=true", "0.1", depth, 1, 0.5))
    return out


def test_cells_and_shares():
    g = load()
    result = g.grid(rows(), [3000, 7500], ["0.1", "0.25"], ["keydiff", "keydiff:recall=true", "h2o"])
    assert list(result) == [3000]  # no reference at 7500
    none, cells = result[3000]
    assert none.score == (1.0 + 0.25) / 2 and none.n == [4, 4]
    assert "h2o" not in cells  # nothing measured
    kd = cells["keydiff"]["0.1"]
    assert kd.per_task == [0.5, 0.0] and kd.end == 0.5 and kd.rest == 0.0
    assert abs(kd.share - 0.25 / 0.625) < 1e-9
    assert cells["keydiff"]["0.25"] is None
    rc = cells["keydiff:recall=true"]["0.1"]
    assert rc.n == [2, 2] and abs(rc.share - 1.0) < 1e-9  # seed 1's reference is 1.0 / 0.5
    text = g.table(result, ["0.1", "0.25"])
    assert "| keydiff | 0.25 (0.50/0.00; 0.50 / 0.00), **40%** n=4/4 | - |" in text
    assert "**100%** n=2/2" in text


def test_cli_plot(tmp_path, capsys):
    g = load()
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    png = tmp_path / "grid.png"
    g.main([str(path), "--config", "keydiff", "--plot", str(png)])
    out = capsys.readouterr().out
    assert "| keydiff |" in out and "recall=true" not in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
