# SPDX-License-Identifier: Apache-2.0
"""Monitoring for a fleet (docker/grafana/, docker/prometheus/, the compose profile `monitoring`):
the dashboard is templated on its data source, model and instance and filters every query by them,
keeps ratios and rates apart, and names only exported series; every alert rule is per instance and
model, names only exported series, and has a runbook in docs/operations.md; the rules pass
``promtool check rules`` and their unit tests (``promtool test rules``) when promtool is installed;
the compose profile wires Prometheus and Grafana to these files. Against a live server:
tests/docker/test_monitoring_stack.py."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from vllm_kvevict import metrics

DOCKER = ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "kvevict-dashboard.json"
RULES = DOCKER / "prometheus" / "kvevict-alerts.yaml"
RULE_TESTS = DOCKER / "prometheus" / "kvevict-alerts.test.yaml"
PROMETHEUS_CONFIG = DOCKER / "prometheus" / "prometheus.yml"
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
#: the filter every metric selector of the dashboard carries
FILTER = 'model_name="$model_name", instance=~"$instance"'
METRIC = re.compile(r"\b((?:kvevict|vllm):[a-z_]+)(\{[^}]*\})?")


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


@functools.cache
def _vllm_metrics() -> set[str]:
    """The ``vllm:*`` names vLLM's Prometheus logger registers (read from its source: no import)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    loggers = Path(spec.submodule_search_locations[0]) / "v1" / "metrics" / "loggers.py"
    names = set(re.findall(r'name="(vllm:[a-z_]+)"', loggers.read_text()))
    assert "vllm:request_success" in names and "vllm:inter_token_latency_seconds" in names
    return {n + s for n in names for s in ("", "_total", "_bucket", "_sum", "_count")}


