# SPDX-License-Identifier: Apache-2.0
"""docs/operations.md says only what the code does: every metric it names is one the plugin
exports, every metric the plugin exports is described there, and every ``kvevict: ...`` log line it
quotes is one the code writes (its fixed text, between the placeholders)."""

from __future__ import annotations

import ast
import re

from tests.conftest import ROOT
from vllm_kvevict import metrics

DOC = (ROOT / "docs" / "operations.md").read_text()


def _exported() -> set[str]:
    names = {metrics.PREFIX + n + "_total" for n in metrics.COUNTERS}
    names |= {metrics.PREFIX + n for n in metrics.GAUGES}
    h = metrics.PREFIX + metrics.HISTOGRAM[0]
    return names | {h} | {h + s for s in ("_bucket", "_sum", "_count")}


def test_every_metric_named_exists_and_is_described():
    named = set(re.findall(r"(?<![\w-])kvevict:[a-z_]+\b", DOC))  # not an image tag (vllm-kvevict:cpu)
    assert named, "operations.md names no metric"
    assert named <= _exported(), f"not exported: {sorted(named - _exported())}"
    table = {m for m in re.findall(r"^\| `(kvevict:[a-z_]+)`", DOC, flags=re.M)}
    base = {metrics.PREFIX + n + "_total" for n in metrics.COUNTERS} | {metrics.PREFIX + n for n in metrics.GAUGES}
    base.add(metrics.PREFIX + metrics.HISTOGRAM[0])
    assert base <= table, f"not in the metrics table: {sorted(base - table)}"


def _literals() -> list[str]:
    out = []
    for path in (ROOT / "vllm_kvevict").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
    return out


def _fragments(line: str) -> list[str]:
    """The fixed text of a quoted line: what is left between ``<placeholders>``, ``...`` and the
    values a format string fills in (``%s``, ``{...}``)."""
    parts = re.split(r"<[^>]*>|\.\.\.|\([^)]*\)", line)
    return [p.strip(" ;,:") for p in parts if len(p.strip(" ;,:")) >= 6]


def test_every_quoted_log_line_is_written_by_the_code():
    quoted = {re.sub(r"\s+", " ", q) for q in re.findall(r"`(kvevict: [^`]+)`", DOC)}
    quoted |= {m.strip() for m in re.findall(r"^    (kvevict: .+)$", DOC, flags=re.M)}
    assert len(quoted) >= 8
    text = "\n".join(_literals())
    flat = re.sub(r"%[sdr]|\{[^}]*\}", "\x00", text)  # format fields never match doc text
    missing = []
    for line in sorted(quoted):
        for frag in _fragments(line):
            if frag not in text and frag not in flat.replace("\x00", ""):
                missing.append((line[:60], frag))
    assert not missing, missing
