"""docker-compose.yml, the Dockerfile, Grafana provisioning, the dashboards, the Collector and Tempo configs.

Grafana, Tempo and the OpenTelemetry Collector do not run here (no packages, no Docker engine): their configs
are checked as configuration only - they parse, every path and service they name exists, the datasource uids
line up, and every dashboard query uses contract names. The dashboards' queries are run on a real Prometheus by
tests/ops/test_ops_integration.py.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
from grafana_schema import dashboard_schema_problems
from ops_support import (
    COMPOSE,
    DASHBOARDS_DIR,
    DEPLOY,
    REPO,
    alert_rules,
    check_expr_names,
    dashboard_exprs,
    dashboards,
    iter_panels,
    label_values_as_promql,
    load_yaml,
    parse_names,
    recording_rules,
    variable_queries,
)

from kvobs import semconv as sc

GEN = REPO / "tools" / "gen_dashboards.py"


def compose() -> dict:
    return load_yaml(COMPOSE)


def services() -> dict:
    return compose()["services"]


def container_path_to_host(service: str, container_path: str) -> Path | None:
    """Host path of the bind mount of `service` that covers `container_path`."""
    for vol in services()[service].get("volumes", []):
        src, dst = vol.split(":")[:2]
        if src.startswith(".") and (container_path == dst or container_path.startswith(dst.rstrip("/") + "/")):
            return (REPO / src / container_path[len(dst):].lstrip("/")).resolve()
    return None


def host_of(url: str) -> str:
    return urlparse(url if "://" in url else "//" + url).hostname or ""


# ------------------------------------------------------------------------------------------- compose


def test_compose_matches_the_compose_spec() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_compose_has_the_stack() -> None:
    assert set(services()) == {"kvobs-demo", "prometheus", "alertmanager", "grafana", "otel-collector", "tempo"}


def test_compose_images_are_pinned() -> None:
    for name, svc in services().items():
        if "build" in svc:
            continue
        image = svc["image"]
        assert "@sha256:" in image or re.search(r":v?\d+\.\d+\.\d+$", image), f"{name}: {image} is not pinned"


def test_compose_ports_bind_loopback_only() -> None:
    for name, svc in services().items():
        for port in svc.get("ports", []):
            assert isinstance(port, str) and port.startswith("127.0.0.1:"), f"{name}: {port!r}"


def test_compose_references_exist() -> None:
    svcs, spec = services(), compose()
    for name, svc in svcs.items():
        deps = svc.get("depends_on", [])
        for dep in deps if isinstance(deps, list) else deps.keys():
            assert dep in svcs, f"{name} depends on unknown service {dep}"
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (REPO / src).exists(), f"{name}: bind mount source {src} does not exist"
            else:
                assert src in spec.get("volumes", {}), f"{name}: named volume {src} is not declared"
        if "build" in svc:
            build = svc["build"]
            context = REPO / build["context"]
            assert context.is_dir()
            assert (context / build.get("dockerfile", "Dockerfile")).is_file()


def test_dockerfile_copies_files_that_exist_and_runs_the_demo() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.M)
    for line in re.findall(r"^COPY\s+(.+)$", dockerfile, re.M):
        for src in line.split()[:-1]:
            assert (REPO / src).exists(), f"Dockerfile copies {src}, which does not exist"
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in dockerfile
    dockerignore = (REPO / ".dockerignore").read_text()
    for src in ("pyproject.toml", "README.md", "kvobs"):
        assert f"!{src}" in dockerignore, f".dockerignore excludes {src}, which the Dockerfile copies"


def test_demo_service_command() -> None:
    demo = services()["kvobs-demo"]
    cmd = demo["command"]
    assert cmd[:3] == ["kvobs", "demo", "--serve"]
    assert cmd[cmd.index("--metrics-port") + 1] == "9464"
    assert cmd[cmd.index("--metrics-addr") + 1] == "0.0.0.0"
    otlp = cmd[cmd.index("--otlp-endpoint") + 1]
    assert host_of(otlp) == "otel-collector" and otlp.endswith(":4317")


def test_grafana_admin_password_comes_from_the_environment() -> None:
    env = services()["grafana"]["environment"]
    password = env["GF_SECURITY_ADMIN_PASSWORD"]
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", password), password  # required, no default
    assert env.get("GF_AUTH_ANONYMOUS_ENABLED") == "false"


def test_prometheus_runs_with_exemplar_storage_and_the_repo_config() -> None:
    prom = services()["prometheus"]
    assert "--enable-feature=exemplar-storage" in prom["command"]
    config = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file="))
    host = container_path_to_host("prometheus", config)
    assert host == (DEPLOY / "prometheus" / "prometheus.yml").resolve()


def test_prometheus_config_targets_compose_services() -> None:
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    svcs = services()
    targets = [t for job in config["scrape_configs"] for sc_ in job["static_configs"] for t in sc_["targets"]]
    targets += [t for am in config["alerting"]["alertmanagers"] for sc_ in am["static_configs"] for t in sc_["targets"]]
    for target in targets:
        assert host_of(target) in set(svcs) | {"localhost"}, target
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["kvobs"]["static_configs"][0]["targets"] == ["kvobs-demo:9464"]
    for pattern in config["rule_files"]:
        assert list((DEPLOY / "prometheus").glob(pattern)), f"rule_files {pattern} matches nothing"


def test_alertmanager_and_other_configs_are_mounted() -> None:
    assert container_path_to_host("alertmanager", "/etc/alertmanager/alertmanager.yml") == (
        DEPLOY / "alertmanager" / "alertmanager.yml").resolve()
    collector_cfg = next(a.split("=", 1)[1] for a in services()["otel-collector"]["command"] if "--config=" in a)
    assert container_path_to_host("otel-collector", collector_cfg).is_file()
    tempo_cfg = next(a.split("=", 1)[1] for a in services()["tempo"]["command"] if "-config.file=" in a)
    assert container_path_to_host("tempo", tempo_cfg).is_file()


# ------------------------------------------------------------------------- collector, tempo, grafana


def test_otel_collector_config_sends_otlp_traces_to_tempo() -> None:
    cfg = load_yaml(DEPLOY / "otel-collector" / "config.yaml")
    pipeline = cfg["service"]["pipelines"]["traces"]
    for kind in ("receivers", "processors", "exporters"):
        for name in pipeline[kind]:
            assert name in cfg[kind], f"pipeline uses undefined {kind[:-1]} {name}"
    assert "otlp" in pipeline["receivers"]
    assert set(cfg["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    assert cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    exporters = [cfg["exporters"][e] for e in pipeline["exporters"]]
    assert any(host_of(e["endpoint"]) == "tempo" and e["endpoint"].endswith(":4317") for e in exporters)
    for ext in cfg["service"].get("extensions", []):
        assert ext in cfg["extensions"]


def test_tempo_config_receives_otlp_and_serves_grafana() -> None:
    cfg = load_yaml(DEPLOY / "tempo" / "tempo.yaml")
    assert cfg["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert cfg["server"]["http_listen_port"] == 3200
    assert cfg["storage"]["trace"]["backend"] == "local"


def grafana_datasources() -> dict[str, dict]:
    cfg = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "kvobs.yml")
    return {ds["uid"]: ds for ds in cfg["datasources"]}


def test_grafana_datasources_point_at_the_stack_and_link_exemplars_to_tempo() -> None:
    ds = grafana_datasources()
    assert ds["prometheus"]["type"] == "prometheus" and host_of(ds["prometheus"]["url"]) == "prometheus"
    assert ds["tempo"]["type"] == "tempo" and host_of(ds["tempo"]["url"]) == "tempo"
    dest = ds["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert {"name": "trace_id", "datasourceUid": "tempo"} in dest
    assert container_path_to_host("grafana", "/etc/grafana/provisioning/datasources/kvobs.yml").is_file()


def test_grafana_dashboard_provider_path_is_the_dashboards_folder() -> None:
    cfg = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "kvobs.yml")
    (provider,) = cfg["providers"]
    assert container_path_to_host("grafana", provider["options"]["path"]) == DASHBOARDS_DIR.resolve()
    assert container_path_to_host("grafana", "/etc/grafana/provisioning/dashboards/kvobs.yml").is_file()
    home = services()["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert container_path_to_host("grafana", home).is_file()


# -------------------------------------------------------------------------------------------- dashboards

REQUIRED = {
    # dashboard -> contract names its queries must use (the issue's list of what each shows)
    "kvobs-overview.json": {sc.TRANSFERS_TOTAL, sc.TRANSFER_DURATION_SECONDS + "_bucket", sc.TRANSFERS_IN_FLIGHT},
    "kvobs-lock.json": {sc.LOCK_WAIT_SECONDS + "_bucket", sc.LOCK_HOLD_SECONDS + "_bucket",
                        sc.LOCK_TIMEOUTS_TOTAL, sc.LOCK_HELD_SECONDS},
    "kvobs-integrity.json": {sc.NAN_CHECKS_TOTAL, sc.NAN_BLOCKS_TOTAL},
    "kvobs-signals.json": {sc.PENDING_SIGNALS, sc.PENDING_SIGNAL_OLDEST_AGE_SECONDS, sc.SIGNALS_TOTAL,
                           sc.SIGNAL_BUFFERED_SECONDS + "_bucket"},
}


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_dashboards", GEN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_dashboards_match_the_generator() -> None:
    gen = load_generator()
    assert set(gen.DASHBOARDS) == {p.name for p in DASHBOARDS_DIR.glob("*.json")}
    for name, build in gen.DASHBOARDS.items():
        assert (DASHBOARDS_DIR / name).read_text() == gen.render(build), (
            f"dashboards/{name} differs from tools/gen_dashboards.py: run `python tools/gen_dashboards.py`")


def test_check_mode_fails_on_a_stale_dashboard(tmp_path: Path) -> None:
    gen = load_generator()
    for name, build in gen.DASHBOARDS.items():
        (tmp_path / name).write_text(gen.render(build))
    assert gen.main(["--check", "--out", str(tmp_path)]) == 0
    stale = tmp_path / "kvobs-lock.json"
    stale.write_text(stale.read_text().replace("Lock wait heatmap", "Lock wait heat map"))
    assert gen.main(["--check", "--out", str(tmp_path)]) == 1


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_dashboard_matches_grafana_schema(name: str) -> None:
    """Every key known to Grafana 11.6's schema (grafana-foundation-sdk's models), every value of its type."""
    assert dashboard_schema_problems(dashboards()[name]) == []


def set_key(path: str, value: object):
    """A fault for BROKEN_DASHBOARDS: set `value` at a dotted path of the overview dashboard (ints index lists)."""
    def fault(dash: dict) -> None:
        *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
        node = dash
        for key in parents:
            node = node[key]
        node[last] = value
    return fault


def drop_panel_type(dash: dict) -> None:
    del dash["panels"][0]["type"]


BROKEN_DASHBOARDS = {
    # fault -> what the schema check must say about it
    "misspelt legend option": (set_key("panels.0.options.legend.displayModee", "table"),
                               ".panels[0].options.legend.displayModee: not in Grafana's schema"),
    "misspelt query field": (set_key("panels.0.targets.0.legendFromat", "{{path}}"),
                             ".panels[0].targets[0].legendFromat: not in Grafana's schema"),
    "width as a string": (set_key("panels.0.gridPos.w", "12"), ".panels[0].grid_pos.w: '12' is not a int"),
    "unknown tooltip mode": (set_key("panels.0.options.tooltip.mode", "multiple"),
                             ".panels[0].options.tooltip.mode: 'multiple' is not one of"),
    "variable refresh as a string": (set_key("templating.list.1.refresh", "2"),
                                     ".templating.list_val[1].refresh: '2' is not one of [0, 1, 2]"),
    "panel without a type": (drop_panel_type, "does not decode as a Grafana dashboard: KeyError('type')"),
}


@pytest.mark.parametrize("fault", sorted(BROKEN_DASHBOARDS))
def test_schema_check_finds_a_broken_dashboard(fault: str) -> None:
    break_it, expected = BROKEN_DASHBOARDS[fault]
    dash = copy.deepcopy(dashboards()["kvobs-overview.json"])
    break_it(dash)
    problems = dashboard_schema_problems(dash)
    assert any(p.startswith(expected) for p in problems), problems


def grid_problems(dash: dict) -> list[str]:
    """Panels that leave Grafana's 24-column grid or cover part of another panel."""
    problems = []
    owner: dict[tuple[int, int], str] = {}
    for panel in iter_panels(dash):
        pos = panel["gridPos"]
        if pos["x"] < 0 or pos["x"] + pos["w"] > 24:
            problems.append(f"{panel['title']!r} leaves the 24-column grid: {pos}")
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                if (x, y) in owner:
                    problems.append(f"{panel['title']!r} overlaps {owner[(x, y)]!r} at x={x}, y={y}")
                    break
                owner[(x, y)] = panel["title"]
            else:
                continue
            break
    return problems


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_panels_fit_the_grid_without_overlapping(name: str) -> None:
    assert grid_problems(dashboards()[name]) == []


