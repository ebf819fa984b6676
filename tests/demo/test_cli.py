"""The `kvobs` command: arguments, the `--json` schema, `--serve` and its metrics, clean shutdown."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families
from support import otlp_receiver

from kvobs import semconv as sc
from kvobs.cli import build_parser, demo_metrics_port, main
from kvobs.demo.report import EXTRA_FIELDS, NULLABLE_FIELDS, RUN_FIELDS, SCHEMA_VERSION

DEMO_PATHS = (sc.PATH_PREFETCH, sc.PATH_WRITE_BACK, sc.PATH_SEND)  # the simulated engine has no decode side

ENV = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "PYTHONUNBUFFERED": "1"}
ENV.pop("PROMETHEUS_MULTIPROC_DIR", None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvobs_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvobs", *args]


def test_parser_contract():
    args = build_parser().parse_args([
        "demo", "--duration", "3", "--seed", "7", "--metrics-port", "0", "--metrics-addr", "127.0.0.1",
        "--serve", "--otlp-endpoint", "http://127.0.0.1:4317", "--json", "--fault", "stale-signal",
        "--fault", "nan", "--quiet",
    ])
    assert (args.duration, args.seed, args.metrics_port, args.metrics_addr) == (3.0, 7, 0, "127.0.0.1")
    assert args.serve and args.json and args.quiet
    assert args.fault == ["stale-signal", "nan"]
    assert args.otlp_endpoint == "http://127.0.0.1:4317"
    defaults = build_parser().parse_args(["demo"])
    # --duration and --metrics-addr default to "not given": their meaning depends on --serve and --metrics-port
    assert (defaults.duration, defaults.seed, defaults.fault, defaults.serve) == (None, 0, [], False)
    assert (defaults.metrics_port, defaults.metrics_addr) == (None, None)


@pytest.mark.parametrize("bad, message", [
    (["demo", "--fault", "bogus"], "argument --fault: invalid choice: 'bogus'"),
    (["demo", "--duration", "0"], "argument --duration: expected a positive, finite number of seconds, got '0'"),
    (["demo", "--duration", "abc"], "argument --duration: expected a positive number of seconds, got 'abc'"),
    (["demo", "--duration", "inf"], "argument --duration: expected a positive, finite number of seconds, got 'inf'"),
    (["demo", "--duration", "nan"], "argument --duration: expected a positive, finite number of seconds, got 'nan'"),
    (["demo", "--duration", "1e308"], "argument --duration: expected at most 86400 seconds (one day), got '1e308'"),
    (["demo", "--seed", "x"], "argument --seed: expected a whole number, got 'x'"),
    (["demo", "--metrics-port", "70000"], "argument --metrics-port: expected a TCP port from 0 to 65535, got '70000'"),
    (["demo", "--metrics-port", "abc"], "argument --metrics-port: expected a TCP port from 0 to 65535, got 'abc'"),
    (["demo", "--otlp-endpoint", "localhost"], "argument --otlp-endpoint: expected an http:// or https:// URL"),
    (["demo", "--otlp-endpoint", "http://h:99999"], "argument --otlp-endpoint: expected an http:// or https:// URL"),
    (["demo", "--serve", "--metrics-port", "0"], "--metrics-port 0 would serve nothing"),
    (["demo", "--serve", "--json"], "--json prints the comparison's summary; --serve prints none"),
    (["demo", "--metrics-port", "0", "--metrics-addr", "::"], "--metrics-addr has no effect when metrics are not"),
    (["demo", "--metrics-addr", "::"], "--metrics-addr has no effect when metrics are not served"),
    ([], "the following arguments are required: COMMAND"),
])
def test_bad_arguments_exit_2_with_a_message_naming_the_flag(bad, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(bad)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not re.search(r"invalid \w+ value", err), err  # argparse's wording with an internal function name


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("kvobs ")


def check_schema(doc: dict) -> None:
    """The documented --json schema (docs/demo.md), version 3."""
    assert doc["schema_version"] == SCHEMA_VERSION == 3
    assert isinstance(doc["seed"], int)
    assert isinstance(doc["duration_s"], float)
    assert isinstance(doc["faults"], list)
    assert isinstance(doc["kvobs_version"], str) and isinstance(doc["lock_wait_source"], str)
    assert list(doc["runs"]) == ["unguarded", "global_lock", "block_lock"]
    for name, run in doc["runs"].items():
        assert run["mode"] == name
        for key, typ in (*((k, t) for k, _, t in RUN_FIELDS), *EXTRA_FIELDS):
            if key in NULLABLE_FIELDS and run[key] is None:
                continue
            assert type(run[key]) is typ, (name, key, run[key])
        assert run["transfers_done"] == run["prefetch_done"] + run["write_back_done"] + run["send_done"]
    assert set(doc["incidents"]) == {"unguarded_nan_incident", "unguarded_hang_incident", "global_lock_clean",
                                     "block_lock_clean"}
    assert all(isinstance(v, bool) for v in doc["incidents"].values())
    assert list(doc["targets"]) == ["forward_lock_wait_p99", "forward_lock_wait_total", "throughput"]
    for target in doc["targets"].values():
        assert target["run"] == "block_lock" and target["required"] == 0.9
        score = target.get("reduction", target.get("ratio"))
        # a baseline that measured nothing (a 0 on a loaded machine) has a null score and `met` (docs/demo.md)
        assert (isinstance(target["met"], bool) and isinstance(score, float)) or target["met"] is score is None


def test_json_summary_on_stdout_progress_on_stderr():
    proc = subprocess.run(
        kvobs_cmd("demo", "--json", "--duration", "1.5", "--seed", "5", "--metrics-port", "0"),
        capture_output=True, text=True, timeout=90, env=ENV,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # nothing but the JSON document on stdout
    check_schema(doc)
    assert (doc["seed"], doc["duration_s"], doc["faults"]) == (5, 1.5, [])
    assert doc["incidents"]["global_lock_clean"] is doc["incidents"]["block_lock_clean"] is True
    assert [run["guarded"] for run in doc["runs"].values()] == [False, True, True]
    assert all(doc["runs"]["unguarded"][key] is None for key in NULLABLE_FIELDS)  # it takes no lock
    for name in ("global_lock", "block_lock"):
        assert all(isinstance(doc["runs"][name][key], float) for key in NULLABLE_FIELDS), name
    assert "[unguarded]" in proc.stderr and "[global_lock]" in proc.stderr and "[block_lock]" in proc.stderr
    assert "traces: recorded in-process, not exported" in proc.stderr


def test_otlp_endpoint_receives_the_demo_spans():
    with otlp_receiver() as (receiver, port):
        proc = subprocess.run(
            kvobs_cmd("demo", "--duration", "0.5", "--metrics-port", "0", "--quiet",
                      "--otlp-endpoint", f"http://127.0.0.1:{port}"),
            capture_output=True, text=True, timeout=90, env=ENV,
        )
        assert proc.returncode == 0, proc.stderr
    names = {span.name for _, span in receiver.spans}
    assert {sc.span_name(path) for path in DEMO_PATHS} <= names, names
    assert {service.get("service.name") for service, _ in receiver.spans} == {"kvobs-demo"}


@contextlib.contextmanager
def busy_port():
    """A loopback port that something is already listening on."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield busy.getsockname()[1]


def test_a_plain_demo_opens_no_port():
    """Without --metrics-port (or --serve) the demo has no effect on the host beyond its output: its own
    default port stays free, and nothing warns when something else holds it."""
    with socket.socket() as held:
        try:
            held.bind(("127.0.0.1", 9464))
        except OSError:
            pytest.skip("port 9464 is in use here; the test needs to hold it")
        held.listen()
        proc = subprocess.Popen(kvobs_cmd("demo", "--duration", "1"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=ENV)
        try:
            out, err = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err
    assert "NaN blocks written to storage" in out
    assert "metrics" not in err.lower(), err
    assert build_parser().parse_args(["demo"]).metrics_port is None


def test_serve_alone_serves_on_the_default_port():
    args = build_parser().parse_args(["demo", "--serve"])
    assert args.metrics_port is None  # --serve serves on 9464 unless --metrics-port says otherwise
    assert demo_metrics_port(args) == 9464
    assert demo_metrics_port(build_parser().parse_args(["demo"])) == 0
    assert demo_metrics_port(build_parser().parse_args(["demo", "--metrics-port", "9100"])) == 9100


def test_table_and_busy_metrics_port_is_only_a_warning():
    with busy_port() as port:
        proc = subprocess.run(
            kvobs_cmd("demo", "--duration", "1", "--metrics-port", str(port), "--quiet"),
            capture_output=True, text=True, timeout=90, env=ENV,
        )
    assert proc.returncode == 0, proc.stderr
    assert "warning: cannot serve metrics" in proc.stderr
    assert "NaN blocks written to storage" in proc.stdout
    assert "lost layer0 signals" in proc.stdout and "unguarded" in proc.stdout
    assert "[unguarded]" not in proc.stderr  # --quiet


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()


def samples(text: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def value(text: str, name: str, **labels: str) -> float:
    return sum(s.value for s in samples(text) if s.name == name and labels.items() <= s.labels.items())


def has_metric(text: str, name: str, labels: tuple[str, ...]) -> bool:
    names = {name, name + "_bucket", name + "_count", name + "_sum"}
    return any(s.name in names and set(labels) <= set(s.labels) for s in samples(text))


@pytest.fixture
def serving():
    port = free_port()
    proc = subprocess.Popen(
        kvobs_cmd("demo", "--serve", "--metrics-port", str(port), "--metrics-addr", "127.0.0.1",
                  "--fault", "stale-signal", "--fault", "nan"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )
    try:
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def wait_scrape(proc, port: int, timeout: float = 30.0) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, proc.stderr.read()
        try:
            return scrape(port)
        except OSError:
            time.sleep(0.2)
    raise AssertionError("the --serve endpoint never answered")


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_serve_exports_every_metric_with_traffic_and_stops_cleanly(serving, stop_signal):
    proc, port = serving
    wait_scrape(proc, port)
    time.sleep(3.0)
    first = scrape(port)
    for name, labels in sc.METRIC_LABELS.items():
        assert has_metric(first, name, labels), name
    engines = {s.labels["engine"] for s in samples(first) if "engine" in s.labels}
    assert engines == {"demo-global-lock", "demo-block-lock"}
    for path in DEMO_PATHS:
        assert value(first, sc.TRANSFERS_TOTAL, path=path, outcome="ok") > 0, path
        assert value(first, sc.LOCK_WAIT_SECONDS + "_count", path=path) > 0, path
        assert value(first, sc.LOCK_HOLD_SECONDS + "_count", path=path) > 0, path
    assert value(first, sc.PENDING_SIGNALS) >= 1
    age1 = value(first, sc.PENDING_SIGNAL_OLDEST_AGE_SECONDS)
    nan1 = value(first, sc.NAN_CHECKS_TOTAL, result="nan")

    time.sleep(2.0)
    second = scrape(port)
    assert value(second, sc.PENDING_SIGNAL_OLDEST_AGE_SECONDS) > age1 + 1.0  # the stale signal keeps ageing
    assert value(second, sc.NAN_CHECKS_TOTAL, result="nan") > nan1  # poisoned entries keep being found
    for path in DEMO_PATHS:
        assert value(second, sc.TRANSFERS_TOTAL, path=path, outcome="ok") > value(
            first, sc.TRANSFERS_TOTAL, path=path, outcome="ok"), path

    proc.send_signal(stop_signal)
    assert proc.wait(15) == 0
    err = proc.stderr.read()
    assert "stopped after" in err, err
    assert "Traceback" not in err, err


def trace_exemplars(port: int) -> list:
    """The trace ids on the transfer-latency buckets of an OpenMetrics scrape (what Prometheus stores)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    text = urllib.request.urlopen(request, timeout=2).read().decode()
    return [s.exemplar.labels["trace_id"] for fam in openmetrics_families(text) for s in fam.samples
            if s.name == sc.TRANSFER_DURATION_SECONDS + "_bucket" and s.exemplar is not None]


def test_serve_for_a_duration_stops_by_itself_and_its_metrics_carry_trace_exemplars_without_an_endpoint():
    port = free_port()
    proc = subprocess.Popen(kvobs_cmd("demo", "--serve", "--duration", "4", "--metrics-port", str(port)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        wait_scrape(proc, port)
        exemplars: list = []
        while not exemplars and proc.poll() is None:
            time.sleep(0.3)
            with contextlib.suppress(OSError):
                exemplars = trace_exemplars(port)
        assert exemplars and all(re.fullmatch(r"[0-9a-f]{32}", t) and set(t) != {"0"} for t in exemplars)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    err = proc.stderr.read()
    assert "for 4 s" in err and "traces: recorded in-process, not exported" in err and "stopped after" in err, err


def test_serve_on_a_busy_port_fails_fast():
    with busy_port() as port:
        proc = subprocess.run(
            kvobs_cmd("demo", "--serve", "--metrics-port", str(port), "--quiet"),
            capture_output=True, text=True, timeout=60, env=ENV,
        )
    assert proc.returncode == 2
    assert "cannot serve metrics" in proc.stderr