def _exists(name: str) -> bool:
    return bool(metrics.labels(name)) if name.startswith(metrics.PREFIX) else name in _vllm_metrics()


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    heading = re.sub(r"`|\*\*?", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _anchors(text: str) -> dict[str, str]:
    """anchor -> the section under that heading (to the next heading of any level)."""
    parts = re.split(r"^(#{1,6} .+)$", text, flags=re.M)
    return {_slug(parts[i].lstrip("#")): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


# -- the dashboard --------------------------------------------------------------------------------


def test_the_dashboard_is_templated_on_data_source_model_and_instance():
    """vLLM's convention (examples/online_serving/prometheus_grafana): a data source variable
    ``DS_PROMETHEUS`` every panel and query uses, a ``model_name`` variable from the series'
    label; here also ``instance`` (several, All by default) for a fleet."""
    dash = _dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ds = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    for name in ("model_name", "instance"):
        var = variables[name]
        assert var["type"] == "query" and var["datasource"] == ds, name
        query = var["query"]["query"]
        assert query == var["definition"] and query.startswith("label_values(") and query.endswith(f", {name})")
        (metric,) = re.findall(r"kvevict:[a-z_]+", query)
        assert name in metrics.labels(metric) or name == "instance", query  # instance: the target's
    assert variables["model_name"]["multi"] is False  # one model: rates of two models never add up
    assert variables["instance"]["multi"] is True and variables["instance"]["includeAll"] is True
    assert variables["instance"]["allValue"] == ".*"
    assert '{model_name="$model_name"}' in variables["instance"]["query"]["query"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for panel in dash["panels"]:
        assert panel["datasource"] == ds, panel["title"]
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            assert t["datasource"] == ds, panel["title"]


def test_every_query_is_filtered_by_model_and_instance_and_names_exported_series():
    for panel in _dashboard()["panels"]:
        for t in panel["targets"]:
            selectors = METRIC.findall(t["expr"])
            assert selectors, (panel["title"], t["expr"])
            for name, matchers in selectors:
                assert _exists(name), (panel["title"], name)
                assert matchers == "{" + FILTER + "}", (panel["title"], name, matchers)
            for window in re.findall(r"\[([^\]]+)\]", t["expr"]):
                assert window in ("$__rate_interval", "1h"), (panel["title"], window)


def _is_ratio(expr: str) -> bool:
    """A ratio: a division, or seconds per second (the eviction time's rate), or vLLM's usage."""
    return " / " in expr or "rate(kvevict:eviction_seconds_sum" in expr or "vllm:kv_cache_usage_perc" in expr


def test_ratios_and_rates_are_on_separate_panels():
    """A 0-1 ratio and a rate never share an axis: each panel's targets are all ratios or none,
    and a panel in percent shows only ratios (0-1 ones with a max of 1)."""
    for panel in _dashboard()["panels"]:
        kinds = {_is_ratio(t["expr"]) for t in panel["targets"]}
        assert len(kinds) == 1, panel["title"]
        unit = panel["fieldConfig"]["defaults"]["unit"]
        if unit == "percentunit":
            assert kinds == {True}, panel["title"]
        elif kinds == {True}:
            assert "per compaction" in panel["title"], (panel["title"], unit)  # blocks, not a fraction
        if panel["fieldConfig"]["defaults"].get("max") == 1:
            assert unit == "percentunit", panel["title"]


def test_every_panel_is_described_in_operations_md():
    section = OPERATIONS.split("## Dashboard and alerts", 1)[1].split("\n## ", 1)[0]
    for panel in _dashboard()["panels"]:
        assert f"**{panel['title']}**" in section, panel["title"]


# -- the alert rules ------------------------------------------------------------------------------


def test_every_alert_is_per_instance_and_model():
    """Each grouping keeps ``instance`` and ``model_name`` (no fleet-wide sum), each alert fires
    with both labels, and thresholds are ratios (a comparison with a number at most 1, or 1 for
    bounds), never a count of seconds."""
    rules = _rules()
    assert len(rules) >= 6 and len({r["alert"] for r in rules}) == len(rules)
    for rule in rules:
        expr = " ".join(rule["expr"].split())
        groups = re.findall(r"\b(sum|max|min|avg|count)\b\s*(?:by \(([^)]*)\))?\s*\(", expr)
        assert groups, rule["alert"]
        for fn, by in groups:
            labels = {x.strip() for x in by.split(",")}
            assert {"instance", "model_name"} <= labels, (rule["alert"], fn, by)
        for on in re.findall(r"\bon \(([^)]*)\)", expr):
            assert {x.strip() for x in on.split(",")} == {"instance", "model_name"}, rule["alert"]
        thresholds = [float(x) for x in re.findall(r"> (\d+(?:\.\d+)?)(?![\w\[])", expr)]
        assert thresholds and all(0 <= x <= 1 for x in thresholds), (rule["alert"], thresholds)
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        for label in re.findall(r"\$labels\.(\w+)", json.dumps(rule["annotations"])):
            assert any(label in {x.strip() for x in by.split(",")} for _, by in groups), (rule["alert"], label)


def test_every_alert_names_exported_series():
    for rule in _rules():
        names = {name for name, _ in METRIC.findall(rule["expr"])}
        assert any(n.startswith(metrics.PREFIX) for n in names), rule["alert"]
        for name in names:
            assert _exists(name), (rule["alert"], name)


def test_every_alert_has_a_runbook_in_operations_md():
    """``runbook_url`` is ``docs/operations.md#<anchor>``; the anchor is a heading of that file
    whose section says what the alert means, what to check and what to do."""
    anchors = _anchors(OPERATIONS)
    section = OPERATIONS.split("## Dashboard and alerts", 1)[1].split("\n## ", 1)[0]
    for rule in _rules():
        url = rule["annotations"]["runbook_url"]
        path, _, anchor = url.partition("#")
        assert path == "docs/operations.md" and (ROOT / path).is_file(), url
        assert anchor in anchors, (rule["alert"], anchor)
        assert anchor == _slug(rule["alert"])
        for part in ("**What it means.**", "**What to check.**", "**What to do.**"):
            assert part in anchors[anchor], (rule["alert"], part)
        assert f"`{rule['alert']}`" in section, rule["alert"]  # in the alerts table
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def _promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    return exe


def test_promtool_checks_the_rules_and_the_prometheus_config():
    exe = _promtool()
    out = subprocess.run([exe, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and f"SUCCESS: {len(_rules())} rules found" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([exe, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_unit_tests_of_the_rules():
    """docker/prometheus/kvevict-alerts.test.yaml: each alert fires for the instance past its
    threshold, with its labels and rendered annotations, and not for the one short of it."""
    exe = _promtool()
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert tested == {r["alert"] for r in _rules()}
    out = subprocess.run(
        [exe, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


# -- the compose profile --------------------------------------------------------------------------


def _compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _mounts(service: dict) -> dict[str, str]:
    """target -> source (relative to docker/) of a service's bind mounts."""
    return {v["target"]: v["source"] for v in service["volumes"] if isinstance(v, dict) and v["type"] == "bind"}


def test_the_monitoring_profile_wires_prometheus_and_grafana_to_these_files():
    compose = _compose()
    services = compose["services"]
    prom, grafana = services["prometheus"], services["grafana"]
    for svc, image in ((prom, "prom/prometheus"), (grafana, "grafana/grafana")):
        assert svc["profiles"] == ["monitoring"]
        name, _, tag = svc["image"].partition(":")
        assert name == image and re.fullmatch(r"v?\d+\.\d+\.\d+", tag), svc["image"]  # pinned, not latest
    # Prometheus: the config and the rules side by side in /etc/prometheus (rule_files is relative)
    mounts = _mounts(prom)
    assert (DOCKER / mounts["/etc/prometheus/prometheus.yml"]).resolve() == PROMETHEUS_CONFIG
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    for rule_file in config["rule_files"]:
        assert (DOCKER / mounts["/etc/prometheus/" + rule_file]).resolve() == RULES
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    # ... scraping the kvevict services by their network alias
    (job,) = config["scrape_configs"]
    (static,) = job["static_configs"]
    (target,) = static["targets"]
    host, port = target.split(":")
    for name in ("kvevict-cpu", "kvevict-cuda"):
        assert host in services[name]["networks"]["default"]["aliases"], name
        assert any(p.endswith(":" + port) for p in services[name]["ports"])
    # Grafana: the data source is that Prometheus, the dashboard provider reads the mounted dashboard
    mounts = _mounts(grafana)
    provisioning = (DOCKER / mounts["/etc/grafana/provisioning"]).resolve()
    assert provisioning == DOCKER / "grafana" / "provisioning"
    (ds,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090" and ds["isDefault"] is True
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "kvevict.yaml").read_text())["providers"]
    dashboards = [t for t in mounts if t.startswith(provider["options"]["path"] + "/")]
    assert [(DOCKER / mounts[t]).resolve() for t in dashboards] == [DASHBOARD]
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] in dashboards
    assert "prometheus" in grafana["depends_on"]
    # the default `docker compose up` still starts the server alone
    assert "profiles" not in services["kvevict-cpu"]
    assert set(compose["volumes"]) == {"prometheus-data", "grafana-data"}
