"""The Prometheus Operator component (deploy/daemonset/components/monitoring): what it renders, that
it scrapes the agents, that the alerts fire when they should (promtool), and that every metric an
alert or a dashboard panel uses is one the agent really exports and docs/metrics.md documents.

promtool comes from Debian's ``prometheus`` package (``apt-get install prometheus``); on a fresh
machine ``make test`` (``.ci/promtool``) unpacks the package's promtool into .venv/bin. Without
it the promtool tests skip, saying so."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.k8sschema import validate as validate_k8s

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "daemonset"
COMPONENT = BASE / "components" / "monitoring"
POD_MONITOR = COMPONENT / "pod-monitor"
BUDGETS_MONITOR = COMPONENT / "budgets"
RULES = COMPONENT / "prometheusrule.yaml"
DASHBOARD = COMPONENT / "tessera-dashboard.json"
UNIT_TESTS = Path(__file__).with_name("prometheusrule_test.yaml")
CRD_SCHEMAS = Path(__file__).with_name("schemas") / "monitoring.coreos.com-v1.json"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
METRICS_DOC = ROOT / "docs" / "metrics.md"
RUNBOOK_URL = "https://github.com/tessera-gpu/tessera/blob/main/docs/runbooks.md#"
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}

# Labels the Prometheus Operator puts on every target of a ServiceMonitor (namespace, service,
# pod, container, endpoint, job; a PodMonitor: the same but service), plus Prometheus's own
# `instance` and the `node` our relabeling adds: prometheus-operator v0.93.0
# pkg/prometheus/promcfg.go, generateServiceMonitorConfig and generatePodMonitorConfig.
TARGET_LABELS = {"job", "instance", "namespace", "service", "pod", "container", "endpoint", "node"}
# Metrics that are not the agent's: Prometheus's own per-target series.
PROMETHEUS_METRICS = {"up"}


def promtool() -> str:
    """promtool on PATH, else the one `make test` (.ci/promtool) unpacks into the venv."""
    path = shutil.which("promtool") or shutil.which("promtool", path=str(ROOT / ".venv" / "bin"))
    if path is None:
        pytest.skip(
            "promtool not found: install Debian's 'prometheus' package (apt-get install"
            " prometheus gives /usr/bin/promtool), or run make test, which unpacks its promtool"
            " into .venv/bin"
        )
    return path


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl not found: `kubectl kustomize` renders the overlays")
    return path


def render(tmp_path: Path, *components: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of an overlay made of the base plus ``components``, as a user's
    overlay would be (paths relative to it)."""
    overlay = tmp_path / "overlay"
    overlay.mkdir(exist_ok=True)
    rel = [os.path.relpath(p, overlay) for p in (BASE, *components)]
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": rel[:1],
                "components": rel[1:],
            }
        )
    )
    out = subprocess.run(
        [kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def kinds(objs: list[dict[str, Any]]) -> list[str]:
    return sorted(o["kind"] for o in objs)


@pytest.fixture(scope="module")
def base_objs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return render(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def with_service_monitor(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return render(tmp_path_factory.mktemp("sm"), COMPONENT)


@pytest.fixture(scope="module")
def with_pod_monitor(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return render(tmp_path_factory.mktemp("pm"), COMPONENT, POD_MONITOR)


def rule_spec() -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load(RULES.read_text())["spec"]
    return spec


def alerts() -> list[dict[str, Any]]:
    return [r for g in rule_spec()["groups"] for r in g["rules"] if "alert" in r]


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])


def dashboard_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable (the metric selector
    inside ``label_values(...)``)."""
    out = []
    for p in panels(dash):
        for t in p.get("targets", []):
            out.append((f"panel {p['id']} {p['title']!r} {t['refId']}", t["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q)
            assert m, f"variable {v['name']}: {q!r} is not label_values(<selector>, <label>)"
            out.append((f"variable {v['name']}", f"count by ({m.group(2)}) ({m.group(1)})"))
    return out


# --- What the component renders -------------------------------------------------------------


def test_the_component_adds_one_scrape_object_the_alerts_and_the_dashboard(
    base_objs, with_service_monitor, with_pod_monitor
):
    def added(objs: list[dict[str, Any]]) -> list[str]:
        assert all(o in objs for o in base_objs), "the base must be left as it is"
        return kinds([o for o in objs if o not in base_objs])

    assert added(with_service_monitor) == ["ConfigMap", "PrometheusRule", "ServiceMonitor"]
    # the pod-monitor component replaces the ServiceMonitor: the agents are scraped once
    assert added(with_pod_monitor) == ["ConfigMap", "PodMonitor", "PrometheusRule"]


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, "only matchLabels is checked here"
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def _job_and_node(endpoint: dict[str, Any], job_label: str, labels: dict[str, str]) -> None:
    """The target's job is "tessera" (what the alerts and the dashboard select), and `node` is
    set from the pod's node on every series."""
    assert labels.get(job_label) == "tessera"
    assert {
        "sourceLabels": ["__meta_kubernetes_pod_node_name"],
        "targetLabel": "node",
        "action": "replace",
    } in endpoint["relabelings"]
    # the claim series' own `namespace` must survive the target's (tessera-system)
    assert endpoint["honorLabels"] is True


def test_the_service_monitor_scrapes_the_agents_through_the_base_service(with_service_monitor):
    sm = one(with_service_monitor, "ServiceMonitor")
    svc = one(with_service_monitor, "Service")
    ds = one(with_service_monitor, "DaemonSet")
    pod = ds["spec"]["template"]
    # no namespaceSelector: the ServiceMonitor's own namespace, which is the Service's
    assert "namespaceSelector" not in sm["spec"]
    assert sm["metadata"]["namespace"] == svc["metadata"]["namespace"]
    assert _matches(sm["spec"]["selector"], svc["metadata"]["labels"])
    assert all(v == pod["metadata"]["labels"].get(k) for k, v in svc["spec"]["selector"].items())
    [ep] = sm["spec"]["endpoints"]
    [port] = [p for p in svc["spec"]["ports"] if p["name"] == ep["port"]]
    container_ports = {
        p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]
    }
    assert container_ports[port["targetPort"]] == port["port"] == 9400
    assert ep["path"] == "/metrics"
    _job_and_node(ep, sm["spec"]["jobLabel"], svc["metadata"]["labels"])


def test_the_pod_monitor_scrapes_the_agent_pods(with_pod_monitor):
    pm = one(with_pod_monitor, "PodMonitor")
    ds = one(with_pod_monitor, "DaemonSet")
    pod = ds["spec"]["template"]
    assert "namespaceSelector" not in pm["spec"]
    assert pm["metadata"]["namespace"] == ds["metadata"]["namespace"]
    assert _matches(pm["spec"]["selector"], pod["metadata"]["labels"])
    [ep] = pm["spec"]["podMetricsEndpoints"]
    names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert ep["port"] in names
    assert ep["path"] == "/metrics"
    _job_and_node(ep, pm["spec"]["jobLabel"], pod["metadata"]["labels"])


def test_the_budgets_pod_monitor_scrapes_the_controller_as_its_alerts_expect(tmp_path, crd_schemas):
    objs = render(tmp_path, COMPONENT, BUDGETS_MONITOR)
    [pm] = [o for o in objs if o["kind"] == "PodMonitor"]  # the agents' ServiceMonitor stays
    assert one(objs, "ServiceMonitor")["metadata"]["name"] == "tessera"
    jsonschema.validate(pm, crd_schemas["PodMonitor"])
    deployment = yaml.safe_load_all((BASE / "budgets" / "controller.yaml").read_text())
    pod = next(d for d in deployment if d["kind"] == "Deployment")["spec"]["template"]
    assert pm["metadata"]["namespace"] == "tessera-system"
    assert _matches(pm["spec"]["selector"], pod["metadata"]["labels"])
    # job="tessera-budgets": the pod's label named by jobLabel
    assert pod["metadata"]["labels"][pm["spec"]["jobLabel"]] == "tessera-budgets"
    [ep] = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] in {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
    group = next(g for g in rule_spec()["groups"] if g["name"] == "tessera-budgets")
    assert {r["alert"] for r in group["rules"]} == {
        "TesseraBudgetNearlyExhausted", "TesseraBudgetExhausted", "TesseraBudgetControllerDown",
        "TesseraUsageNotFolded",
    }  # fmt: skip


def _strict(schema: Any) -> Any:
    """The CRD's schema with unknown fields refused, as `kubectl apply` with strict field
    validation does (the API server would otherwise drop a misspelt field silently)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if isinstance(out.get("pattern"), str) and out["pattern"].startswith("^(?i)"):
            # Go's RE2 takes a flag group anywhere; Python's re only at the start
            out["pattern"] = "(?i)^" + out["pattern"][len("^(?i)") :]
        if (
            out.get("type") == "object"
            and "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def crd_schemas() -> dict[str, Any]:
    """The v1 schemas of prometheus-operator v0.93.0's CRDs (descriptions removed; the file says
    where it comes from)."""
    data = json.loads(CRD_SCHEMAS.read_text())
    schemas = {kind: _strict(s) for kind, s in data["schemas"].items()}
    for schema in schemas.values():
        jsonschema.Draft202012Validator.check_schema(schema)
    return schemas


def test_the_monitoring_objects_validate_against_the_operators_crds(
    crd_schemas, with_service_monitor, with_pod_monitor
):
    seen = set()
    for obj in with_service_monitor + with_pod_monitor:
        if obj["kind"] in MONITORING_KINDS:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            jsonschema.validate(obj, crd_schemas[obj["kind"]])
            seen.add(obj["kind"])
    assert seen == MONITORING_KINDS
    # a misspelt field is refused, not dropped
    sm = copy.deepcopy(one(with_service_monitor, "ServiceMonitor"))
    sm["spec"]["endpoints"][0]["honorlabels"] = True
    with pytest.raises(jsonschema.ValidationError, match="honorlabels"):
        jsonschema.validate(sm, crd_schemas["ServiceMonitor"])


@pytest.mark.parametrize("version", ["1.34.0", "1.35.0"])
def test_the_dashboard_configmap_is_what_grafanas_sidecar_loads(with_service_monitor, version):
    cm = one(with_service_monitor, "ConfigMap")
    validate_k8s(cm, version)
    assert cm["metadata"]["name"] == "tessera-dashboard"  # no hash suffix: one per dashboard
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"] == {DASHBOARD.name: DASHBOARD.read_text()}


# --- The alerts -----------------------------------------------------------------------------


def write_rules(path: Path, spec: dict[str, Any]) -> Path:
    """The PrometheusRule's spec is a Prometheus rule file (groups)."""
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_promtool_checks_the_rules(tmp_path):
    rules = write_rules(tmp_path / "rules.yaml", rule_spec())
    out = subprocess.run(
        [promtool(), "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in rule_spec()['groups'])} rules" in out.stdout


def run_unit_tests(tmp_path: Path, spec: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """promtool's unit tests against ``spec`` with only the `summary` annotations (promtool
    compares every annotation of a firing alert; prometheusrule_test.yaml says so)."""
    spec = copy.deepcopy(spec)
    for group in spec["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["annotations"] = {"summary": rule["annotations"]["summary"]}
    write_rules(tmp_path / "rules.yaml", spec)
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    return subprocess.run(
        [promtool(), "test", "rules", UNIT_TESTS.name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


def test_promtool_unit_tests_pass(tmp_path):
    out = run_unit_tests(tmp_path, rule_spec())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_the_unit_tests_notice_a_broken_alert(tmp_path):
    """Without its second arm the fatal-XID alert misses a GPU's first XID of a kind (the series
    appears at 1): the unit tests say so."""
    spec = rule_spec()
    for group in spec["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "TesseraGpuFatalXid":
                rule["expr"] = rule["expr"].split(" or")[0]
    out = run_unit_tests(tmp_path, spec)
    assert out.returncode != 0
    assert "alertname: TesseraGpuFatalXid, time: 6m" in out.stdout + out.stderr


@pytest.mark.parametrize(
    ("alert", "wrong", "when"),
    [
        ("TesseraBudgetNearlyExhausted", ("0.9", "0.95"), "7m"),
        ("TesseraBudgetControllerDown", ("> 300", "> 900"), "7m"),
        ("TesseraUsageNotFolded", ("3600", "7200"), "11m"),
    ],
)
def test_the_unit_tests_notice_a_wrong_budget_threshold(tmp_path, alert, wrong, when):
    spec = rule_spec()
    for group in spec["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                assert wrong[0] in rule["expr"]
                rule["expr"] = rule["expr"].replace(*wrong)
    out = run_unit_tests(tmp_path, spec)
    assert out.returncode != 0
    assert f"alertname: {alert}, time: {when}" in out.stdout + out.stderr


def test_every_alert_has_a_unit_test_that_fires_and_one_that_does_not():
    cases = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    fires, quiet = set(), set()
    for case in cases:
        for t in case["alert_rule_test"]:
            (fires if t["exp_alerts"] else quiet).add(t["alertname"])
    names = {a["alert"] for a in alerts()}
    assert names - fires == set(), "alerts no test sees firing"
    assert names - quiet == set(), "alerts no test sees quiet"


def test_every_alert_says_how_bad_it_is_and_where_its_runbook_is():
    sections = runbook_sections()
    for a in alerts():
        name = a["alert"]
        assert a["labels"]["severity"] in {"critical", "warning"}, name
        assert "for" in a, f"{name}: say how long it must hold (for: 0m for at once)"
        assert {"summary", "description", "runbook_url"} <= set(a["annotations"]), name
        url = a["annotations"]["runbook_url"]
        assert url == RUNBOOK_URL + github_anchor(name), name
        assert name in sections, f"docs/runbooks.md has no section ## {name}"
    assert set(sections) == {a["alert"] for a in alerts()}, "runbooks of alerts that do not exist"


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation other than - and _
    dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def runbook_sections() -> dict[str, str]:
    text = RUNBOOKS.read_text()
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def test_every_runbook_says_what_it_means_how_to_confirm_and_what_to_do():
    for name, body in runbook_sections().items():
        for part in ("**What it means.**", "**How to confirm.**", "**What to do.**"):
            assert part in body, f"{name}: no {part}"


def test_the_fatal_xid_alert_knows_the_agents_fatal_xids():
    from agent.telemetry.gpu_health import FATAL_XIDS

    [xid_alert] = [a for a in alerts() if a["alert"] == "TesseraGpuFatalXid"]
    for m in re.finditer(r'xid=~"([^"]+)"', xid_alert["expr"]):
        assert set(map(int, m.group(1).split("|"))) == set(FATAL_XIDS)


def test_the_unknown_xid_alert_knows_the_agents_fatal_and_application_xids():
    from agent.telemetry.gpu_health import APPLICATION_XIDS, FATAL_XIDS

    [xid_alert] = [a for a in alerts() if a["alert"] == "TesseraGpuUnknownXid"]
    lists = re.findall(r'xid!~"([^"]+)"', xid_alert["expr"])
    assert len(lists) == 3
    for found in lists:
        assert set(map(int, found.split("|"))) == set(FATAL_XIDS | APPLICATION_XIDS)


def test_the_unit_tests_notice_an_unknown_xid_alert_that_misses_the_first_one(tmp_path):
    spec = rule_spec()
    for group in spec["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "TesseraGpuUnknownXid":
                rule["expr"] = rule["expr"].split(" or")[0]
    out = run_unit_tests(tmp_path, spec)
    assert out.returncode != 0
    assert "alertname: TesseraGpuUnknownXid, time: 6m" in out.stdout + out.stderr


# --- Panels that count events see the first one ----------------------------------------------
#
# A counter series of an event kind appears with its first event, already at 1 (the agent does
# not know every XID or prepare-error reason in advance, so it cannot export them at 0).
# rate() and increase() extrapolate between the samples inside the range, and a series' first
# sample has nothing before it, so the 0 -> 1 step is never seen (Prometheus' docs, "Avoid
# missing metrics" in practices/instrumentation.md: a series that appears only when something
# happens is hard to use, export 0 where its labels are known; Prometheus' feature flag
# created-timestamp-zero-ingestion, docs/feature_flags.md, injects such a 0 from the _created
# sample, but it is off by default and does not reach series without one). The panels add the
# series that are new within the range with their whole value, and use increase() for the others.

EVENT_PANELS = {"XID errors": "tessera_gpu_xid_errors_total", "Prepare errors by reason":
                "tessera_prepare_errors_total"}  # fmt: skip


def panel_query(title: str) -> str:
    [panel] = [p for p in panels(dashboard()) if p["title"] == title]
    [target] = panel["targets"]
    expr: str = target["expr"]
    return expr.replace("$__rate_interval", "5m").replace("$node", ".*").replace("$gpu", ".*")


def run_expr_tests(tmp_path: Path, cases: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "rules.yaml").write_text("groups: []\n")
    (tmp_path / "panels_test.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": cases})
    )
    return subprocess.run(
        [promtool(), "test", "rules", "panels_test.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


def first_event_cases(expr: str, metric: str) -> list[dict[str, Any]]:
    """A kind whose first event comes at 10m, a second at 30m; an older kind counting on."""
    labels = (
        'job="tessera",node="n1",gpu="1",uuid="GPU-1",model="H100",'
        'pci_bus_id="0000:43:00.0",operation="prepare"'
    )
    new, old = f'{labels},xid="119",reason="new"', f'{labels},xid="13",reason="old"'
    keep = "node" if "prepare" in metric else "node, gpu, xid"
    got = re.search(r"sum by \(([^)]*)\)", expr)
    assert got is not None, expr
    by = [x.strip() for x in got.group(1).split(",")]
    assert set(keep.replace(" ", "").split(",")) <= set(by), by

    def sample(series: str, value: float) -> dict[str, Any]:
        lbls = dict(re.findall(r'(\w+)="([^"]*)"', series))
        return {"labels": "{" + ", ".join(f'{k}="{lbls[k]}"' for k in by) + "}", "value": value}

    return [
        {
            "interval": "1m",
            "input_series": [
                {"series": f"{metric}{{{new}}}", "values": "_x9 1x19 2x15"},
                {"series": f"{metric}{{{old}}}", "values": "0+1x45"},
            ],
            "promql_expr_test": [
                {"expr": expr, "eval_time": "8m", "exp_samples": [sample(old, 5.0)]},
                # the first event of a kind: seen while it is within the range
                {
                    "expr": expr,
                    "eval_time": "12m",
                    "exp_samples": [sample(new, 1.0), sample(old, 5.0)],
                },
                {
                    "expr": expr,
                    "eval_time": "20m",
                    "exp_samples": [sample(new, 0.0), sample(old, 5.0)],
                },
                {
                    "expr": expr,
                    "eval_time": "31m",
                    "exp_samples": [sample(new, 1.0), sample(old, 5.0)],
                },
            ],
        }
    ]


@pytest.mark.parametrize("title", sorted(EVENT_PANELS))
def test_an_event_panel_sees_the_first_event_of_a_kind(tmp_path, title):
    expr = panel_query(title)
    out = run_expr_tests(tmp_path, first_event_cases(expr, EVENT_PANELS[title]))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("title", sorted(EVENT_PANELS))
def test_increase_alone_misses_the_first_event(tmp_path, title):
    """What the panels did before: the test above notices it."""
    metric = EVENT_PANELS[title]
    by = re.search(r"sum by \(([^)]*)\)", panel_query(title))
    assert by is not None
    plain = f"sum by ({by.group(1)}) (increase({metric}[5m]))"
    out = run_expr_tests(tmp_path, first_event_cases(plain, metric))
    assert out.returncode != 0
    assert "time: 12m," in out.stdout + out.stderr


# --- Every metric used is real and documented ----------------------------------------------

KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "offset", "bool", "inf", "nan",
}  # fmt: skip
GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) used in a PromQL expression. A small tokenizer, not a
    parser: string literals, range and subquery brackets, Grafana variables, durations and
    numbers are dropped; labels are the names in `{...}` matchers and in
    by/without/on/ignoring/group_* lists; of the identifiers left, one followed by `(` is a
    function and the operators and modifiers are keywords; every other identifier is a metric
    name."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)  # Grafana's variables ($__rate_interval after offset)
    labels: set[str] = set()
    for m in re.finditer(r"\{([^}]*)\}", s):
        labels |= set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", m.group(1)))
    s = re.sub(r"\{[^}]*\}", " ", s)
    for m in re.finditer(GROUPING, s):
        labels |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    s = re.sub(GROUPING, " ", s)
    s = re.sub(r"\b\d+(?:ms|s|m|h|d|w|y)\b", " ", s)
    s = re.sub(r"\b\d+(?:\.\d+)?(?:[eE][+-]?\d+)?\b", " ", s)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][\w:]*", s):
        if s[m.end() :].lstrip().startswith("(") or m.group(0).lower() in KEYWORDS:
            continue
        names.add(m.group(0))
    return names, labels


def test_the_tokenizer_finds_metrics_and_labels_not_functions_or_keywords():
    names, labels = promql_names(
        "histogram_quantile(0.99, sum by (le, operation) (rate(tessera_prepare_duration_seconds"
        '_bucket{node=~"$node"}[$__rate_interval]))) / 3.6e6 > 0 unless on (node) up offset 10m'
        " or vector(0) and max_over_time((count by (node) (tessera_gpu_healthy))[1h:1m])"
    )
    assert names == {"tessera_prepare_duration_seconds_bucket", "up", "tessera_gpu_healthy"}
    assert labels == {"le", "operation", "node"}


def documented_metrics() -> dict[str, tuple[str, set[str]]]:
    """docs/metrics.md's tables: name -> (type, labels)."""
    out = {}
    for line in METRICS_DOC.read_text().splitlines():
        m = re.match(r"\| `(tessera_\w+)` \| (\w+) \| ([^|]*) \|", line)
        if m:
            out[m.group(1)] = (m.group(2), set(re.findall(r"`(\w+)`", m.group(3))))
    return out


def sample_names(name: str, kind: str) -> set[str]:
    """The sample names a metric family of ``kind`` is queried by."""
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return {name}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Sample names in a real agent's /metrics (`tessera run --simulate dgx-h100`) and the budget
    controller's: every family is there, with or without samples (the TYPE lines)."""
    from tests.integration.daemon import Daemon

    d = Daemon(tmp_path_factory.mktemp("agent"), "dgx-h100").start()
    try:
        with urllib.request.urlopen(d.metrics_url("/metrics"), timeout=10) as r:
            text = r.read().decode()
    finally:
        d.stop()
    # and the budget controller's (tessera budgets), as its endpoint serves them: every family
    # is declared in its registry, with or without samples
    from dra_driver.budgets.budget_metrics import BudgetMetrics

    text += BudgetMetrics().exposition()[0].decode()
    out = set()
    for fam in text_string_to_metric_families(text):
        name = fam.name + ("_total" if fam.type == "counter" else "")
        out |= sample_names(name, fam.type)
    return out


def used_metrics() -> list[tuple[str, str]]:
    """(where, PromQL) of every alert expression and dashboard query."""
    return [(f"alert {a['alert']}", a["expr"]) for a in alerts()] + dashboard_queries(dashboard())


def metric_problems(used: list[tuple[str, str]], exported: set[str]) -> list[str]:
    """What is wrong with the metrics and labels of ``used`` (where, PromQL): a metric not in
    docs/metrics.md or not in the agent's exposition, a label none of its metrics has."""
    docs = documented_metrics()
    doc_samples = {s: n for n, (kind, _) in docs.items() for s in sample_names(n, kind)}
    problems = []
    for where, expr in used:
        names, labels = promql_names(expr)
        if not names:
            problems.append(f"{where}: no metric in {expr!r}")
        allowed = set(TARGET_LABELS)
        for name in sorted(names - PROMETHEUS_METRICS):
            if name not in doc_samples:
                problems.append(f"{where}: {name} is not in docs/metrics.md")
            elif name not in exported:
                problems.append(f"{where}: {name} is not in the agent's /metrics")
            else:
                kind, doc_labels = docs[doc_samples[name]]
                allowed |= doc_labels | ({"le"} if kind == "histogram" else set())
        for label in sorted(labels - allowed):
            problems.append(f"{where}: label {label!r} is on none of {sorted(names)}")
    return problems


def test_every_metric_an_alert_or_a_panel_uses_is_exported_and_documented(exported):
    assert metric_problems(used_metrics(), exported) == []


def test_a_misspelt_metric_or_label_is_reported(exported):
    used = [("q", 'rate(tessera_gpu_utilisation_ratio[5m]) or tessera_gpu_healthy{uid="x"}')]
    assert metric_problems(used, exported) == [
        "q: tessera_gpu_utilisation_ratio is not in docs/metrics.md",
        "q: label 'uid' is on none of ['tessera_gpu_healthy', 'tessera_gpu_utilisation_ratio']",
    ]


# --- The dashboard --------------------------------------------------------------------------


def test_every_dashboard_query_is_valid_promql(tmp_path):
    """promtool parses each query as a recording rule (Grafana's variables replaced by values
    they take: an interval, a range, `.*` for a selection)."""
    values = {"__rate_interval": "1m", "__interval": "1m", "__range": "6h"}
    rules = [
        {
            "record": f"tessera_dashboard:query_{i}",
            "expr": re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), ".*"), expr),
        }
        for i, (_, expr) in enumerate(dashboard_queries(dashboard()))
    ]
    path = write_rules(tmp_path / "dash.yaml", {"groups": [{"name": "d", "rules": rules}]})
    out = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_dashboard_shows_every_gpu_every_claim_and_the_drivers_health():
    dash = dashboard()
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    shown: dict[str, list[str]] = {}  # metric -> legends of the panels that show it
    for p in panels(dash):
        for t in p.get("targets", []):
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            for name in promql_names(t["expr"])[0]:
                shown.setdefault(name, []).append(t.get("legendFormat", ""))
    # per node and per GPU: a series per GPU, named by node and GPU
    for metric in (
        "tessera_gpu_utilization_ratio",
        "tessera_gpu_memory_used_bytes",
        "tessera_gpu_power_watts",
        "tessera_gpu_energy_joules_total",
    ):
        assert any("{{node}}" in lf and "{{gpu}}" in lf for lf in shown.get(metric, [])), metric
    # per claim: energy and GPU-seconds, named by namespace and claim
    for metric in ("tessera_claim_energy_joules_total", "tessera_claim_gpu_seconds_total"):
        assert any("{{namespace}}/{{claim}}" in lf for lf in shown.get(metric, [])), metric
    assert any(
        "energy" in p["title"].lower() and "claim" in p["title"].lower() for p in panels(dash)
    )
    # the driver's health
    for metric in (
        "tessera_resourceslice_pool_generation",
        "tessera_prepare_errors_total",
        "tessera_gpu_healthy",
        "tessera_sampler_lag_seconds",
    ):
        assert metric in shown, metric
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "node", "gpu"} <= variables


def test_the_links_of_the_runbooks_and_the_pages_that_link_them_resolve():
    """Every local link (`page.md#anchor`, `#anchor`) in the runbooks and the pages that send
    readers to them names a page that exists and one of its headings."""
    pages = [RUNBOOKS, ROOT / "docs" / "troubleshooting.md", METRICS_DOC, ROOT / "README.md"]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.is_file():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)
                if anchor not in {github_anchor(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []
