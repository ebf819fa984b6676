"""Export kvobs spans (kvobs.prefetch, kvobs.write_back, kvobs.send) to an OpenTelemetry collector over OTLP.

The endpoint comes from OTEL_EXPORTER_OTLP_ENDPOINT (default http://localhost:4317, OTLP/gRPC), the service
name from OTEL_SERVICE_NAME. kvobs never sets the global tracer provider itself: this script hands its own
provider to the observer. When nothing listens, the export fails after the exporter's short timeout and the
script still ends promptly: telemetry never breaks or blocks the transfers.

Run: OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4317 python examples/otlp_export.py
"""

from __future__ import annotations

import os

import numpy as np
from prometheus_client import CollectorRegistry

import kvobs

ENDPOINT = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4317")


def main() -> None:
    # A short export timeout bounds shutdown when the collector is down (the SDK default is 10 s).
    # OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf switches to OTLP/HTTP.
    provider = kvobs.configure_tracing(
        os.environ.get("OTEL_SERVICE_NAME", "kvobs-otlp-example"), endpoint=ENDPOINT, timeout=2, set_global=False
    )
    obs = kvobs.KVObserver("otlp-example", tracer_provider=provider, registry=CollectorRegistry(), capacity=32)
    # The engine's KV cache (a NumPy array here; a torch or Paddle tensor is checked the same way).
    gpu_cache = np.random.default_rng(0).standard_normal((32, 16, 4, 32)).astype(np.float16)
    storage: dict[str, np.ndarray] = {}

    @obs.write_back(keys="keys", block_ids="block_ids", cache=gpu_cache, request_id="request_id")
    def write_back(request_id: str, keys: list[str], block_ids: list[int]) -> None:
        for key, block in zip(keys, block_ids):
            storage[key] = gpu_cache[block].copy()

    @obs.prefetch(keys="keys", block_ids="block_ids", cache=gpu_cache, request_id="request_id")
    def prefetch(request_id: str, keys: list[str], block_ids: list[int]) -> None:
        for key, block in zip(keys, block_ids):
            gpu_cache[block] = storage[key]

    write_back("req-1", ["k0", "k1"], [0, 1])
    prefetch("req-2", ["k0", "k1"], [4, 5])
    # As a context manager every spec is the value itself.
    with obs.transfer("send", block_ids=[4, 5], cache=gpu_cache, request_id="req-2"):
        pass  # the layer-by-layer send to the decode node goes here

    provider.shutdown()  # flushes the batch; bounded by the exporter timeout above
    print(f"3 spans (kvobs.write_back, kvobs.prefetch, kvobs.send) handed to the OTLP exporter for {ENDPOINT}")


if __name__ == "__main__":
    main()
