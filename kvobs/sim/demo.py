"""Running the simulated engine for `kvobs demo`: the two-run comparison and the `--serve` mode.

Each run builds its own CollectorRegistry, so the two runs never mix metrics. During the comparison the
metrics endpoint serves whichever run is active; `--serve` serves the guarded engine's registry.
Progress goes to stderr (one line per second, or one rewritten line on a terminal); results go to stdout
(printed by the CLI).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from prometheus_client import CollectorRegistry

import kvobs
from kvobs.sim.engine import SimConfig, SimEngine
from kvobs.sim.report import run_summary, summary_dict

DEFAULT_METRICS_PORT = 9464
SERVE_SIGNAL_TTL_S = 3600.0  # a stale signal must stay pending (and age) while Prometheus watches
SERVE_PROGRESS_INTERVAL_S = 5.0


@dataclass
class DemoOptions:
    duration_s: float = 10.0  # per run
    seed: int = 0
    metrics_port: int = DEFAULT_METRICS_PORT  # 0: do not serve
    metrics_addr: str = "127.0.0.1"
    otlp_endpoint: str | None = None
    faults: frozenset[str] = frozenset()
    quiet: bool = False
    modes: tuple[str, ...] = ("unguarded", "guarded")
    config: SimConfig = field(default_factory=SimConfig)  # the template both runs start from


class _ActiveRun:
    """A collector that yields the metrics of the run in progress (the endpoint outlives each run)."""

    def __init__(self) -> None:
        self.registry: CollectorRegistry | None = None

    def collect(self) -> Any:
        registry = self.registry
        return registry.collect() if registry is not None else iter(())


class Progress:
    """A background thread printing one status line per interval to `stream`."""

    def __init__(self, stream: TextIO, interval: float, enabled: bool = True) -> None:
        self.stream = stream
        self.interval = interval
        self.enabled = enabled
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._line = lambda: ""
        self._width = 0

    def start(self, line: Any) -> None:
        if not self.enabled:
            return
        self._line = line
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvobs-demo-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._emit()

    def _emit(self) -> None:
        try:
            text = self._line()
            if self.tty:
                pad = max(0, self._width - len(text))
                self._width = len(text)
                self.stream.write("\r" + text + " " * pad)
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
        except Exception:  # noqa: BLE001 - progress must never break the run
            pass

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self.tty:  # leave the final state on the rewritten line
            self._emit()
            self.stream.write("\n")
            self.stream.flush()
        self._width = 0


def status_line(engine: SimEngine, duration_s: float | None) -> str:
    s = engine.stats
    clock = f"{engine.elapsed:5.1f}" + (f"/{duration_s:g} s" if duration_s else " s")
    return (
        f"[{s.mode}] {clock}  requests done {s.requests_completed}  hung {s.hung_sends}  "
        f"transfers {s.transfers_done}  NaN stored {s.nan_blocks_written_to_storage}  "
        f"NaN served {s.nan_blocks_served_to_prefix_hits}  layer0 lost {s.lost_layer0_signals}  "
        f"signals pending {engine.pending_signals()}"
    )


def otlp_endpoint(explicit: str | None) -> str | None:
    """--otlp-endpoint, else the standard OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT unless OTEL_TRACES_EXPORTER=none."""
    if explicit:
        return explicit
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")


def make_tracer_provider(endpoint: str | None) -> Any:
    """An SDK provider exporting to `endpoint` (None: no tracing). The exporter is kept for a bounded shutdown."""
    if not endpoint:
        return None
    from kvobs.telemetry.tracing import otlp_exporter

    service = os.environ.get("OTEL_SERVICE_NAME") or "kvobs-demo"
    exporter = otlp_exporter(endpoint=endpoint)
    provider = kvobs.configure_tracing(service, exporter=exporter, set_global=False)
    provider._kvobs_demo_exporter = exporter
    return provider


def _shutdown_tracing(provider: Any, flush_s: float = 2.0) -> None:
    """Flush for at most `flush_s`, then stop. The SDK's BatchSpanProcessor ignores force_flush's timeout, and
    with the collector down its export retries for up to the exporter's timeout (10 s): flush on a helper
    thread, and shut the exporter down first, which ends any retry in progress."""
    if provider is None:
        return
    try:
        flusher = threading.Thread(target=provider.force_flush, name="kvobs-demo-flush", daemon=True)
        flusher.start()
        flusher.join(flush_s)
        exporter = getattr(provider, "_kvobs_demo_exporter", None)
        if exporter is not None:
            exporter.shutdown()
        provider.shutdown()
    except Exception:  # noqa: BLE001 - an unreachable collector must not fail the demo
        pass


def start_server(port: int, addr: str, registry: Any) -> Any:
    server, _thread = kvobs.start_metrics_server(port, addr=addr, registry=registry)
    return server


def stop_server(server: Any) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()


def run_demo(opts: DemoOptions, *, stderr: TextIO | None = None) -> dict[str, Any]:
    """Run the seeded workload unguarded, then guarded; the `--json` summary document."""
    stderr = stderr if stderr is not None else sys.stderr
    active = _ActiveRun()
    server = None
    if opts.metrics_port:
        try:
            server = start_server(opts.metrics_port, opts.metrics_addr, active)
            if not opts.quiet:
                print(f"metrics: http://{opts.metrics_addr}:{opts.metrics_port}/metrics", file=stderr)
        except OSError as exc:
            print(f"warning: cannot serve metrics on {opts.metrics_addr}:{opts.metrics_port}: {exc}", file=stderr)
    endpoint = otlp_endpoint(opts.otlp_endpoint)
    provider = make_tracer_provider(endpoint)
    if provider is not None and not opts.quiet:
        print(f"traces: OTLP to {endpoint}", file=stderr)
    progress = Progress(stderr, 1.0, enabled=not opts.quiet)
    runs: dict[str, dict[str, Any]] = {}
    try:
        for mode in opts.modes:
            config = replace(opts.config, guarded=(mode == "guarded"), seed=opts.seed, faults=opts.faults, engine="")
            engine = SimEngine(config, tracer_provider=provider)
            active.registry = engine.registry
            engine.start()
            progress.start(lambda e=engine: status_line(e, opts.duration_s))
            try:
                end = time.monotonic() + opts.duration_s
                while engine.running and time.monotonic() < end:
                    time.sleep(min(0.05, max(0.0, end - time.monotonic())))
            finally:
                engine.stop()
                progress.stop()
            if engine.thread_error is not None:
                raise RuntimeError(f"the {mode} simulation failed") from engine.thread_error
            runs[mode] = run_summary(engine)
    finally:
        stop_server(server)
        _shutdown_tracing(provider)
    return summary_dict(seed=opts.seed, duration_s=opts.duration_s, faults=opts.faults, runs=runs)


def serve(opts: DemoOptions, *, stderr: TextIO | None = None, stop: threading.Event | None = None) -> int:
    """Keep the guarded engine running with a steady workload until SIGINT/SIGTERM (or `stop` is set)."""
    stderr = stderr if stderr is not None else sys.stderr
    stop = stop if stop is not None else threading.Event()
    restore = _install_stop_handlers(stop)
    config = replace(
        opts.config, guarded=True, seed=opts.seed, faults=opts.faults, engine="",
        signal_ttl_s=max(opts.config.signal_ttl_s, SERVE_SIGNAL_TTL_S),
    )
    provider = make_tracer_provider(otlp_endpoint(opts.otlp_endpoint))
    engine = SimEngine(config, tracer_provider=provider)
    server = None
    if opts.metrics_port:
        try:
            server = start_server(opts.metrics_port, opts.metrics_addr, engine.registry)
        except OSError as exc:
            _shutdown_tracing(provider)
            restore()
            print(f"error: cannot serve metrics on {opts.metrics_addr}:{opts.metrics_port}: {exc}", file=stderr)
            return 2
    try:
        engine.start()
        if not opts.quiet:
            where = f"http://{opts.metrics_addr}:{opts.metrics_port}/metrics" if opts.metrics_port else "not served"
            faults = ", ".join(sorted(opts.faults)) or "none"
            print(f"serving the guarded engine {config.engine!r}: metrics {where}; faults: {faults}; "
                  "Ctrl-C to stop", file=stderr, flush=True)
        progress = Progress(stderr, SERVE_PROGRESS_INTERVAL_S, enabled=not opts.quiet)
        progress.start(lambda: status_line(engine, None))
        try:
            while not stop.wait(0.2) and engine.running:
                pass
        finally:
            progress.stop()
    finally:
        engine.stop()
        stop_server(server)
        _shutdown_tracing(provider)
        restore()
    if engine.thread_error is not None:
        print(f"error: the simulation failed: {engine.thread_error!r}", file=stderr)
        return 1
    if not opts.quiet:
        print(f"stopped after {engine.stats.elapsed_s:.1f} s: {status_line(engine, None)}", file=stderr)
    return 0


def _install_stop_handlers(stop: threading.Event) -> Any:
    """SIGINT and SIGTERM set `stop` (main thread only); returns a function restoring the old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {}

    def handler(signum: int, frame: Any) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore
