"""The demo's summary: one dict per run, the `--json` document, and the side-by-side table.

The schema is documented in docs/demo.md; `SCHEMA_VERSION` changes whenever a field is renamed, removed or
changes meaning (adding fields does not change it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from kvobs import __version__
from kvobs import semconv as sc
from kvobs.demo.runs import RUNS, RunSpec
from kvobs.demo.targets import targets

SCHEMA_VERSION = 3  # what each version changed: docs/demo.md

# The fields every run carries, in table order: (key, table label, type).
RUN_FIELDS: tuple[tuple[str, str, type], ...] = (
    ("nan_blocks_written_to_storage", "NaN blocks written to storage", int),
    ("nan_blocks_served_to_prefix_hits", "NaN blocks served to prefix hits", int),
    ("lost_layer0_signals", "lost layer0 signals", int),
    ("hung_sends", "hung sends", int),
    ("stale_blocks_written_to_storage", "stale blocks written to storage", int),
    ("lock_wait_p50_s", "lock wait p50 (transfers)", float),
    ("lock_wait_p99_s", "lock wait p99 (transfers)", float),
    ("forward_lock_wait_p99_s", "forward-pass lock wait p99", float),
    ("forward_lock_wait_total_s", "forward-pass lock wait total", float),
    ("transfers_done", "transfers done", int),
    ("throughput_per_s", "throughput (requests/s)", float),
)

# Further fields of each run (documented, stable, not in the table).
EXTRA_FIELDS: tuple[tuple[str, type], ...] = (
    ("mode", str),
    ("engine", str),
    ("guarded", bool),
    ("elapsed_s", float),
    ("requests_admitted", int),
    ("requests_completed", int),
    ("requests_aborted", int),
    ("prefix_hits", int),
    ("prefix_hit_blocks", int),
    ("prefetch_done", int),
    ("write_back_done", int),
    ("send_done", int),
    ("prefetch_corrupt", int),
    ("write_back_rejected", int),
    ("write_back_skipped_busy", int),
    ("send_rejected", int),
    ("transfer_errors", int),
    ("lock_timeouts", int),
    ("signals_recovered", int),
    ("pending_signals", int),
    ("stale_signals_injected", int),
    ("poisoned_storage_entries", int),
    ("nan_checks_nan", int),
    ("forward_steps", int),
    ("forward_lock_wait_p50_s", float),
    ("forward_requests_deferred", int),
    ("prefix_probes", int),
    ("prefix_probe_total_s", float),
)

# Fields that are null (None; "-" in the table) where the run measured nothing: no lock taken, or no wait seen.
NULLABLE_FIELDS = frozenset({
    "lock_wait_p50_s", "lock_wait_p99_s", "forward_lock_wait_p50_s", "forward_lock_wait_p99_s",
    "forward_lock_wait_total_s",
})

INCIDENT_FIELDS = (
    "nan_blocks_written_to_storage", "nan_blocks_served_to_prefix_hits", "lost_layer0_signals", "hung_sends",
)
# What a guarded run must keep at 0: the incidents, and (with the engine-side fix) stale blocks.
GUARDED_INVARIANTS = (*INCIDENT_FIELDS, "stale_blocks_written_to_storage")

LOCK_WAIT_SOURCE = (
    "kvobs_lock_wait_seconds histogram of the run's own registry, all transfer paths together, "
    "interpolated within buckets like PromQL histogram_quantile"
)


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """PromQL's histogram_quantile over cumulative (upper bound, count) pairs; None for an empty histogram."""
    pairs = sorted(buckets)
    if not pairs or pairs[-1][1] <= 0:
        return None
    total = pairs[-1][1]
    rank = q * total
    lower = 0.0
    below = 0.0
    for upper, count in pairs:
        if count >= rank:
            if math.isinf(upper):
                return lower  # in the +Inf bucket: the highest finite bound, as Prometheus does
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower = upper
        below = count
    return lower


