"""deploy/kubernetes: the PrometheusRule, the PodMonitor, the dashboard and Collector ConfigMaps.

No cluster runs here. Each object is checked by the most real tool available offline, and each check is shown
to fail on a deliberately broken object:

- the ConfigMaps against Kubernetes' own schemas (kubernetes-validate, strict: unknown fields are errors);
- the PrometheusRule's groups with promtool (check rules, and the alert unit tests run on the extracted
  groups), and equal to the groups of deploy/prometheus/rules, the one source;
- the PrometheusRule and PodMonitor against prometheus-operator's documented API (tests/prometheus_operator_api.py
  says what that covers and what it cannot);
- everything generated: the committed files equal tools/gen_kubernetes.py's output.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import utils as kubernetes_schemas

from ops_support import (
    DASHBOARDS_DIR,
    DEPLOY,
    PROM_CONFIG,
    REPO,
    RULE_TESTS,
    alert_rules,
    load_yaml,
    recording_rules,
    require_binary,
    rule_files,
    run_tool,
)
from prometheus_operator_api import operator_object_problems

GEN = REPO / "tools" / "gen_kubernetes.py"
K8S_DIR = DEPLOY / "kubernetes"
COLLECTOR_CONFIG = DEPLOY / "otel-collector" / "config.yaml"
# The oldest and the newest Kubernetes whose schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = sorted({kubernetes_schemas.all_versions()[0], kubernetes_schemas.latest_version()})
# kubectl's client-side apply copies the whole object into an annotation, and annotations are limited to this.
ANNOTATIONS_LIMIT_BYTES = 256 * 1024


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_kubernetes", GEN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def objects() -> list[dict]:
    return [obj for path in sorted(K8S_DIR.glob("*.yaml")) if path.name != "kustomization.yaml"
            for obj in yaml.safe_load_all(path.read_text()) if obj]


def objects_of(kind: str) -> list[dict]:
    return [obj for obj in objects() if obj["kind"] == kind]


def prometheus_rule() -> dict:
    (rule,) = objects_of("PrometheusRule")
    return rule


def pod_monitor() -> dict:
    (monitor,) = objects_of("PodMonitor")
    return monitor


# ----------------------------------------------------------------------------------------- generated


def test_committed_objects_match_the_generator() -> None:
    gen = load_generator()
    assert sorted(gen.FILES) == sorted(p.name for p in K8S_DIR.iterdir())
    for name in gen.FILES:
        assert (K8S_DIR / name).read_text() == gen.render(name), (
            f"deploy/kubernetes/{name} differs from tools/gen_kubernetes.py: run `python tools/gen_kubernetes.py`")


def test_check_mode_fails_on_a_stale_file(tmp_path: Path) -> None:
    gen = load_generator()
    for name in gen.FILES:
        (tmp_path / name).write_text(gen.render(name))
    assert gen.main(["--check", "--out", str(tmp_path)]) == 0
    stale = tmp_path / "prometheusrule.yaml"
    stale.write_text(stale.read_text().replace("for: 15s", "for: 1m", 1))
    assert gen.main(["--check", "--out", str(tmp_path)]) == 1


def test_kustomization_lists_every_object_file() -> None:
    kustomization = load_yaml(K8S_DIR / "kustomization.yaml")
    listed = kustomization["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
    assert {obj["kind"] for obj in objects()} == {"PrometheusRule", "PodMonitor", "ConfigMap"}


# ----------------------------------------------------------------------------- core objects (ConfigMaps)


def kubernetes_schema_problems(obj: dict, version: str) -> list[str]:
    try:
        kubernetes_schemas.validate(obj, version, strict=True)
    except kubernetes_schemas.ValidationError as exc:
        return [f"{exc.json_path}: {exc.message}"]
    return []


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_config_maps_match_the_kubernetes_schema(version: str) -> None:
    config_maps = objects_of("ConfigMap")
    assert len(config_maps) == len(list(DASHBOARDS_DIR.glob("*.json"))) + 1
    for obj in config_maps:
        assert kubernetes_schema_problems(obj, version) == [], obj["metadata"]["name"]


BROKEN_CONFIG_MAPS = {
    "misspelt field": (lambda cm: cm.update(datas=cm.pop("data")), "Additional properties are not allowed ('datas'"),
    "a value that is not a string": (lambda cm: cm["data"].update(refresh=10), "10 is not of type 'string'"),
    "labels as a list": (lambda cm: cm["metadata"].update(labels=["grafana_dashboard"]), "is not of type 'object'"),
}


@pytest.mark.parametrize("fault", sorted(BROKEN_CONFIG_MAPS))
def test_kubernetes_schema_check_finds_a_broken_config_map(fault: str) -> None:
    break_it, expected = BROKEN_CONFIG_MAPS[fault]
    config_map = copy.deepcopy(objects_of("ConfigMap")[0])
    break_it(config_map)
    problems = kubernetes_schema_problems(config_map, KUBERNETES_VERSIONS[-1])
    assert any(expected in p for p in problems), problems


def client_side_apply_problems(obj: dict) -> list[str]:
    size = len(json.dumps(obj, separators=(",", ":")))
    if size >= ANNOTATIONS_LIMIT_BYTES:
        return [f"{obj['metadata']['name']}: {size} bytes, too large for `kubectl apply` (annotations <= 256 KiB)"]
    return []


def test_objects_are_small_enough_for_kubectl_apply() -> None:
    for obj in objects():
        assert client_side_apply_problems(obj) == []


def test_size_check_finds_a_config_map_too_large_for_kubectl_apply() -> None:
    config_map = copy.deepcopy(objects_of("ConfigMap")[0])
    config_map["data"]["padding"] = "x" * ANNOTATIONS_LIMIT_BYTES
    assert client_side_apply_problems(config_map)


def test_dashboard_config_maps_carry_the_dashboards_for_grafanas_sidecar() -> None:
    carried = {}
    for obj in objects_of("ConfigMap"):
        if obj["metadata"]["labels"].get("grafana_dashboard") == "1":
            assert obj["metadata"]["annotations"]["grafana_folder"] == "kvobs"
            (name, text), = obj["data"].items()
            carried[name] = text
    assert carried == {p.name: p.read_text() for p in DASHBOARDS_DIR.glob("*.json")}


def test_collector_config_map_carries_the_collector_config() -> None:
    (collector,) = [obj for obj in objects_of("ConfigMap") if "config.yaml" in obj["data"]]
    assert collector["data"] == {"config.yaml": COLLECTOR_CONFIG.read_text()}


# ------------------------------------------------------------------------------- the PrometheusRule


def source_groups() -> list[dict]:
    return [group for path in rule_files() for group in load_yaml(path)["groups"]]


def test_prometheus_rule_groups_equal_the_rule_files() -> None:
    assert prometheus_rule()["spec"]["groups"] == source_groups()


def write_rule_groups(rule: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path


def test_promtool_checks_the_prometheus_rule_groups(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    extracted = write_rule_groups(prometheus_rule(), tmp_path / "kvobs-prometheusrule.yml")
    res = run_tool([promtool, "check", "rules", str(extracted)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(alert_rules()) + len(recording_rules())} rules found" in res.stdout, res.stdout


def test_alert_unit_tests_pass_on_the_prometheus_rule_groups(tmp_path: Path) -> None:
    """The promtool cases of deploy/prometheus/tests, run on the groups taken out of the PrometheusRule."""
    promtool = require_binary("promtool")
    extracted = write_rule_groups(prometheus_rule(), tmp_path / "kvobs-prometheusrule.yml")
    unit_tests = load_yaml(RULE_TESTS)
    unit_tests["rule_files"] = [str(extracted)]
    test_file = tmp_path / "kvobs-alerts.test.yml"
    test_file.write_text(yaml.safe_dump(unit_tests, sort_keys=False))
    res = run_tool([promtool, "test", "rules", str(test_file)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_promtool_finds_a_broken_prometheus_rule(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    broken = copy.deepcopy(prometheus_rule())
    broken["spec"]["groups"][0]["rules"][0]["expr"] = "max by (job (kvobs_pending_signal_oldest_age_seconds) > 5"
    extracted = write_rule_groups(broken, tmp_path / "broken.yml")
    res = run_tool([promtool, "check", "rules", str(extracted)])
    assert res.returncode != 0 and "parse error" in res.stdout + res.stderr, res.stdout + res.stderr
    assert broken["spec"]["groups"] != source_groups()


# ------------------------------------------------------------------ operator objects vs. the documented API


@pytest.mark.parametrize("kind", ["PrometheusRule", "PodMonitor"])
def test_operator_objects_match_the_documented_api(kind: str) -> None:
    (obj,) = objects_of(kind)
    assert operator_object_problems(obj, KUBERNETES_VERSIONS[-1]) == []


def set_in(kind: str, path: str, value: object):
    """A fault for BROKEN_OPERATOR_OBJECTS: set `value` at a dotted path of the committed object of `kind`."""
    def fault() -> dict:
        obj = copy.deepcopy(prometheus_rule() if kind == "PrometheusRule" else pod_monitor())
        *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
        node = obj
        for key in parents:
            node = node[key]
        node[last] = value
        return obj
    return fault


BROKEN_OPERATOR_OBJECTS = {
    # ServiceMonitor's field name in a PodMonitor: the operator would prune it and scrape nothing
    "endpoints in a PodMonitor": (set_in("PodMonitor", "spec.endpoints", []),
                                  "$.spec: Additional properties are not allowed ('endpoints' was unexpected)"),
    "port number where the port name goes": (set_in("PodMonitor", "spec.podMetricsEndpoints.0.port", 9464),
                                             "$.spec.podMetricsEndpoints[0].port: 9464 is not of type 'string'"),
    "interval that is not a duration": (set_in("PodMonitor", "spec.podMetricsEndpoints.0.interval", "5 s"),
                                        "$.spec.podMetricsEndpoints[0].interval: '5 s' does not match"),
    "unknown relabel action": (set_in("PodMonitor", "spec.podMetricsEndpoints.0.relabelings.0.action", "rename"),
                               "$.spec.podMetricsEndpoints[0].relabelings[0].action: 'rename' is not one of"),
    "wrong API group": (set_in("PodMonitor", "apiVersion", "monitoring.coreos.com/v1alpha1"), "not a monitoring.coreos.com/v1"),
    "misspelt metadata": (set_in("PrometheusRule", "metadata.label", {}),
                          "$.metadata: Additional properties are not allowed ('label' was unexpected)"),
    "severity outside labels": (set_in("PrometheusRule", "spec.groups.0.rules.0.severity", "critical"),
                                "$.spec.groups[0].rules[0]: Additional properties are not allowed ('severity'"),
    "rule that is alert and record": (set_in("PrometheusRule", "spec.groups.0.rules.0.record", "kvobs:x:y"),
                                      "$.spec.groups[0].rules[0]: neither an alerting nor a recording rule"),
    "for that is not a duration": (set_in("PrometheusRule", "spec.groups.0.rules.0.for", "15 seconds"),
                                   "$.spec.groups[0].rules[0].for: '15 seconds' does not match"),
    "group without a name": (set_in("PrometheusRule", "spec.groups.0.name", ""),
                             "$.spec.groups[0].name: '' should be non-empty"),
    "two groups of one name": (set_in("PrometheusRule", "spec.groups.1.name", "kvobs-alerts"),
                               "$.spec.groups: group name 'kvobs-alerts' appears 2 times"),
}


@pytest.mark.parametrize("fault", sorted(BROKEN_OPERATOR_OBJECTS))
def test_operator_api_check_finds_a_broken_object(fault: str) -> None:
    make_broken, expected = BROKEN_OPERATOR_OBJECTS[fault]
    problems = operator_object_problems(make_broken(), KUBERNETES_VERSIONS[-1])
    assert any(p.startswith(expected) for p in problems), problems


# ------------------------------------------------------------------ the PodMonitor scrapes as the rules expect


def test_pod_monitor_scrapes_engines_as_the_rules_and_dashboards_expect() -> None:
    (endpoint,) = pod_monitor()["spec"]["podMetricsEndpoints"]
    # Port names are IANA service names: at most 15 characters, lower-case letters, digits and '-'.
    assert re.fullmatch(r"(?=.{1,15}$)[a-z0-9]+(-[a-z0-9]+)*", endpoint["port"]) and re.search("[a-z]", endpoint["port"])
    (job_relabel,) = [r for r in endpoint["relabelings"] if r.get("targetLabel") == "job"]
    target_down = next(r for r in alert_rules() if r["alert"] == "KvobsTargetDown")
    job_pattern = re.search(r'job=~"([^"]+)"', target_down["expr"])[1]
    assert re.fullmatch(job_pattern, job_relabel["replacement"]), (job_pattern, job_relabel)
    compose_job = next(j for j in load_yaml(PROM_CONFIG)["scrape_configs"] if j["job_name"] == job_relabel["replacement"])
    assert endpoint["interval"] == compose_job["scrape_interval"]
    assert endpoint["path"] == "/metrics"