def test_grid_check_finds_overlapping_and_overflowing_panels() -> None:
    dash = copy.deepcopy(dashboards()["kvobs-overview.json"])
    first, second = dash["panels"][:2]
    second["gridPos"] = dict(first["gridPos"], x=first["gridPos"]["x"] + 1)
    dash["panels"][-1]["gridPos"]["x"] = 20
    problems = grid_problems(dash)
    assert any(f"{second['title']!r} overlaps {first['title']!r}" in p for p in problems), problems
    assert any(f"{dash['panels'][-1]['title']!r} leaves the 24-column grid" in p for p in problems), problems


def test_dashboards_are_the_four_required() -> None:
    assert set(dashboards()) == set(REQUIRED)


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_dashboard_shape(name: str) -> None:
    dash = dashboards()[name]
    assert dash["schemaVersion"] >= 39  # Grafana 11
    assert dash["uid"] == name.removesuffix(".json")
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "engine", "instance"} <= set(variables)
    for var in ("engine", "instance"):
        assert variables[var]["multi"] and variables[var]["includeAll"] and variables[var]["allValue"] == ".*"
    ids = [p["id"] for p in iter_panels(dash)]
    assert len(ids) == len(set(ids))
    for panel in iter_panels(dash):
        if panel.get("type") == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel.get("targets"), panel["title"]
        for t in panel["targets"]:
            assert 'engine=~"$engine"' in t["expr"] and 'instance=~"$instance"' in t["expr"], (panel["title"], t["expr"])


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_dashboard_shows_what_the_issue_asks(name: str) -> None:
    used = set()
    for _, expr in dashboard_exprs(dashboards()[name]):
        used |= parse_names(expr).metrics
    assert REQUIRED[name] <= used, REQUIRED[name] - used


