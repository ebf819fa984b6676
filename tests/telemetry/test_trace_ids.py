"""Trace and span ids are unique in every process, whatever the application does to `random`.

vLLM seeds Python's `random` with 0 in every engine process; the OpenTelemetry SDK's default id generator draws
from `random`, so every engine's first spans carried the same ids. Each scenario runs in fresh interpreters
that seed `random` alike, and compares the ids they print.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent("""
    import os, random, sys
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    import kvobs

    def print_ids(exporter):
        for span in exporter.get_finished_spans():
            print(f"{span.context.trace_id:032x}-{span.context.span_id:016x}")
        exporter.clear()

    def kvobs_spans(provider, engine):
        obs = kvobs.KVObserver(engine, tracer_provider=provider, integrity=None)
        random.seed(0)  # what vLLM does in every engine process, after kvobs is set up
        for _ in range(3):
            obs.begin("send", block_ids=[1]).complete()
""")

OWN_PROVIDER = PRELUDE + textwrap.dedent("""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # the SDK's default id generator, which draws from `random`
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    kvobs_spans(provider, "own")
    print_ids(exporter)
""")

CONFIGURED = PRELUDE + textwrap.dedent("""
    exporter = InMemorySpanExporter()
    provider = kvobs.configure_tracing("ids", exporter=exporter, set_global=False)
    random.seed(0)
    tracer = provider.get_tracer("the-application")
    for _ in range(3):
        tracer.start_span("app.step").end()  # the application's own spans, on the provider kvobs built
    kvobs_spans(provider, "configured")
    provider.force_flush()
    print_ids(exporter)
""")

FORKED = PRELUDE + textwrap.dedent("""
    exporter = InMemorySpanExporter()
    provider = kvobs.configure_tracing("ids", exporter=exporter, set_global=False)
    obs = kvobs.KVObserver("forked", tracer_provider=provider, integrity=None)
    obs.begin("send", block_ids=[1]).complete()  # the generator is in use before the fork
    provider.force_flush()
    exporter.clear()
    for _ in range(2):
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(reader)
            random.seed(0)
            for _ in range(3):
                obs.begin("send", block_ids=[1]).complete()
                provider.get_tracer("the-application").start_span("app.step").end()
            provider.force_flush()
            os.write(writer, "".join(
                f"{s.context.trace_id:032x}-{s.context.span_id:016x}\\n" for s in exporter.get_finished_spans()
            ).encode())
            os._exit(0)
        os.close(writer)
        with os.fdopen(reader) as pipe:
            sys.stdout.write(pipe.read())
        os.waitpid(pid, 0)
""")


def ids_printed(script: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    ids = out.stdout.split()
    assert ids, out.stderr
    return ids


def assert_unique(ids: list[str]) -> None:
    trace_ids = [i.split("-")[0] for i in ids]
    span_ids = [i.split("-")[1] for i in ids]
    assert len(set(span_ids)) == len(span_ids), f"span ids repeat: {sorted(span_ids)}"
    assert len(set(trace_ids)) == len(trace_ids), f"trace ids repeat: {sorted(trace_ids)}"


@pytest.mark.parametrize("script", [OWN_PROVIDER, CONFIGURED], ids=["a provider of ones own", "configure_tracing"])
def test_two_processes_that_seed_random_alike_get_different_ids(script):
    assert_unique(ids_printed(script) + ids_printed(script))


def test_forked_workers_that_seed_random_alike_get_different_ids():
    assert_unique(ids_printed(FORKED))
