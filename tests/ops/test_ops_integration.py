"""The ops kit against real processes: the kvobs demo, Prometheus 2.42 and Alertmanager 0.25 (Debian packages).

Started once for the module, all on 127.0.0.1, every process stopped afterwards (also on failure):

- `python -m kvobs demo --serve --metrics-port P --metrics-addr 127.0.0.1 --fault stale-signal --fault nan
  --otlp-endpoint http://127.0.0.1:<unused port>`: steady traffic on all three paths; a layer0 signal that never
  finds its task; poisoned storage entries; recording spans, so its histograms carry trace_id exemplars;
- a metrics endpoint in this process serving kvobs histograms with a `trace_id` exemplar (job
  `exemplar-probe`), which proves the scrape negotiates OpenMetrics and exemplar storage is on;
- Prometheus with the repo's rules and a copy of deploy/prometheus/prometheus.yml whose targets point at the
  loopback ports above;
- Alertmanager with a copy of deploy/alertmanager/alertmanager.yml whose receivers all deliver to a webhook
  receiver inside this test.

Fast copies, not different rules: the committed rules keep production values. The test writes a copy of
every rule file in which each `for:` is 2s and the stale-signal threshold is 2s instead of 5s
(`FAST_THRESHOLDS`), the scrape/evaluation interval is 1s, and Alertmanager's group_wait/group_interval are 1s.
Everything else (expressions, labels, annotations, routing, inhibition) is the committed text.

Then it asserts that every dashboard panel query, every template variable query, every recording rule and the
signal side of every alert evaluates without error and returns data, that every rule is healthy, and that the
stale-pending-signal and NaN alerts fire in Prometheus and reach the webhook through Alertmanager, and that
exemplars (from the probe and from the demo) are stored for the latency panels' trace links.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from ops_support import (
    ALERTMANAGER_CONFIG,
    NOT_YET,
    POLL_INTERVAL_S,
    PROM_CONFIG,
    WebhookReceiver,
    alert_rules,
    dashboard_exprs,
    dashboards,
    free_port,
    http_json,
    label_values_as_promql,
    load_yaml,
    processes,  # noqa: F401 - module-scoped fixture
    prom_query,
    recording_rules,
    require_binary,
    rule_files,
    split_threshold,
    start_alertmanager,
    start_prometheus,
    substitute_grafana_vars,
    variable_queries,
)
from prometheus_client import CollectorRegistry, start_http_server
from support import wait_until

from kvobs import semconv as sc

pytestmark = pytest.mark.timeout(150)

# Alerts the faults must trigger, with the threshold used in the fast copy of the rules.
MUST_FIRE = ("KvobsStalePendingSignal", "KvobsNaNDetected")
FAST_THRESHOLDS = {"KvobsStalePendingSignal": "2"}
FAST_FOR = "2s"
PROBE_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"

def demo_command(port: int) -> list[str]:
    # Spans must record for the demo to attach trace_id exemplars; they are exported to a loopback port
    # nobody listens on (the exporter retries in the background and never blocks the engine).
    return [sys.executable, "-m", "kvobs", "demo", "--serve", "--metrics-port", str(port),
            "--metrics-addr", "127.0.0.1", "--otlp-endpoint", f"http://127.0.0.1:{free_port()}",
            "--fault", "stale-signal", "--fault", "nan"]


def fast_rules(src: Path, dst: Path) -> Path:
    """Copy of a rule file with short `for:` and the thresholds of FAST_THRESHOLDS (see module docstring)."""
    doc = load_yaml(src)
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = FAST_FOR
            name = rule.get("alert")
            if name in FAST_THRESHOLDS:
                lhs, op, _ = split_threshold(rule["expr"])
                rule["expr"] = f"{lhs} {op} {FAST_THRESHOLDS[name]}"
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dst


def prometheus_config(workdir: Path, demo_port: int, probe_port: int, am_port: int) -> Path:
    cfg = load_yaml(PROM_CONFIG)
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    rules_dir = workdir / "rules"
    rules_dir.mkdir()
    cfg["rule_files"] = [str(fast_rules(f, rules_dir / f.name)) for f in rule_files()]
    cfg["alerting"]["alertmanagers"] = [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]
    kvobs_job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "kvobs")  # the committed job name
    kvobs_job.update(scrape_interval="1s", scrape_timeout="1s", static_configs=[{"targets": [f"127.0.0.1:{demo_port}"]}])
    probe_job = {"job_name": "exemplar-probe", "scrape_interval": "1s", "scrape_timeout": "1s",
                 "static_configs": [{"targets": [f"127.0.0.1:{probe_port}"]}]}
    cfg["scrape_configs"] = [kvobs_job, probe_job]
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def alertmanager_config(workdir: Path, webhook_url: str) -> Path:
    cfg = load_yaml(ALERTMANAGER_CONFIG)

    def fast(route: dict) -> None:
        for key in ("group_wait", "group_interval"):
            if key in route:
                route[key] = "1s"
        for child in route.get("routes", []):
            fast(child)

    cfg["route"].update(group_wait="1s", group_interval="1s")
    fast(cfg["route"])
    for receiver in cfg["receivers"]:
        receiver["webhook_configs"] = [{"url": webhook_url, "send_resolved": False}]
    path = workdir / "alertmanager.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@dataclass
class Stack:
    prometheus: str
    alertmanager: str
    webhook: WebhookReceiver
    demo_instance: str
    report: object


def start_exemplar_probe(port: int):
    """kvobs metric families on a private registry, one observation carrying a trace_id exemplar."""
    from kvobs.telemetry._metrics.engine_metrics import EngineMetrics
    from kvobs.telemetry._metrics.families import MetricFamilies

    registry = CollectorRegistry()
    metrics = EngineMetrics(MetricFamilies.of(registry), engine="exemplar-probe", lock_name="probe")
    metrics.paths[sc.PATH_SEND].transfers[sc.OUTCOME_OK].inc()
    families = MetricFamilies.of(registry)
    families.duration.labels("exemplar-probe", sc.PATH_SEND, sc.OUTCOME_OK).observe(
        0.0042, exemplar={"trace_id": PROBE_TRACE_ID})
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    return server, thread


@pytest.fixture(scope="module")
def stack(processes, tmp_path_factory) -> Iterator[Stack]:  # noqa: F811 - fixture injection
    require_binary("prometheus")
    require_binary("prometheus-alertmanager", "alertmanager")
    workdir = tmp_path_factory.mktemp("ops-stack")
    demo_port, probe_port = free_port(), free_port()
    demo = demo_command(demo_port)

    with WebhookReceiver() as webhook:
        server, thread = start_exemplar_probe(probe_port)
        try:
            am = start_alertmanager(processes, alertmanager_config(workdir, webhook.url), workdir)
            demo_proc = processes.start("demo", demo)
            am_port = int(am.rsplit(":", 1)[1])
            prom = start_prometheus(processes, prometheus_config(workdir, demo_port, probe_port, am_port), workdir)
            instance = f"127.0.0.1:{demo_port}"

            def demo_scraped() -> bool:
                if not demo_proc.alive():
                    pytest.fail(f"the demo exited with {demo_proc.popen.returncode}:\n{demo_proc.tail()}",
                                pytrace=False)
                up = prom_query(prom, f'up{{job="kvobs",instance="{instance}"}} == 1')
                return bool(up) and bool(prom_query(prom, f'{sc.TRANSFERS_TOTAL}{{instance="{instance}"}}'))

            wait_until(demo_scraped, "the first successful scrape of the demo", timeout=30, interval=POLL_INTERVAL_S,
                       ignoring=NOT_YET, on_timeout=processes.report)
            yield Stack(prom, am, webhook, instance, processes.report)
        finally:
            server.shutdown()
            server.server_close()
            thread.join(5)
            processes.stop_all()


def queries_to_check(instance: str) -> list[tuple[str, str]]:
    """(where, PromQL) for every dashboard panel and variable, every recording rule and every alert's signal."""
    grafana_vars = {"engine": ".*", "instance": instance.replace(".", "\\\\.")}
    out = []
    for name, dash in dashboards().items():
        for title, expr in dashboard_exprs(dash):
            out.append((f"{name}: {title}", substitute_grafana_vars(expr, grafana_vars)))
        for var, query in variable_queries(dash):
            out.append((f"{name}: variable {var}",
                        substitute_grafana_vars(label_values_as_promql(query), grafana_vars)))
    # Rules see every target; keep only the demo's series so the exemplar probe cannot supply the data.
    only_demo = f' and on (instance) up{{instance="{instance}"}}'
    for rule in recording_rules():
        out.append((f"record {rule['record']}", f"({rule['expr']}){only_demo}"))
    for rule in alert_rules():
        out.append((f"alert {rule['alert']} (signal)", f"({split_threshold(rule['expr'])[0]}){only_demo}"))
    return out


