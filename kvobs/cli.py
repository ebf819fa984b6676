"""The `kvobs` command. `kvobs demo` reproduces both incidents in a simulated engine (see docs/demo.md).

Nothing heavy is imported until a subcommand runs: `kvobs --help` does not import torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

FAULT_CHOICES = ("stale-signal", "nan")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from kvobs import __version__

    parser = argparse.ArgumentParser(prog="kvobs", description="Safety and observability for KV-cache transfers.")
    parser.add_argument("--version", action="version", version=f"kvobs {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    demo = sub.add_parser(
        "demo",
        help="reproduce the NaN and hung-send incidents in a simulated engine, unguarded vs guarded",
        description=(
            "Run one seeded workload on a simulated serving engine twice: unguarded (kvobs only observes) and "
            "guarded (cache lock, early-signal buffer and NaN checks in force), then print a side-by-side "
            "table (or --json). With --serve, keep the guarded engine running for Prometheus to scrape."
        ),
    )
    demo.add_argument("--duration", type=_positive_float, default=10.0, metavar="S",
                      help="seconds per run (default 10; the default demo takes about 25 s in all)")
    demo.add_argument("--seed", type=int, default=0, metavar="N", help="workload seed (default 0)")
    demo.add_argument("--metrics-port", type=_port, default=9464, metavar="P",
                      help="serve Prometheus metrics on this port during the run; 0 = don't serve (default 9464)")
    demo.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                      help="address of the metrics endpoint (default 127.0.0.1)")
    demo.add_argument("--serve", action="store_true",
                      help="keep the guarded engine running with a steady workload until SIGINT/SIGTERM")
    demo.add_argument("--otlp-endpoint", metavar="URL",
                      help="export spans over OTLP (default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT if set)")
    demo.add_argument("--json", action="store_true", help="print a machine-readable summary instead of the table")
    demo.add_argument("--fault", action="append", choices=FAULT_CHOICES, default=[],
                      help="inject a fault (repeatable): stale-signal = a layer0 signal whose task never "
                           "registers; nan = poison storage entries periodically")
    demo.add_argument("--quiet", action="store_true", help="no progress output on stderr")
    demo.set_defaults(handler=_demo)
    return parser


def _demo(args: argparse.Namespace) -> int:
    from kvobs.sim.demo import DemoOptions, run_demo, serve
    from kvobs.sim.report import format_table

    opts = DemoOptions(
        duration_s=args.duration, seed=args.seed, metrics_port=args.metrics_port, metrics_addr=args.metrics_addr,
        otlp_endpoint=args.otlp_endpoint, faults=frozenset(args.fault), quiet=args.quiet,
    )
    if args.serve:
        return serve(opts)
    summary = run_demo(opts)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=False))
    else:
        print(format_table(summary))
    sys.stdout.flush()
    return 0


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
