"""Helpers for the ops tests: real promtool/amtool/prometheus/alertmanager processes, and PromQL name checks.

- Binaries come from the Debian packages `prometheus` (prometheus, promtool) and `prometheus-alertmanager`
  (prometheus-alertmanager, amtool). Missing outside CI: the test skips with a message naming the package.
  Under CI=true it fails instead: CI (`.ci/run`) installs both packages, so a missing binary there is a bug.
- Processes log to files in a tmp dir, are polled until ready, and are always stopped (terminate, wait,
  kill) by the `processes` fixture, also when the test fails.
- All traffic goes to 127.0.0.1.
- The PromQL helpers are a deliberately small lexer, not a parser: enough to find the metric names, label
  names and label values an expression uses, so tests can check them against kvobs.semconv.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from support import wait_until

from kvobs import semconv as sc

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
PROM_DIR = DEPLOY / "prometheus"
PROM_CONFIG = PROM_DIR / "prometheus.yml"
RULES_DIR = PROM_DIR / "rules"
RULE_TESTS = PROM_DIR / "tests" / "kvobs-alerts.test.yml"
ALERTMANAGER_CONFIG = DEPLOY / "alertmanager" / "alertmanager.yml"
DASHBOARDS_DIR = REPO / "dashboards"
RUNBOOK = REPO / "docs" / "runbook.md"
COMPOSE = REPO / "docker-compose.yml"

PACKAGE_OF = {
    "prometheus": "prometheus",
    "promtool": "prometheus",
    "prometheus-alertmanager": "prometheus-alertmanager",
    "alertmanager": "prometheus-alertmanager",
    "amtool": "prometheus-alertmanager",
}


# --------------------------------------------------------------------------------------------- binaries


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def skip_or_fail(message: str) -> None:
    """Skip outside CI; fail under CI=true, where `.ci/run` installs the Debian packages."""
    if in_ci():
        pytest.fail(f"{message} (CI=true: .ci/run must install it)", pytrace=False)
    pytest.skip(message)


def require_binary(*names: str) -> str:
    """Path of the first of `names` on PATH, else skip (or fail under CI) naming the Debian package."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    package = PACKAGE_OF.get(names[0], names[0])
    skip_or_fail(f"{' / '.join(names)} not found: install the Debian package `{package}` "
                 "(apt-get install prometheus prometheus-alertmanager)")
    raise AssertionError("unreachable")


def run_tool(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a CLI check; the assertion message carries its full output."""
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)


# ------------------------------------------------------------------------------------------- processes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the small race is acceptable in tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ManagedProcess:
    name: str
    args: list[str]
    popen: subprocess.Popen
    log: Path

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace: float = 5.0) -> None:
        """Terminate the process (its own process group), wait, then kill."""
        if self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(grace)


@dataclass
class Processes:
    """Starts processes with logs in `log_dir`; `stop_all` stops every one of them, newest first."""

    log_dir: Path
    started: list[ManagedProcess] = field(default_factory=list)

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> ManagedProcess:
        log = self.log_dir / f"{name}.log"
        fh = open(log, "wb")  # noqa: SIM115 - closed by the child's exit; kept for the popen lifetime
        try:
            popen = subprocess.Popen(
                args, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.log_dir,
                env={**os.environ, **(env or {})}, start_new_session=True,
            )
        finally:
            fh.close()
        proc = ManagedProcess(name, args, popen, log)
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            proc.stop()

    def report(self) -> str:
        return "\n".join(f"--- {p.name} (rc={p.popen.poll()}) {' '.join(p.args)}\n{p.tail()}" for p in self.started)


@pytest.fixture(scope="module")
def processes(tmp_path_factory) -> Iterator[Processes]:
    procs = Processes(tmp_path_factory.mktemp("ops-logs"))
    try:
        yield procs
    finally:
        procs.stop_all()


# How the ops tests poll a server they started: a few times a second, an error (not up yet, no data yet)
# counting as "not yet".
POLL_INTERVAL_S = 0.25
NOT_YET = (Exception,)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    assert url.startswith("http://127.0.0.1:"), url  # all traffic stays on loopback
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback only
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def http_json(url: str, params: dict[str, str] | None = None) -> dict:
    if params:
        url += "?" + urllib.parse.urlencode(params)
    status, body = http_get(url)
    data = json.loads(body)
    if status != 200:
        raise AssertionError(f"HTTP {status} from {url}: {data}")
    return data


def is_ready(base: str) -> bool:
    status, _ = http_get(base + "/-/ready", timeout=1.0)
    return status == 200


def start_prometheus(processes: Processes, config: Path, workdir: Path) -> str:
    binary = require_binary("prometheus")
    port = free_port()
    processes.start("prometheus", [
        binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}", "--enable-feature=exemplar-storage",
        "--web.enable-lifecycle",
    ])
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: is_ready(base), "Prometheus /-/ready", timeout=20, interval=POLL_INTERVAL_S, ignoring=NOT_YET,
               on_timeout=processes.report)
    return base


def start_alertmanager(processes: Processes, config: Path, workdir: Path) -> str:
    binary = require_binary("prometheus-alertmanager", "alertmanager")
    port = free_port()
    processes.start("alertmanager", [
        binary, f"--config.file={config}", f"--storage.path={workdir / 'am-data'}",
        f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
    ])
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: is_ready(base), "Alertmanager /-/ready", timeout=20, interval=POLL_INTERVAL_S,
               ignoring=NOT_YET, on_timeout=processes.report)
    return base


def prom_query(base: str, expr: str) -> list[dict]:
    """Instant query; raises with Prometheus' error message when the expression does not evaluate."""
    data = http_json(base + "/api/v1/query", {"query": expr})
    if data.get("status") != "success":
        raise AssertionError(f"{expr!r}: {data}")
    return data["data"]["result"]


# -------------------------------------------------------------------------------------------- webhook


class WebhookReceiver:
    """A tiny Alertmanager webhook receiver on 127.0.0.1: collects every POSTed payload."""

    def __init__(self) -> None:
        self.payloads: list[dict] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver._lock:
                    receiver.payloads.append(json.loads(body or b"{}"))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, name="webhook", daemon=True)

    def __enter__(self) -> "WebhookReceiver":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def alerts(self) -> list[dict]:
        with self._lock:
            return [dict(a, receiver=p.get("receiver")) for p in self.payloads for a in p.get("alerts", [])]

    def firing(self, alertname: str) -> list[dict]:
        return [a for a in self.alerts() if a.get("status") == "firing" and a["labels"].get("alertname") == alertname]


# ------------------------------------------------------------------------------------ rules and yaml


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def rule_files() -> list[Path]:
    return sorted(RULES_DIR.glob("*.yml"))


def all_rules() -> list[dict]:
    return [r for f in rule_files() for g in load_yaml(f)["groups"] for r in g["rules"]]


def alert_rules() -> list[dict]:
    return [r for r in all_rules() if "alert" in r]


def recording_rules() -> list[dict]:
    return [r for r in all_rules() if "record" in r]


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS_DIR.glob("*.json"))}


def iter_panels(dash: dict) -> Iterator[dict]:
    for panel in dash.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # collapsed rows


def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    """(panel title, expr) for every panel target of a dashboard."""
    return [(p["title"], t["expr"]) for p in iter_panels(dash) for t in p.get("targets", []) if t.get("expr")]


def variable_queries(dash: dict) -> list[tuple[str, str]]:
    out = []
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]
            out.append((var["name"], q["query"] if isinstance(q, dict) else q))
    return out


LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def label_values_as_promql(query: str) -> str:
    """Grafana's `label_values(selector, label)` as an equivalent PromQL query that returns one series per value."""
    m = LABEL_VALUES.match(query.strip())
    assert m, f"unsupported variable query {query!r}"
    return f"count by ({m['label']}) ({m['selector']})"


def substitute_grafana_vars(expr: str, values: dict[str, str] | None = None) -> str:
    """Replace Grafana's variables with concrete values so the expression can run on Prometheus itself."""
    builtins = {"__rate_interval": "10s", "__interval": "2s", "__range": "1m", "__range_s": "60"}
    merged = {**builtins, **(values or {})}

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        return merged.get(name, ".*")

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", repl, expr)


def split_threshold(expr: str) -> tuple[str, str, str]:
    """Split `<signal> <op> <threshold>` at its last top-level comparison."""
    depth, found = 0, None
    text = " ".join(expr.split())
    i = 0
    while i < len(text):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == '"':
            i = text.index('"', i + 1)
        elif depth == 0:
            for op in ("==", "!=", ">=", "<=", ">", "<"):
                if text.startswith(op, i):
                    found = (i, op)
                    i += len(op) - 1
                    break
        i += 1
    assert found, f"no top-level comparison in {expr!r}"
    pos, op = found
    lhs, rhs = text[:pos].strip(), text[pos + len(op):].strip()
    assert re.fullmatch(r"-?[0-9.e+-]+", rhs), f"threshold of {expr!r} is not a number: {rhs!r}"
    return lhs, op, rhs


# ------------------------------------------------------------------------ PromQL names vs. semconv


PROMQL_WORDS = {
    # aggregations and their modifiers
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "and", "or", "unless", "inf", "nan",
}
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}")
MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


@dataclass
class ExprNames:
    metrics: set[str] = field(default_factory=set)
    grouping_labels: set[str] = field(default_factory=set)
    # (metric or None, label, op, value) for every label matcher
    matchers: list[tuple[str | None, str, str, str]] = field(default_factory=list)