def test_every_dashboard_and_rule_query_returns_data(stack: Stack) -> None:
    pending = dict(queries_to_check(stack.demo_instance))
    errors: dict[str, str] = {}

    def all_have_data() -> bool:
        for where, expr in list(pending.items()):
            try:
                if prom_query(stack.prometheus, expr):
                    del pending[where]
                    errors.pop(where, None)
            except AssertionError as exc:  # an evaluation error is final: no retry can fix the expression
                errors[where] = str(exc)
        if errors:
            pytest.fail("queries that do not evaluate:\n" + "\n".join(f"{w}: {e}" for w, e in errors.items()),
                        pytrace=False)
        return not pending

    wait_until(all_have_data, "every query to return data", timeout=45, interval=POLL_INTERVAL_S, ignoring=NOT_YET,
               on_timeout=lambda: "no data:\n" + "\n".join(f"{w}:\n    {e}" for w, e in pending.items()))


def test_every_rule_is_healthy(stack: Stack) -> None:
    def evaluated() -> list[dict]:
        rules = [r for g in http_json(stack.prometheus + "/api/v1/rules")["data"]["groups"] for r in g["rules"]]
        return rules if rules and all(r["health"] != "unknown" for r in rules) else []

    rules = wait_until(evaluated, "every rule to be evaluated once", timeout=20, interval=POLL_INTERVAL_S,
                       ignoring=NOT_YET)
    names = {r["name"] for r in rules}
    assert names == {r.get("alert") or r["record"] for r in alert_rules() + recording_rules()}
    bad = [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert bad == []


def test_stale_signal_and_nan_alerts_fire_and_reach_the_webhook(stack: Stack) -> None:
    def firing_in_prometheus() -> bool:
        # ALERTS history, not the current state: the demo's stuck signal may expire (TTL) after it fired.
        names = "|".join(MUST_FIRE)
        fired = prom_query(stack.prometheus, f'max_over_time(ALERTS{{alertstate="firing",alertname=~"{names}"}}[5m])')
        return set(MUST_FIRE) <= {s["metric"]["alertname"] for s in fired}

    wait_until(firing_in_prometheus, f"{MUST_FIRE} to fire in Prometheus", timeout=60, interval=POLL_INTERVAL_S,
               ignoring=NOT_YET, on_timeout=lambda: str(http_json(stack.prometheus + "/api/v1/alerts")))
    wait_until(lambda: all(stack.webhook.firing(n) for n in MUST_FIRE), f"{MUST_FIRE} at the webhook", timeout=30,
               interval=POLL_INTERVAL_S, ignoring=NOT_YET, on_timeout=lambda: f"received: {stack.webhook.alerts()}\n{stack.report()}")

    for name in MUST_FIRE:
        alert = stack.webhook.firing(name)[0]
        assert alert["labels"]["severity"] == "critical"
        assert alert["labels"]["instance"] == stack.demo_instance
        assert alert["labels"].get(sc.LABEL_ENGINE)
        assert alert["receiver"] == "kvobs-pager"  # routed by the committed routing tree
        assert alert["annotations"]["runbook_url"].endswith(f"docs/runbook.md#{name.lower()}")
        assert "{{" not in alert["annotations"]["summary"]  # the template rendered
    nan = stack.webhook.firing("KvobsNaNDetected")[0]
    assert nan["labels"][sc.LABEL_PATH] in sc.PATHS


def stored_exemplars(base: str, selector: str) -> list[dict]:
    now = time.time()
    data = http_json(base + "/api/v1/query_exemplars",
                     {"query": selector, "start": str(now - 300), "end": str(now + 60)})["data"]
    return [e for series in data for e in series["exemplars"]]


def test_scrape_keeps_exemplars_for_trace_links(stack: Stack) -> None:
    """OpenMetrics was negotiated and exemplar storage is on: a trace_id exemplar is queryable."""
    probe = f'{sc.TRANSFER_DURATION_SECONDS}_bucket{{job="exemplar-probe"}}'
    found = wait_until(lambda: stored_exemplars(stack.prometheus, probe), "a stored exemplar of the probe", timeout=20,
                       interval=POLL_INTERVAL_S, ignoring=NOT_YET)
    assert any(e["labels"].get("trace_id") == PROBE_TRACE_ID for e in found), found


def test_demo_latency_histograms_carry_trace_exemplars(stack: Stack) -> None:
    """The latency panels' exemplar links work with the real demo: its spans' trace ids reach Prometheus."""
    demo = f'{sc.TRANSFER_DURATION_SECONDS}_bucket{{instance="{stack.demo_instance}"}}'
    found = wait_until(lambda: stored_exemplars(stack.prometheus, demo), "a stored exemplar of the demo", timeout=20,
                       interval=POLL_INTERVAL_S, ignoring=NOT_YET)
    assert all(len(e["labels"].get("trace_id", "")) == 32 for e in found), found[:3]
