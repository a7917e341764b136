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
    names = {metrics.PREFIX + n + "_total" for n in [*metrics.COUNTERS, metrics.REFUSED[0]]}
    names |= {metrics.PREFIX + n for n in metrics.GAUGES}
    h = metrics.PREFIX + metrics.HISTOGRAM[0]
    return names | {h} | {h + s for s in ("_bucket", "_sum", "_count")}


def test_every_metric_named_exists_and_is_described():
    named = set(re.findall(r"(?<![\w-])kvevict:[a-z_]+\b", DOC))  # not an image tag (vllm-kvevict:cpu)
    assert named, "operations.md names no metric"
    assert named <= _exported(), f"not exported: {sorted(named - _exported())}"
    table = {m for m in re.findall(r"^\| `(kvevict:[a-z_]+)`", DOC, flags=re.M)}
    base = {metrics.PREFIX + n + "_total" for n in [*metrics.COUNTERS, metrics.REFUSED[0]]}
    base |= {metrics.PREFIX + n for n in metrics.GAUGES}
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


#: the labels Prometheus adds to every series it scrapes (the target's)
TARGET_LABELS = {"instance", "job"}


def _labels(name: str) -> set[str]:
    """The labels the plugin exports ``name`` with (a sample name: ``_total``, ``_bucket``...)."""
    return set(metrics.labels(name))


def _vllm_metrics() -> set[str]:
    import vllm.v1.metrics.loggers as loggers

    names = set(re.findall(r'name="(vllm:[a-z_]+)"', open(loggers.__file__).read()))
    return names | {n + s for n in names for s in ("_total", "_bucket", "_sum", "_count")}


AGGREGATIONS = ("sum", "max", "min", "avg", "histogram_quantile")


def test_the_metrics_table_matches_the_code_and_its_promql_returns_series():
    """Each row's labels are the ones exported; each PromQL example names only exported series
    (ours and vLLM's), groups only by labels they carry, and aggregates both sides of a division
    that mixes our series with vLLM's (theirs carry ``model_name`` and ``engine``, ours do not:
    without aggregation the division matches nothing)."""
    rows = re.findall(r"^\| `(kvevict:[a-z_]+)` \| (\w+) \|([^|]*)\| [^|]* \| `([^`]*)`", DOC, flags=re.M)
    assert len(rows) == len(metrics.COUNTERS) + len(metrics.GAUGES) + 2
    vllm_names = _vllm_metrics()
    for name, _kind, labels, promql in rows:
        assert {x.strip(" `") for x in labels.split(",") if x.strip()} == _labels(name) - {"le"}, name
        ours = re.findall(r"kvevict:[a-z_]+", promql)
        theirs = re.findall(r"vllm:[a-z_]+", promql)
        assert ours and set(ours) <= _exported(), promql
        assert set(theirs) <= vllm_names, promql
        for group in re.findall(r"by \(([^)]*)\)", promql):
            for label in (g.strip() for g in group.split(",")):
                assert label in TARGET_LABELS or all(label in _labels(n) for n in ours), (promql, label)
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
    for group in re.findall(r"(?:by|on) \(([^)]*)\)", expr):
        for label in (g.strip() for g in group.split(",")):
            assert label in TARGET_LABELS or all(label in _labels(n) for n in ours), (where, expr, label)
    if theirs and ours and "/" in expr:
        for side in re.split(r"\s/\s", expr):
            # a vector matching (on (...) group_left ...) first, then the aggregation, perhaps bracketed
            side = re.sub(r"^\s*on \([^)]*\)\s*(group_left\s*(\([^)]*\))?)?", "", side).lstrip(" (\n")
            assert side.startswith(AGGREGATIONS), (where, expr)


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
                ours = re.findall(r"kvevict:[a-z_]+", t["expr"])
                assert label in TARGET_LABELS or all(label in _labels(n) for n in ours), t
    rules = yaml.safe_load((ROOT / "docker" / "prometheus" / "kvevict-alerts.yaml").read_text())
    names = []
    for group in rules["groups"]:
        for rule in group["rules"]:
            names.append(rule["alert"])
            _check_promql(rule["expr"], rule["alert"])
            assert rule["labels"]["severity"] in ("info", "warning", "critical")
            for label in re.findall(r"\$labels\.(\w+)", json.dumps(rule["annotations"])):
                groups = [{g.strip() for g in grp.split(",")} for grp in re.findall(r"by \(([^)]*)\)", rule["expr"])]
                assert any(label in g for g in groups), (rule["alert"], label)
            assert f"`{rule['alert']}`" in section, rule["alert"]
    assert len(names) == len(set(names)) >= 3


# The user docs are reference, not a work log: no issue, session or round numbers, no dated runs,
# no commit hashes (docs/history/ keeps those).
WORK_LOG = re.compile(r"[Ii]ssue [0-9]|[Ss]ession [0-9]|round [0-9]")
DATE = re.compile(r"\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
USER_DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_readme_and_docs_name_no_issue_session_or_round():
    hits = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()[:80]}"
        for path in [ROOT / "README.md", *USER_DOCS]
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if WORK_LOG.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_docs_carry_no_dates_or_commit_hashes():
    hits = [
        f"{path.relative_to(ROOT)}:{i}: {m.group(0)}"
        for path in USER_DOCS
        for i, line in enumerate(path.read_text().splitlines(), 1)
        for m in [*DATE.finditer(line), *COMMIT.finditer(line)]
    ]
    assert not hits, "\n".join(hits)


def test_the_policy_object_cap_in_operations_md_is_the_code_s():
    from vllm_kvevict import request

    rows = [line for line in DOC.splitlines() if line.startswith("| policy objects |")]
    assert len(rows) == 1, rows
    stated = re.findall(r"(\d+) per (\w+)", rows[0])
    assert stated == [(str(request._policy_object.cache_parameters()["maxsize"]), "process")], rows[0]