def test_latency_panels_link_to_traces_through_exemplars() -> None:
    latency = 0
    for dash in dashboards().values():
        for panel in iter_panels(dash):
            for t in panel.get("targets", []):
                if "histogram_quantile" in t["expr"] or panel["type"] == "heatmap":
                    latency += 1
                    assert t.get("exemplar") is True, (panel["title"], t["expr"])
    assert latency >= 8


def test_lock_dashboard_has_a_heatmap() -> None:
    assert any(p["type"] == "heatmap" and sc.LOCK_WAIT_SECONDS in p["targets"][0]["expr"]
               for p in iter_panels(dashboards()["kvobs-lock.json"]))


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_dashboard_queries_use_only_contract_names(name: str) -> None:
    dash = dashboards()[name]
    problems = [p for title, expr in dashboard_exprs(dash) for p in check_expr_names(expr, f"{name}: {title}")]
    for var, query in variable_queries(dash):
        problems += check_expr_names(label_values_as_promql(query), f"{name}: variable {var}")
    assert problems == []


def test_recording_rules_used_by_dashboards_exist() -> None:
    defined = {r["record"] for r in recording_rules()}
    used = {m for d in dashboards().values() for _, e in dashboard_exprs(d) for m in re.findall(r"kvobs:[\w:]+", e)}
    assert used and used <= defined, used - defined


# ------------------------------------------------------------------------------------------------ docs


def test_ops_docs_cover_the_stack_the_dashboards_and_every_alert() -> None:
    text = (REPO / "docs" / "ops.md").read_text()
    assert "docs/ops.md" in (REPO / "README.md").read_text()
    assert "docker compose up" in text and "GRAFANA_ADMIN_PASSWORD" in text
    for url in ("http://127.0.0.1:3000", "http://127.0.0.1:9090", "http://127.0.0.1:9093"):
        assert url in text
    for dash in dashboards().values():
        assert dash["title"] in text
    for rule in alert_rules():
        assert f"(runbook.md#{rule['alert'].lower()})" in text, rule["alert"]
    assert "configuration only" in text