def lock_wait_buckets(registry: CollectorRegistry, engine: str) -> list[tuple[float, float]]:
    """Cumulative buckets of kvobs_lock_wait_seconds for `engine`, summed over locks and the transfer paths
    (the forward pass's own wait, `path="forward"`, is reported separately)."""
    sums: dict[float, float] = {}
    for family in registry.collect():
        if family.name != sc.LOCK_WAIT_SECONDS:
            continue
        for sample in family.samples:
            labels = sample.labels
            if (sample.name.endswith("_bucket") and labels.get(sc.LABEL_ENGINE) == engine
                    and labels.get(sc.LABEL_PATH) in sc.PATHS):
                le = float(sample.labels["le"])
                sums[le] = sums.get(le, 0.0) + sample.value
    return sorted(sums.items())


def nan_checks(registry: CollectorRegistry, engine: str, result: str = sc.CHECK_NAN) -> int:
    """kvobs_nan_checks_total{result=...} for `engine`, summed over paths."""
    total = 0.0
    for path in sc.PATHS:
        value = registry.get_sample_value(
            sc.NAN_CHECKS_TOTAL, {sc.LABEL_ENGINE: engine, sc.LABEL_PATH: path, sc.LABEL_RESULT: result}
        )
        total += value or 0.0
    return int(total)


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile; None when empty."""
    data = sorted(values)
    if not data:
        return None
    k = max(0, min(len(data) - 1, math.ceil(q * len(data)) - 1))
    return float(data[k])


def run_summary(engine: Any) -> dict[str, Any]:
    """The summary dict of one finished SimEngine run (see RUN_FIELDS and EXTRA_FIELDS)."""
    stats = engine.stats
    run = engine.config.run
    name = engine.config.engine
    counters = stats.counters()
    buckets = lock_wait_buckets(engine.registry, name) if run.takes_lock else []
    waits = list(stats.forward_lock_waits) if run.takes_lock else []
    out: dict[str, Any] = {
        "mode": run.name,
        "engine": name,
        "guarded": run.guarded,
        "elapsed_s": round(stats.elapsed_s, 3),
        "lock_wait_p50_s": histogram_quantile(0.5, buckets),
        "lock_wait_p99_s": histogram_quantile(0.99, buckets),
        "throughput_per_s": round(counters["requests_completed"] / max(stats.elapsed_s, 1e-9), 3),
        "pending_signals": engine.pending_signals(),
        "nan_checks_nan": nan_checks(engine.registry, name),
        "forward_lock_wait_p50_s": percentile(waits, 0.5),
        "forward_lock_wait_p99_s": percentile(waits, 0.99),
        "forward_lock_wait_total_s": round(stats.forward_lock_wait_total_s, 6) if run.takes_lock else None,
        "prefix_probe_total_s": round(stats.prefix_probe_total_s, 6),
    }
    for key, typ in (*((k, t) for k, _, t in RUN_FIELDS), *EXTRA_FIELDS):
        if key not in out:
            out[key] = typ(counters[key])
    return out


def incidents(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, bool]:
    """Per unguarded run: did it show both incidents (`<name>_nan_incident`, `<name>_hang_incident`)? Per
    guarded run: was it free of both, and of stale blocks (`<name>_clean`)?"""
    out = {}
    for name, run in runs.items():
        if run["guarded"]:
            out[f"{name}_clean"] = not any(run[k] for k in GUARDED_INVARIANTS)
        else:
            out[f"{name}_nan_incident"] = (
                run["nan_blocks_written_to_storage"] > 0 and run["nan_blocks_served_to_prefix_hits"] > 0)
            out[f"{name}_hang_incident"] = run["lost_layer0_signals"] > 0 and run["hung_sends"] > 0
    return out


def summary_dict(
    *, seed: int, duration_s: float, faults: Iterable[str], runs: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """The `--json` document (schema in docs/demo.md)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kvobs_version": __version__,
        "seed": seed,
        "duration_s": float(duration_s),
        "faults": sorted(faults),
        "lock_wait_source": LOCK_WAIT_SOURCE,
        "runs": {name: dict(run) for name, run in runs.items()},
        "incidents": incidents(runs),
        "targets": targets(runs),
    }