def _section(text: str, heading: str) -> str:
    return text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def _parameters() -> dict[str, set[str]]:
    """Every policy that has parameters -> their names (the top-level keys of its object)."""
    from vllm_kvevict.policies import POLICIES

    out = {name: set(cls.Params.model_fields) for name, cls in POLICIES.items() if getattr(cls, "Params", None)}
    return {name: fields for name, fields in out.items() if fields}


def test_configuration_md_lists_each_policy_s_parameters():
    """The bounds table's rows name parameters with the policies they belong to in brackets
    (`` `a`, `b` (p, q)``): per policy, exactly the fields of its ``Params``. The fields table's
    ``<policy>`` row names exactly the policies with parameters, and the line after it the others."""
    from vllm_kvevict.policies import POLICIES

    text = (ROOT / "docs" / "configuration.md").read_text()
    documented: dict[str, set[str]] = {}
    for row in re.findall(r"^\| (`[^|]*\)) \|", _section(text, "## Bounds"), flags=re.M):
        for names, owners in re.findall(r"((?:`\w+`(?:, )?)+) \(([a-z0-9, ]+)\)", row):
            for owner in (o.strip() for o in owners.split(",")):
                if owner in POLICIES:
                    documented.setdefault(owner, set()).update(re.findall(r"`(\w+)`", names))
    assert documented == _parameters()
    fields_row = next(line for line in text.splitlines() if line.startswith("| `<policy>` |"))
    listed = set(re.findall(r"`(\w+)`", fields_row.split("named after it:", 1)[1].split(";", 1)[0]))
    assert listed == set(_parameters())
    without = re.search(r"^(.*) have no parameters\.$", text, flags=re.M)
    assert without and set(re.findall(r"`(\w+)`", without.group(1))) == set(POLICIES) - set(_parameters())


def test_policies_md_parameter_table_is_each_policy_s_parameters():
    text = (ROOT / "docs" / "policies.md").read_text()
    names = r"((?:`\w+`(?:, )?)+)"
    documented: dict[str, set[str]] = {}
    for policies, params in re.findall(rf"^\| {names} \| {names} \|", _section(text, "## Parameters"), flags=re.M):
        for policy in re.findall(r"`(\w+)`", policies):
            documented.setdefault(policy, set()).update(re.findall(r"`(\w+)`", params))
    assert documented == _parameters()


def test_every_exported_metric_is_named_in_metrics_docstring_and_operations_md():
    base = {metrics.PREFIX + n + "_total" for n in [*metrics.COUNTERS, metrics.REFUSED[0]]}
    base |= {metrics.PREFIX + n for n in metrics.GAUGES}
    base.add(metrics.PREFIX + metrics.HISTOGRAM[0])
    for where, text in (("vllm_kvevict/metrics.py's docstring", metrics.__doc__ or ""), ("docs/operations.md", DOC)):
        named = set(re.findall(r"(?<![\w-])kvevict:[a-z_]+\b", text))
        assert base <= named, f"{where} omits {sorted(base - named)}"
        assert named <= _exported(), f"{where} names what is not exported: {sorted(named - _exported())}"


def _seconds(value: str) -> int:
    """``30s``, ``10m``, ``1m30s``, ``600 s`` -> seconds."""
    parts = re.findall(r"(\d+)\s*([hms])", value)
    assert parts and "".join(n + u for n, u in parts) == re.sub(r"\s+", "", value), value
    return sum(int(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def test_docker_md_health_checks_are_the_images_and_compose_s():
    """docs/docker.md's health-check table has one row per image and per compose service, with the
    interval, timeout, retries and start period their Dockerfile or docker/compose.yaml sets."""
    import yaml

    text = (ROOT / "docs" / "docker.md").read_text()
    row = r"^\| ([^|]+) \| ([^|]+) \| ([^|]+) \| (\d+) \| ([^|]+) \|$"
    rows = re.findall(row, _section(text, "## The health check"), flags=re.M)
    documented = {where.strip(): (_seconds(i), _seconds(t), int(r), _seconds(s)) for where, i, t, r, s in rows}
    expected = {}
    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        healthcheck = re.search(r"^HEALTHCHECK (.*)$", (ROOT / "docker" / dockerfile).read_text(), flags=re.M)
        assert healthcheck, dockerfile
        flags = dict(re.findall(r"--([a-z-]+)=(\S+)", healthcheck.group(1)))
        name = "CUDA" if dockerfile == "Dockerfile" else "CPU"
        expected[f"{name} image (`docker/{dockerfile}`)"] = (
            _seconds(flags["interval"]),
            _seconds(flags["timeout"]),
            int(flags["retries"]),
            _seconds(flags["start-period"]),
        )
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    for service, spec in compose["services"].items():
        if spec.get("profiles") == ["monitoring"]:  # Prometheus and Grafana: their images' own
            continue
        hc = spec["healthcheck"]
        expected[f"`docker/compose.yaml`, `{service}`"] = (
            _seconds(hc["interval"]),
            _seconds(hc["timeout"]),
            int(hc["retries"]),
            _seconds(hc["start_period"]),
        )
    assert documented == expected


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"`|\*\*?|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _anchors(path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = _slug(heading)
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_docs_link_points_at_an_existing_file_and_anchor():
    broken = []
    for path in [ROOT / "README.md", *USER_DOCS, *sorted((ROOT / "docs" / "history").glob("*.md"))]:
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file = (path.parent / target).resolve() if target else path
            if not file.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{path.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, "\n".join(broken)
