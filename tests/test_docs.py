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


def _labels(name: str) -> set[str]:
    """The labels the plugin exports ``name`` with (a sample name: ``_total``, ``_bucket``...)."""
    base = name.removeprefix(metrics.PREFIX)
    for suffix in ("_total", "_bucket", "_sum", "_count"):
        base = base.removesuffix(suffix)
    if base in metrics.COUNTERS:
        return {"policy", "rank"} if base == "fallbacks" else {"policy"}
    if base == metrics.HISTOGRAM[0]:
        return {"rank", "le"} if name.endswith("_bucket") else {"rank"}
    return set()


def _vllm_metrics() -> set[str]:
    import vllm.v1.metrics.loggers as loggers

    names = set(re.findall(r'name="(vllm:[a-z_]+)"', open(loggers.__file__).read()))
    return names | {n + "_total" for n in names}


AGGREGATIONS = ("sum", "max", "min", "avg", "histogram_quantile")


def test_the_metrics_table_matches_the_code_and_its_promql_returns_series():
    """Each row's labels are the ones exported; each PromQL example names only exported series
    (ours and vLLM's), groups only by labels they carry, and aggregates both sides of a division
    that mixes our series with vLLM's (theirs carry ``model_name`` and ``engine``, ours do not:
    without aggregation the division matches nothing)."""
    rows = re.findall(r"^\| `(kvevict:[a-z_]+)` \| (\w+) \|([^|]*)\| [^|]* \| `([^`]*)`", DOC, flags=re.M)
    assert len(rows) == len(metrics.COUNTERS) + len(metrics.GAUGES) + 1
    vllm_names = _vllm_metrics()
    for name, _kind, labels, promql in rows:
        assert {x.strip(" `") for x in labels.split(",") if x.strip()} == _labels(name) - {"le"}, name
        ours = re.findall(r"kvevict:[a-z_]+", promql)
        theirs = re.findall(r"vllm:[a-z_]+", promql)
        assert ours and set(ours) <= _exported(), promql
        assert set(theirs) <= vllm_names, promql
        for group in re.findall(r"by \(([^)]*)\)", promql):
            for label in (g.strip() for g in group.split(",")):
                assert all(label in _labels(n) for n in ours), (promql, label)
        if theirs and "/" in promql:
            for side in promql.split(" / "):
                assert side.strip().startswith(AGGREGATIONS), promql


def _check_promql(expr: str, where: str) -> None:
    """``expr`` names only exported series (ours and vLLM's), groups only by labels they carry, and
    aggregates both sides of a division that mixes our series with vLLM's."""
    ours = re.findall(r"kvevict:[a-z_]+", expr)
    theirs = re.findall(r"vllm:[a-z_]+", expr)
    assert ours or theirs, where
    assert set(ours) <= _exported(), (where, expr)
    assert set(theirs) <= _vllm_metrics(), (where, expr)
    for group in re.findall(r"by \(([^)]*)\)", expr):
        for label in (g.strip() for g in group.split(",")):
            assert all(label in _labels(n) for n in ours), (where, expr, label)
    if theirs and ours and "/" in expr:
        for side in expr.split(" / "):
            assert side.strip().startswith(AGGREGATIONS), (where, expr)


def test_the_dashboard_and_alert_rules_use_what_the_plugin_exports():
    """docker/grafana/kvevict-dashboard.json is a Grafana dashboard and docker/prometheus/
    kvevict-alerts.yaml Prometheus rules: valid JSON and YAML, every expression checked as the
    docs' PromQL, every legend's label carried by its series, and every panel and rule described
    in docs/operations.md."""
    import json

    import yaml

    dash = json.loads((ROOT / "docker" / "grafana" / "kvevict-dashboard.json").read_text())
    assert dash["uid"] and dash["panels"]
    section = DOC.split("## Dashboard and alerts", 1)[1].split("\n## ", 1)[0]
    for panel in dash["panels"]:
        assert f"**{panel['title']}**" in section, panel["title"]
        for t in panel["targets"]:
            _check_promql(t["expr"], panel["title"])
            for label in re.findall(r"\{\{(\w+)\}\}", t["legendFormat"]):
                assert all(label in _labels(n) for n in re.findall(r"kvevict:[a-z_]+", t["expr"])), t
    rules = yaml.safe_load((ROOT / "docker" / "prometheus" / "kvevict-alerts.yaml").read_text())
    names = []
    for group in rules["groups"]:
        for rule in group["rules"]:
            names.append(rule["alert"])
            _check_promql(rule["expr"], rule["alert"])
            assert rule["labels"]["severity"] in ("info", "warning", "critical")
            for label in re.findall(r"\$labels\.(\w+)", json.dumps(rule["annotations"])):
                assert f"by ({label}" in rule["expr"] or f", {label})" in rule["expr"], (rule["alert"], label)
            assert f"`{rule['alert']}`" in section, rule["alert"]
    assert len(names) == len(set(names)) >= 3