def _cell(value: Any, typ: type, key: str) -> str:
    if value is None:
        return "-"  # nothing measured
    if key.endswith("_s") and not key.endswith("_per_s"):
        return _duration(value)
    if typ is float:
        return f"{value:,.1f}"
    return f"{value:,}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds == 0:
        return "0"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def format_table(summary: Mapping[str, Any], specs: Iterable[RunSpec] = RUNS) -> str:
    """The side-by-side table the demo prints: a column per run, in the summary's order; `specs` give the
    legend of each run they name."""
    runs = summary["runs"]
    legends = {spec.name: spec.legend for spec in specs}
    faults = ", ".join(summary["faults"]) or "none"
    name_w = max((len(name) for name in runs), default=0) + 1
    lines = [f"kvobs demo  seed={summary['seed']}  {summary['duration_s']:g} s per run  faults: {faults}"]
    lines += [f"  {name + ':':<{name_w}} {legends[name]}" for name in runs if name in legends]
    label_w = max(len(label) for _, label, _ in RUN_FIELDS) + 2
    col_w = max(14, name_w + 2)
    lines += ["", " " * label_w + "".join(f"{name:>{col_w}}" for name in runs)]
    for key, label, typ in RUN_FIELDS:
        cells = "".join(f"{_cell(run[key], typ, key):>{col_w}}" for run in runs.values())
        lines.append(f"{label:<{label_w}}{cells}")
    lines.append("")
    for name, run in runs.items():
        lines += _run_notes(name, run, bool(summary["faults"]), summary["incidents"])
    lines += _target_lines(summary.get("targets", {}))
    return "\n".join(lines)


def _run_notes(name: str, run: Mapping[str, Any], faults: bool, verdict: Mapping[str, bool]) -> list[str]:
    """What a guarded run's protections did, or which incidents an unguarded run reproduced."""
    if not run["guarded"]:
        seen = [what for what, key in (("NaN served from storage", f"{name}_nan_incident"),
                                       ("hung sends", f"{name}_hang_incident")) if verdict.get(key)]
        return [f"{name} reproduced: {', '.join(seen) or 'nothing'}"]
    lines = [
        f"{name}: {run['write_back_rejected']} write-backs and {run['send_rejected']} sends refused by the NaN "
        f"check, {run['prefetch_corrupt']} prefetches refused (recomputed), {run['signals_recovered']} early "
        f"layer0 signals recovered"
    ]
    if run["prefix_probes"]:
        lines.append(
            f"{name}: {run['forward_requests_deferred']} times a prefill was left for a later step because its "
            f"prefetch still claimed its blocks ({run['prefix_probes']} looks at the lock, "
            f"{_duration(run['prefix_probe_total_s'])} in all)")
    if faults:
        lines.append(
            f"faults ({name} run): {run['poisoned_storage_entries']} storage entries poisoned, "
            f"{run['stale_signals_injected']} stale layer0 signal injected, {run['pending_signals']} signal(s) "
            f"still pending at the end, {run['nan_checks_nan']} NaN check findings"
        )
    lines.append(f"{name}: " + ("no incident" if verdict.get(f"{name}_clean") else "INCIDENTS SEEN (see above)"))
    return lines


def _target_lines(judged: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per target: the two values, the score against what is required, met or missed."""
    lines = []
    for name, t in judged.items():
        field = t["field"]
        kind = "reduction" if "reduction" in t else "ratio"
        values = " vs ".join(_cell(t[k], float, field) for k in ("run_value", "baseline_value"))
        score = "-" if t[kind] is None else f"{t[kind]:.0%}"
        need = f"{kind} >= {t['required']:.0%}"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"target {name}: {t['run']} vs {t['baseline']} {values}: {kind} {score} ({need}): {verdict}")
    return lines
