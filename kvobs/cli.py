"""The `kvobs` command. `kvobs demo` reproduces both incidents in a simulated engine (see docs/demo.md).

Every flag either works or is refused with a message naming it; nothing is silently ignored. Nothing heavy is
imported until a subcommand runs: `kvobs --help` does not import torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit

FAULT_CHOICES = ("stale-signal", "nan")
DEFAULT_DURATION_S = 7.0
MAX_DURATION_S = 86_400.0  # one day: anything longer is a typo, not a demo
DEFAULT_METRICS_PORT = 9464
DEFAULT_METRICS_ADDR = "127.0.0.1"


def duration(text: str) -> float:
    """--duration: seconds, positive, finite, at most a day."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of seconds, got {text!r}")
    if value > MAX_DURATION_S:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_DURATION_S:g} seconds (one day), got {text!r}")
    return value


def seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 0 to 65535, got {text!r}")
    return value


def otlp_url(text: str) -> str:
    try:
        parts = urlsplit(text)
        _ = parts.port  # raises ValueError for a port that is not a number or out of range
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"expected an http:// or https:// URL such as http://127.0.0.1:4317, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    from kvobs._version import __version__

    parser = argparse.ArgumentParser(prog="kvobs", description="Safety and observability for KV-cache transfers.")
    parser.add_argument("--version", action="version", version=f"kvobs {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    demo = sub.add_parser(
        "demo",
        help="reproduce the NaN and hung-send incidents in a simulated engine: unguarded, global lock, block lock",
        description=(
            "Run one seeded workload on a simulated serving engine three times: unguarded (kvobs only observes), "
            "then guarded (cache lock, early-signal buffer and NaN checks in force) with one lock for the whole "
            "cache and with a block lock; print a side-by-side table with the block lock's targets (or --json). "
            "With --serve, keep both guarded engines running for Prometheus to scrape."
        ),
    )
    _add_demo_arguments(demo)
    demo.set_defaults(handler=_demo, parser=demo)
    return parser


def _add_demo_arguments(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--duration", type=duration, metavar="S",
                      help=f"seconds per run (default {DEFAULT_DURATION_S:g}; the default demo takes 35-40 s in "
                           "all); with --serve: stop after S seconds (default: run until SIGINT/SIGTERM)")
    demo.add_argument("--seed", type=seed, default=0, metavar="N", help="workload seed (default 0)")
    demo.add_argument("--metrics-port", type=port, metavar="P",
                      help="serve Prometheus metrics on this port (default: not served; with --serve, "
                           f"{DEFAULT_METRICS_PORT}); 0 = don't serve (not with --serve)")
    demo.add_argument("--metrics-addr", metavar="ADDR",
                      help=f"address of the metrics endpoint (default {DEFAULT_METRICS_ADDR})")
    demo.add_argument("--serve", action="store_true",
                      help="keep the guarded engines (global lock, block lock) running side by side with a steady "
                           "workload until SIGINT/SIGTERM")
    demo.add_argument("--otlp-endpoint", type=otlp_url, metavar="URL",
                      help="also export spans over OTLP (default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT if set); "
                           "spans are recorded in-process either way, so metrics carry trace_id exemplars")
    demo.add_argument("--json", action="store_true", help="print a machine-readable summary instead of the table")
    demo.add_argument("--fault", action="append", choices=FAULT_CHOICES, default=[],
                      help="inject a fault (repeatable): stale-signal = a layer0 signal whose task never "
                           "registers; nan = poison storage entries periodically")
    demo.add_argument("--quiet", action="store_true", help="no progress output on stderr")


def demo_conflicts(args: argparse.Namespace) -> list[str]:
    """Combinations in which a flag would do nothing: each is refused, never silently ignored."""
    problems = []
    if args.serve and args.metrics_port == 0:
        problems.append("--serve exists to serve metrics: --metrics-port 0 would serve nothing (give a port, "
                        f"default {DEFAULT_METRICS_PORT})")
    if args.serve and args.json:
        problems.append("--json prints the comparison's summary; --serve prints none (it serves metrics)")
    if demo_metrics_port(args) == 0 and args.metrics_addr is not None:
        problems.append("--metrics-addr has no effect when metrics are not served (give --metrics-port P)")
    return problems


def demo_metrics_port(args: argparse.Namespace) -> int:
    """The port metrics are served on, 0 for none: a plain demo opens no port unless asked (it should leave
    no trace on the host beyond its output); --serve exists to be scraped, on the default port unless told."""
    if args.metrics_port is not None:
        return args.metrics_port
    return DEFAULT_METRICS_PORT if args.serve else 0


def _demo(args: argparse.Namespace) -> int:
    problems = demo_conflicts(args)
    if problems:
        args.parser.error("; ".join(problems))
    if importlib.util.find_spec("torch") is None:  # the simulated engine's KV cache is a torch tensor
        args.parser.exit(2, "kvobs demo needs torch, which is not installed: pip install 'kvobs[torch]'\n")
    from kvobs.demo.app import DemoOptions, run_demo, serve
    from kvobs.demo.engine import SimulationFailed
    from kvobs.demo.report import format_table

    opts = DemoOptions(
        duration_s=_run_length(args), seed=args.seed, metrics_port=demo_metrics_port(args),
        metrics_addr=args.metrics_addr or DEFAULT_METRICS_ADDR, otlp_endpoint=args.otlp_endpoint,
        faults=frozenset(args.fault), quiet=args.quiet,
    )
    if args.serve:
        return serve(opts)
    try:
        summary = run_demo(opts)
    except SimulationFailed as exc:  # the thread's traceback is on stderr already
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2) if args.json else format_table(summary))
    sys.stdout.flush()
    return 0


def _run_length(args: argparse.Namespace) -> float | None:
    """Seconds per run; with --serve, None (until stopped) unless --duration says."""
    if args.duration is not None:
        return args.duration
    return None if args.serve else DEFAULT_DURATION_S


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
