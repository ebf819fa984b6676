"""Small helpers shared by the tests: waiting for a condition, probing a real lock, and an OTLP/gRPC trace
receiver."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import grpc
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)

REPO = Path(__file__).resolve().parents[1]

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T],
    what: str = "the condition",
    timeout: float = 30.0,
    *,
    interval: float = 0.01,
    ignoring: tuple[type[Exception], ...] = (),
    on_timeout: Callable[[], str] | None = None,
) -> T:
    """Poll `condition` until it returns a truthy value, which is returned. After `timeout` seconds the test
    fails naming `what` (and `on_timeout()`'s report). An error of a type in `ignoring` counts as "not yet"
    (the last one is named on timeout); any other error fails at once."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except ignoring as exc:
            last_error = exc
        if time.monotonic() >= deadline:
            detail = f"; last error: {last_error!r}" if last_error else ""
            report = ("\n" + on_timeout()) if on_timeout else ""
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{detail}{report}")
        time.sleep(interval)


@contextmanager
def process_holding(script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A separate interpreter running `script`, which prints "held" once it holds its lock and then sleeps:
    yielded once it holds, killed on exit (a real process, so the kernel's lock semantics are what is tested)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


def lock_is_free(lock) -> bool:
    """Probe a real lock: free means it can be taken (and is then given back) at once."""
    if lock.acquire(0):
        lock.release()
        return True
    return False


def hold_in_thread(lock, release_after: threading.Event | None = None) -> tuple[threading.Event, threading.Thread]:
    """Take `lock` in another thread, which lets go when `release_after` (or the returned event) is set; the
    caller's own thread then waits for it like any other."""
    holding = threading.Event()
    release = release_after or threading.Event()

    def run() -> None:
        assert lock.acquire(10)
        holding.set()
        release.wait(10)
        lock.release()

    thread = threading.Thread(target=run)
    thread.start()
    assert holding.wait(10)
    return release, thread


def lock_is_free_from_other_thread(lock) -> bool:
    """The same probe from another thread (a thread-owned lock says nothing to its own holder)."""
    result = []
    t = threading.Thread(target=lambda: result.append(lock_is_free(lock)))
    t.start()
    t.join()
    return result[0]


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: what the Collector would get, as (resource attributes, span) pairs."""

    def __init__(self):
        self.spans = []

    def Export(self, request, context):  # noqa: N802 - gRPC's name
        for resource_spans in request.resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend((service, span) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def otlp_receiver() -> Iterator[tuple[Receiver, int]]:
    """A receiver listening on a free loopback port; stopped on exit."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    receiver = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, port
    finally:
        server.stop(0)
