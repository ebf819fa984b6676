"""Running the simulated engine for `kvobs demo`: the runs side by side, and the `--serve` mode.

Each run builds its own CollectorRegistry, so runs never mix metrics. During the comparison the metrics
endpoint serves whichever run is active. `--serve` keeps the guarded engines running side by side (a global
lock and a block lock, one registry, told apart by their `engine` label), so the dashboards compare them
live. Progress goes to stderr; results go to stdout (printed by the CLI).
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from prometheus_client import CollectorRegistry

import kvobs
from kvobs.demo.config import SimConfig
from kvobs.demo.engine import SimEngine, SimulationFailed
from kvobs.demo.progress import Progress, install_stop_handlers, status_line
from kvobs.demo.report import run_summary, summary_dict
from kvobs.demo.runs import RUNS, SERVED_RUNS, RunSpec
from kvobs.demo.tracing import DemoTracing, otlp_endpoint

SERVE_SIGNAL_TTL_S = 3600.0  # a stale signal must stay pending (and age) while Prometheus watches
SERVE_PROGRESS_INTERVAL_S = 5.0
POLL_S = 0.05


@dataclass(kw_only=True)
class DemoOptions:
    """What `kvobs demo` was asked to do (the CLI holds the defaults)."""

    duration_s: float | None  # per run; for `serve`, None runs until stopped
    metrics_port: int  # 0: do not serve
    seed: int = 0
    metrics_addr: str = "127.0.0.1"
    otlp_endpoint: str | None = None
    faults: frozenset[str] = frozenset()
    quiet: bool = False
    runs: tuple[RunSpec, ...] = RUNS  # compared, one after another
    served_runs: tuple[RunSpec, ...] = SERVED_RUNS  # kept running side by side by `serve`
    config: SimConfig = field(default_factory=SimConfig)  # the template every run starts from


class _ActiveRun:
    """A collector that yields the metrics of the run in progress (the endpoint outlives each run)."""

    def __init__(self) -> None:
        self.registry: CollectorRegistry | None = None

    def collect(self) -> Any:
        registry = self.registry
        return registry.collect() if registry is not None else iter(())


def start_server(port: int, addr: str, registry: Any) -> Any:
    server, _thread = kvobs.start_metrics_server(port, addr=addr, registry=registry)
    return server


def stop_server(server: Any) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()


def run_demo(opts: DemoOptions, *, stderr: TextIO | None = None) -> dict[str, Any]:
    """Run the seeded workload once per configuration in `opts.runs`; the `--json` summary document."""
    stderr = stderr if stderr is not None else sys.stderr
    if opts.duration_s is None:
        raise ValueError("the demo's runs need a duration")
    active = _ActiveRun()
    server = _serve_or_warn(opts, active, stderr)
    tracing = DemoTracing.start(otlp_endpoint(opts.otlp_endpoint))
    _say(opts, stderr, tracing.describe())
    progress = Progress(stderr, 1.0, enabled=not opts.quiet)
    runs: dict[str, dict[str, Any]] = {}
    try:
        for run in opts.runs:
            engine = SimEngine(_config(opts, run), tracer_provider=tracing.provider)
            active.registry = engine.registry
            _run_for([engine], opts.duration_s, progress, threading.Event())
            runs[run.name] = run_summary(engine)
    finally:
        stop_server(server)
        tracing.shutdown()
    return summary_dict(seed=opts.seed, duration_s=opts.duration_s, faults=opts.faults, runs=runs)


def serve(opts: DemoOptions, *, stderr: TextIO | None = None, stop: threading.Event | None = None) -> int:
    """Keep the guarded engines running with a steady workload until SIGINT/SIGTERM, `stop`, or
    `opts.duration_s` seconds; the exit status."""
    stderr = stderr if stderr is not None else sys.stderr
    stop = stop if stop is not None else threading.Event()
    registry = CollectorRegistry()
    tracing = DemoTracing.start(otlp_endpoint(opts.otlp_endpoint))
    engines = [SimEngine(_serve_config(opts, run), registry=registry, tracer_provider=tracing.provider)
               for run in opts.served_runs]
    try:
        server = start_server(opts.metrics_port, opts.metrics_addr, registry) if opts.metrics_port else None
    except OSError as exc:
        tracing.shutdown()
        print(f"error: cannot serve metrics on {opts.metrics_addr}:{opts.metrics_port}: {exc}", file=stderr)
        return 2
    restore = install_stop_handlers(stop)
    try:
        _say(opts, stderr, _serving_banner(opts, engines, tracing))
        _run_for(engines, opts.duration_s, Progress(stderr, SERVE_PROGRESS_INTERVAL_S, enabled=not opts.quiet), stop)
    except SimulationFailed as exc:
        print(f"error: {exc}", file=stderr)
        return 1
    finally:
        stop_server(server)
        tracing.shutdown()
        restore()
    elapsed = max(engine.stats.elapsed_s for engine in engines)
    _say(opts, stderr, f"stopped after {elapsed:.1f} s: " + " | ".join(status_line(e, None) for e in engines))
    return 0


def _config(opts: DemoOptions, run: RunSpec) -> SimConfig:
    return replace(opts.config, run=run, seed=opts.seed, faults=opts.faults, engine="")


def _serve_config(opts: DemoOptions, run: RunSpec) -> SimConfig:
    """A stale signal must stay pending (and age) while Prometheus watches."""
    return replace(_config(opts, run), signal_ttl_s=max(opts.config.signal_ttl_s, SERVE_SIGNAL_TTL_S))


def _run_for(engines: list[SimEngine], duration_s: float | None, progress: Progress, stop: threading.Event) -> None:
    """Run `engines` until `duration_s` passes (None: no limit), `stop` is set or one of them stops; raise if a
    thread of any crashed."""
    for engine in engines:
        engine.start()
    progress.start(lambda: " | ".join(status_line(engine, duration_s) for engine in engines))
    end = time.monotonic() + duration_s if duration_s is not None else None
    try:
        while all(engine.running for engine in engines) and not stop.is_set():
            left = end - time.monotonic() if end is not None else POLL_S
            if left <= 0:
                break
            stop.wait(min(POLL_S, left))
    finally:
        for engine in engines:
            engine.stop()
        progress.stop()
    for engine in engines:
        engine.raise_if_failed()


def _serve_or_warn(opts: DemoOptions, active: _ActiveRun, stderr: TextIO) -> Any:
    """The comparison's metrics endpoint; a busy port only costs the endpoint, never the demo."""
    if not opts.metrics_port:
        return None
    try:
        server = start_server(opts.metrics_port, opts.metrics_addr, active)
    except OSError as exc:
        print(f"warning: cannot serve metrics on {opts.metrics_addr}:{opts.metrics_port}: {exc}", file=stderr)
        return None
    _say(opts, stderr, f"metrics: {_metrics_url(opts)}")
    return server


def _serving_banner(opts: DemoOptions, engines: list[SimEngine], tracing: DemoTracing) -> str:
    where = _metrics_url(opts) if opts.metrics_port else "not served"
    faults = ", ".join(sorted(opts.faults)) or "none"
    until = f"for {opts.duration_s:g} s" if opts.duration_s is not None else "until Ctrl-C"
    names = ", ".join(repr(engine.config.engine) for engine in engines)
    return f"serving the engines {names} {until}: metrics {where}; {tracing.describe()}; faults: {faults}"


def _metrics_url(opts: DemoOptions) -> str:
    return f"http://{opts.metrics_addr}:{opts.metrics_port}/metrics"


def _say(opts: DemoOptions, stderr: TextIO, line: str) -> None:
    if not opts.quiet:
        print(line, file=stderr, flush=True)
