"""Export through the real parts: OTLP to a gRPC receiver, OpenMetrics exemplars, multiprocess metrics."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from urllib.request import Request, urlopen

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics
from support import lock_is_free, otlp_receiver

import kvobs
from kvobs import semconv as sc
from kvobs.telemetry._tracing import otlp_exporter


@pytest.fixture
def receiver():
    with otlp_receiver() as (servicer, port):
        yield servicer, port


def attrs(span):
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = v.string_value or v.int_value or v.double_value or v.bool_value or list(v.array_value.values)
    return out


def test_real_otlp_exporter_delivers_name_attributes_and_error_status(receiver, registry, monkeypatch):
    servicer, port = receiver
    monkeypatch.setenv("OTEL_SERVICE_NAME", "engine-under-test")
    provider = kvobs.configure_tracing(endpoint=f"http://127.0.0.1:{port}", set_global=False)
    obs = kvobs.KVObserver("otlp", registry=registry, tracer_provider=provider, integrity=None)

    @obs.write_back(block_ids="ids", keys="keys")
    def write(keys, ids):
        return "ok"

    @obs.prefetch(block_ids="ids")
    def fetch(ids):
        raise OSError("storage unreachable")

    write(["k1", "k2"], [1, 2])
    with pytest.raises(OSError):
        fetch([3])
    provider.force_flush()
    provider.shutdown()
    spans = {span.name: (service, span) for service, span in servicer.spans}
    assert set(spans) == {"kvobs.write_back", "kvobs.prefetch"}
    service, ok = spans["kvobs.write_back"]
    assert service["service.name"] == "engine-under-test"
    a = attrs(ok)
    assert a[sc.ATTR_ENGINE] == "otlp" and a[sc.ATTR_PATH] == "write_back" and a[sc.ATTR_BLOCKS] == 2
    assert a[sc.ATTR_OUTCOME] == "ok"
    _, failed = spans["kvobs.prefetch"]
    assert failed.status.code == 2  # STATUS_CODE_ERROR
    assert attrs(failed)[sc.ATTR_ERROR_TYPE] == "OSError"
    assert "storage unreachable" in failed.status.message


def test_http_protobuf_exporter_is_chosen_from_the_environment(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    exporter = otlp_exporter(endpoint="http://127.0.0.1:4318")
    assert type(exporter).__module__.endswith("http.trace_exporter")
    assert exporter._endpoint == "http://127.0.0.1:4318/v1/traces"
    with pytest.raises(ValueError, match="unsupported OTLP protocol 'carrier-pigeon'"):
        otlp_exporter(protocol="carrier-pigeon")


def test_exporter_that_is_down_never_changes_result_or_exception(registry):
    provider = TracerProvider()
    dead = otlp_exporter(endpoint="http://127.0.0.1:9", protocol="grpc", timeout=0.2)
    provider.add_span_processor(SimpleSpanProcessor(dead))
    obs = kvobs.KVObserver("down", registry=registry, tracer_provider=provider, integrity=None)
    err = KeyError("engine's own")

    @obs.send(block_ids="ids")
    def send(ids, fail=False):
        if fail:
            raise err
        return sum(ids)

    assert send([1, 2]) == 3
    with pytest.raises(KeyError) as info:
        send([1], fail=True)
    assert info.value is err
    assert lock_is_free(obs.lock)
    assert registry.get_sample_value(sc.TRANSFERS_TOTAL, {"engine": "down", "path": "send", "outcome": "ok"}) == 1
    provider.shutdown()


def test_hook_that_raises_is_counted_not_raised(registry):
    seen = []

    def broken_hook(record):
        raise RuntimeError("hook bug")

    obs = kvobs.KVObserver("hooks", registry=registry, hooks=[broken_hook, seen.append], integrity=None)

    @obs.prefetch(block_ids="ids")
    def fetch(ids):
        return "data"

    assert fetch([1, 2]) == "data"
    assert seen[0].outcome == "ok" and seen[0].blocks == 2 and seen[0].path == "prefetch"
    assert registry.get_sample_value(sc.TELEMETRY_ERRORS_TOTAL, {"engine": "hooks", "stage": "hook"}) == 1


def test_exemplars_carry_the_trace_id_only_when_recording(registry):
    provider = TracerProvider()
    obs = kvobs.KVObserver("ex", registry=registry, tracer_provider=provider, integrity=None)

    @obs.write_back(block_ids="ids")
    def write(ids):
        return None

    write([1])
    text = openmetrics(registry).decode()
    lines = [l for l in text.splitlines() if l.startswith(sc.LOCK_WAIT_SECONDS + "_bucket") and "trace_id" in l]
    assert len(lines) == 1 and 'engine="ex"' in lines[0]

    unsampled = kvobs.KVObserver("ex2", registry=registry, tracer_provider=TracerProvider(sampler=ALWAYS_OFF),
                                 integrity=None)

    @unsampled.write_back(block_ids="ids")
    def write2(ids):
        return None

    write2([1])
    text = openmetrics(registry).decode()
    assert not [l for l in text.splitlines() if 'engine="ex2"' in l and "trace_id" in l]


def test_no_tracer_configured_means_no_span_work(registry):
    obs = kvobs.KVObserver("nospan", registry=registry, integrity=None)
    assert obs.tracer_source.get() is None


def test_metrics_server_binds_loopback_and_serves_openmetrics(registry):
    kvobs.KVObserver("srv", registry=registry, integrity=None)  # registers the families
    server, thread = kvobs.start_metrics_server(0, registry=registry)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        req = Request(f"http://127.0.0.1:{port}/metrics",
                      headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        body = urlopen(req, timeout=5).read().decode()
        assert sc.BUILD_INFO in body and sc.LOCK_HELD_SECONDS in body
    finally:
        server.shutdown()


WORKER = textwrap.dedent("""
    import sys, kvobs
    obs = kvobs.KVObserver("mp", integrity=None)
    @obs.write_back(block_ids="ids")
    def write(ids):
        return None
    for _ in range(int(sys.argv[1])):
        write([1, 2, 3])
    print("done")
