"""Telemetry back-ends: Prometheus metrics, OpenTelemetry tracing, structlog logs.

Metrics have a private engine of their own in a single process (`accumulators`, `buffers`, `buffered`,
`families`, with `path_metrics` and `engine_metrics` on top), because prometheus_client's children cannot
record at the rate of a guarded call: every `inc`/`observe` takes the child's lock and validates its value,
an exemplar is validated and formatted on every observe, and one transfer records seven values into three
histograms and three counters. kvobs's recording thread instead appends one flat record to its own buffer
(no lock, no per-value work), and the records are binned in batches when a buffer fills and before each
scrape. The exposition is prometheus_client's own format, byte for byte (`Metric`/`Sample` objects built
at scrape time), so nothing downstream can tell. `benchmarks/metrics.py` measures the same updates through
prometheus_client's children and through this engine in one run (the numbers are in docs/benchmarks.md).

Under PROMETHEUS_MULTIPROC_DIR the families are prometheus_client's own children (`path_metrics`), whose
values live in the per-process files that multiprocess mode reads; the buffering does not apply there.
"""
