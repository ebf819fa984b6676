"""Small helpers shared by the tests: probing a real lock, and an OTLP/gRPC trace receiver."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def lock_is_free(lock) -> bool:
    """Probe a real lock: free means it can be taken (and is then given back) at once."""
    if lock.acquire(0):
        lock.release()
        return True
    return False


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