""")


def test_multiprocess_mode_two_real_workers_add_up(tmp_path):
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp_dir)}
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(n)], env=env, stdout=subprocess.PIPE, text=True)
               for n in (5, 7)]
    for w in workers:
        out, _ = w.communicate(timeout=60)
        assert w.returncode == 0 and "done" in out
    scrape = textwrap.dedent("""
        from kvobs.telemetry._metrics.exposition import scrape_registry
        r = scrape_registry()
        print(r.get_sample_value("kvobs_transfers_total", {"engine": "mp", "path": "write_back", "outcome": "ok"}))
        print(r.get_sample_value("kvobs_transfer_blocks_total", {"engine": "mp", "path": "write_back"}))
        print(r.get_sample_value("kvobs_lock_wait_seconds_count", {"engine": "mp", "lock": "thread", "path": "write_back"}))
    """)
    out = subprocess.run([sys.executable, "-c", scrape], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["12.0", "36.0", "12.0"]


HOLDER = textwrap.dedent("""
    import sys, time, kvobs
    obs = kvobs.KVObserver("mp-held", integrity=None)
    @obs.write_back(block_ids="ids")
    def slow(ids):
        print("holding", flush=True)
        sys.stdin.readline()  # until the test has scraped: a holder that has ended shows no held time
    slow([1])
""")


def test_multiprocess_lock_held_gauge_is_refreshed_while_the_holder_is_stuck(tmp_path):
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp_dir)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    scrape = textwrap.dedent("""
        from kvobs.telemetry._metrics.exposition import scrape_registry
        print(scrape_registry().get_sample_value("kvobs_lock_held_seconds", {"engine": "mp-held", "lock": "thread"}))
    """)

    def held() -> float:
        out = subprocess.run([sys.executable, "-c", scrape], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return float(out.stdout)

    try:
        assert holder.stdout.readline().strip() == "holding"
        time.sleep(1.0)
        first = held()
        time.sleep(1.0)
        second = held()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert 0 < first < second


def test_capture_with_a_tracer_provider_of_ones_own():
    from opentelemetry.sdk.trace import TracerProvider

    from kvobs.testing import capture

    provider = TracerProvider()
    with capture(tracer_provider=provider, integrity=None) as cap:
        cap.observer.begin("send", block_ids=[1]).complete()
        assert [s.name for s in cap.spans] == ["kvobs.send"]
    provider.get_tracer("still-running").start_span("after").end()  # not shut down by capture