def parse_names(expr: str) -> ExprNames:
    """Metric names, grouping labels and label matchers of a PromQL expression (Grafana vars substituted)."""
    text = substitute_grafana_vars(expr)
    out = ExprNames()
    for m in SELECTOR.finditer(text):
        for lm in MATCHER.finditer(m.group(2)):
            out.matchers.append((m.group(1), lm.group(1), lm.group(2), lm.group(3)))
        if m.group(1) and m.group(1) not in PROMQL_WORDS:
            out.metrics.add(m.group(1))
    text = SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", text)
    for g in GROUPING.finditer(text):
        out.grouping_labels.update(x.strip() for x in g.group(2).split(",") if x.strip())
    text = GROUPING.sub(" ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery durations
    text = re.sub(r'"(?:[^"\\]|\\.)*"', " ", text)
    for m in IDENT.finditer(text):
        word = m.group(0)
        rest = text[m.end():].lstrip()
        if rest.startswith("(") or word.lower() in PROMQL_WORDS:
            continue  # a function call or keyword
        if re.fullmatch(r"[0-9.]+(e[0-9]+)?", word):
            continue
        out.metrics.add(word)
    return out


def exposed_series() -> dict[str, tuple[set[str], str]]:
    """Every series name kvobs exposes -> (its label names, the contract name in semconv).

    Built by registering kvobs' real metric families on a fresh registry, so types (counter -> `_total`,
    histogram -> `_bucket/_sum/_count` + `le`) come from the code, and checked against semconv.METRIC_LABELS.
    Every series also carries `job` and `instance` (added by Prometheus).
    """
    from kvobs.telemetry._metrics.families import MetricFamilies

    registry = CollectorRegistry()
    MetricFamilies.of(registry)
    target = {"job", "instance"}
    out: dict[str, tuple[set[str], str]] = {}
    for fam in registry.collect():
        if fam.type == "counter":
            contract = fam.name + "_total"
            out[contract] = (set(sc.METRIC_LABELS[contract]) | target, contract)
        elif fam.type == "histogram":
            contract = fam.name
            labels = set(sc.METRIC_LABELS[contract]) | target
            out[contract + "_bucket"] = (labels | {"le"}, contract)
            out[contract + "_sum"] = (labels, contract)
            out[contract + "_count"] = (labels, contract)
        else:
            contract = fam.name
            out[contract] = (set(sc.METRIC_LABELS[contract]) | target, contract)
        assert contract in sc.METRIC_LABELS, f"{contract} is registered but not in semconv.METRIC_LABELS"
    out["up"] = (target, "up")  # Prometheus' own per-target series
    return out


def recording_rule_labels() -> dict[str, set[str]]:
    """Recording rule name -> the labels of its output (its `by` clause, without `le`)."""
    series = exposed_series()
    out: dict[str, set[str]] = {}
    for rule in recording_rules():
        names = parse_names(rule["expr"])
        if names.grouping_labels:
            out[rule["record"]] = names.grouping_labels - {"le"}
        else:
            out[rule["record"]] = set().union(*(series[m][0] for m in names.metrics)) - {"le"}
    return out


def allowed_values(metric: str | None, label: str) -> tuple[str, ...] | None:
    """The values semconv defines for a label of a metric, or None if any value is fine."""
    if label == sc.LABEL_PATH:
        return sc.PATHS
    if label == sc.LABEL_RESULT:
        return sc.CHECK_RESULTS
    if label == sc.LABEL_OUTCOME and metric:
        if metric.startswith(sc.SIGNALS_TOTAL):
            return sc.SIGNAL_OUTCOMES
        if metric.startswith(sc.PREFIX):
            return sc.TRANSFER_OUTCOMES
    return None


def check_expr_names(expr: str, where: str) -> list[str]:
    """Problems with the names an expression uses; empty when every metric, label and value is in the contract."""
    series = exposed_series()
    recorded = recording_rule_labels()
    problems: list[str] = []
    names = parse_names(expr)
    if not names.metrics:
        problems.append(f"{where}: no metric found in {expr!r}")
    available: set[str] = set()
    for metric in names.metrics:
        if metric in series:
            available |= series[metric][0]
        elif metric in recorded:
            available |= recorded[metric]
        else:
            problems.append(f"{where}: {metric!r} is neither a kvobs series (semconv) nor a recording rule in deploy/")
    for metric, label, op, value in names.matchers:
        labels = series[metric][0] if metric in series else recorded.get(metric, available)
        if label not in labels:
            problems.append(f"{where}: label {label!r} does not exist on {metric or 'the selected series'}")
        allowed = allowed_values(metric, label)
        if allowed and value != ".*":
            for alternative in value.split("|"):
                if re.fullmatch(r"\w+", alternative) and alternative not in allowed:
                    problems.append(f"{where}: {label}={alternative!r} is not one of {allowed}")
    for label in names.grouping_labels - available:
        problems.append(f"{where}: grouping label {label!r} exists on none of {sorted(names.metrics)}")
    return problems


def runbook_anchors() -> set[str]:
    """GitHub-style anchors of the runbook's headings."""
    anchors = set()
    for line in RUNBOOK.read_text().splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug)
    return anchors
