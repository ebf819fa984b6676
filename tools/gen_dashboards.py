#!/usr/bin/env python3
"""Generate the kvobs Grafana dashboards (Grafana 11 JSON model) from plain Python dicts.

    python tools/gen_dashboards.py          # rewrite dashboards/*.json
    python tools/gen_dashboards.py --check  # exit 1 if the committed JSON differs from the generator

Metric and label names come from kvobs.semconv, so a rename in the contract is followed here.
tests/test_deploy_config.py fails when the committed JSON does not match this generator.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout without installing kvobs
    sys.path.insert(0, str(ROOT))

from kvobs import semconv as sc  # noqa: E402

OUT_DIR = ROOT / "dashboards"
SCHEMA_VERSION = 39  # Grafana 11.0 - 11.2; later 11.x migrate it on load
DS = {"type": "prometheus", "uid": "${datasource}"}
TAG = "kvobs"

# Selectors every panel applies: the template variables of the dashboard.
ENGINE, INSTANCE = sc.LABEL_ENGINE, "instance"
PATH, OUTCOME, LOCK, RESULT = sc.LABEL_PATH, sc.LABEL_OUTCOME, sc.LABEL_LOCK, sc.LABEL_RESULT
HOLDER_PATH, MODE = sc.LABEL_HOLDER_PATH, sc.LABEL_MODE

# Recording rules defined in deploy/prometheus/rules/kvobs-recording.yml that the dashboards read.
REC_ERROR_RATIO = "kvobs:transfer_error_ratio:rate5m"
REC_LOCK_WAIT_P99 = "kvobs:lock_wait_seconds:p99_5m"
REC_LOCK_HOLD_P99 = "kvobs:lock_hold_seconds:p99_5m"


def sel(*matchers: str) -> str:
    """`{engine=~"$engine",instance=~"$instance",...}`."""
    return "{" + ",".join([f'{ENGINE}=~"$engine"', f'{INSTANCE}=~"$instance"', *matchers]) + "}"


def rate(metric: str, *matchers: str, window: str = "$__rate_interval") -> str:
    return f"rate({metric}{sel(*matchers)}[{window}])"


def quantile(q: float, histogram: str, by: str, *matchers: str) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) ({rate(histogram + '_bucket', *matchers)}))"


def target(expr: str, legend: str, ref: str = "A", *, exemplar: bool = False, fmt: str | None = None) -> dict:
    t: dict[str, Any] = {"datasource": DS, "refId": ref, "expr": expr, "legendFormat": legend, "range": True}
    if exemplar:
        t["exemplar"] = True
    if fmt:
        t["format"] = fmt
    return t


class Layout:
    """Places panels left to right in rows of 24 grid units and numbers them."""

    def __init__(self) -> None:
        self.x = self.y = self.row_h = 0
        self.next_id = 1
        self.panels: list[dict] = []

    def add(self, panel: dict, w: int = 12, h: int = 8) -> None:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        panel["id"] = self.next_id
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.next_id += 1
        self.x += w
        self.row_h = max(self.row_h, h)
        self.panels.append(panel)


def timeseries(title: str, description: str, targets: list[dict], unit: str, *,
               stack: bool = False, thresholds: list[dict] | None = None) -> dict:
    custom: dict[str, Any] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                              "spanNulls": False}
    if stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    defaults: dict[str, Any] = {"unit": unit, "custom": custom}
    if thresholds:
        custom["thresholdsStyle"] = {"mode": "line+area"}
        defaults["thresholds"] = {"mode": "absolute", "steps": thresholds}
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "showLegend": True, "calcs": ["lastNotNull", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(title: str, description: str, targets: list[dict], unit: str, steps: list[dict]) -> dict:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets,
        "fieldConfig": {
            "defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps}},
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "area",
            "textMode": "auto",
            "justifyMode": "auto",
            "orientation": "auto",
        },
    }


def heatmap(title: str, description: str, histogram: str, *matchers: str) -> dict:
    expr = f"sum by (le) (increase({histogram}_bucket{sel(*matchers)}[$__rate_interval]))"
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": [target(expr, "{{le}}", fmt="heatmap") | {"exemplar": True}],
        "fieldConfig": {"defaults": {"custom": {"scaleDistribution": {"type": "linear"}}}, "overrides": []},
        "options": {
            "calculate": False,
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Oranges", "scale": "exponential", "exponent": 0.5},
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
            "yAxis": {"unit": "s", "axisPlacement": "left"},
            "rowsFrame": {"layout": "auto"},
            "tooltip": {"mode": "single", "yHistogram": True},
            "legend": {"show": True},
        },
    }


GREEN = {"color": "green", "value": None}


def red_at(v: float) -> dict:
    return {"color": "red", "value": v}


def dashboard(uid: str, title: str, description: str, layout: Layout) -> dict:
    var_source = sc.TRANSFERS_TOTAL
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": [TAG],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "timezone": "browser",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "annotations": {"list": [{
            "builtIn": 1, "type": "dashboard", "name": "Annotations & Alerts", "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "datasource": {"type": "grafana", "uid": "-- Grafana --"},
        }]},
        "links": [{"type": "dashboards", "tags": [TAG], "asDropdown": False, "title": "kvobs dashboards",
                   "includeVars": True, "keepTime": True}],
        "templating": {"list": [
            {
                "name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
                "current": {"text": "Prometheus", "value": "prometheus"}, "hide": 0, "refresh": 1,
                "regex": "", "options": [],
            },
            {
                "name": "engine", "label": "engine", "type": "query", "datasource": DS,
                "query": {"query": f"label_values({var_source}, {ENGINE})", "refId": "engine"},
                "definition": f"label_values({var_source}, {ENGINE})",
                "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*",
                "current": {"text": ["All"], "value": ["$__all"]}, "sort": 1, "hide": 0, "options": [],
            },
            {
                "name": "instance", "label": "instance", "type": "query", "datasource": DS,
                "query": {"query": f'label_values({var_source}{{{ENGINE}=~"$engine"}}, {INSTANCE})',
                          "refId": "instance"},
                "definition": f'label_values({var_source}{{{ENGINE}=~"$engine"}}, {INSTANCE})',
                "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*",
                "current": {"text": ["All"], "value": ["$__all"]}, "sort": 1, "hide": 0, "options": [],
            },
        ]},
        "panels": layout.panels,
    }


def overview() -> dict:
    lay = Layout()
    not_ok = f'{OUTCOME}!="{sc.OUTCOME_OK}"'
    lay.add(timeseries(
        "Transfers per second by path and outcome",
        "Guarded transfers ended per second. outcome: ok, error (the transfer or its completion failed), "
        "timeout (the cache lock was not acquired in time), rejected (refused before the copy: bad arguments, "
        "or corrupt blocks left out by the integrity policy), abandoned (never completed before its deadline).",
        [target(f"sum by ({PATH}, {OUTCOME}) ({rate(sc.TRANSFERS_TOTAL)})", "{{path}} {{outcome}}")],
        "ops", stack=True), w=12)
    lay.add(timeseries(
        "Transfer duration p50 / p99 by path",
        "Wall time of a guarded transfer call (validation, lock wait, transfer, integrity check). Exemplar "
        "dots link to the trace of that transfer in Tempo.",
        [target(quantile(0.5, sc.TRANSFER_DURATION_SECONDS, PATH), "p50 {{path}}", "A", exemplar=True),
         target(quantile(0.99, sc.TRANSFER_DURATION_SECONDS, PATH), "p99 {{path}}", "B", exemplar=True)],
        "s"), w=12)
    lay.add(timeseries(
        "Open transfers by path",
        "Transfers begun and not yet completed: holding their lock while the copy runs, in this process or "
        "elsewhere (a thread pool, a later engine step, an acknowledgement). A value that never returns to 0 "
        "is a completion that is not coming.",
        [target(f"sum by ({PATH}) ({sc.TRANSFERS_IN_FLIGHT}{sel()})", "{{path}}")], "short"), w=8)
    lay.add(timeseries(
        "Oldest open transfer by path",
        "Age of the oldest transfer still waiting for its completion. It saw-tooths with normal copies; at the "
        "deadline (KVOBS_TRANSFER_DEADLINE, default 60s) the transfer is abandoned and "
        "KvobsTransferNeverCompleted fires.",
        [target(f"max by ({PATH}) ({sc.TRANSFER_OLDEST_OPEN_AGE_SECONDS}{sel()})", "{{path}}")], "s",
        thresholds=[GREEN, red_at(60)]), w=8)
    lay.add(timeseries(
        "Errors per second by path and outcome",
        "Transfers that did not end ok: error, timeout, rejected and abandoned, per path.",
        [target(f"sum by ({PATH}, {OUTCOME}) ({rate(sc.TRANSFERS_TOTAL, not_ok)})", "{{path}} {{outcome}}")],
        "ops", stack=True), w=8)
    lay.add(timeseries(
        "Transfer error ratio (5m) by path",
        "Share of transfers ending in error, timeout or abandonment over 5 minutes (recording rule "
        f"{REC_ERROR_RATIO}); KvobsTransferErrorRatioHigh fires above 5% for 5m.",
        [target(f"max by ({PATH}) ({REC_ERROR_RATIO}{sel()})", "{{path}}")], "percentunit",
        thresholds=[GREEN, red_at(0.05)]), w=8)
    lay.add(timeseries(
        "Blocks per second by path",
        "KV blocks moved by guarded transfers.",
        [target(f"sum by ({PATH}) ({rate(sc.TRANSFER_BLOCKS_TOTAL)})", "{{path}}")], "short"), w=12)
    lay.add(timeseries(
        "Bytes per second by path",
        "Bytes moved by guarded transfers.",
        [target(f"sum by ({PATH}) ({rate(sc.TRANSFER_BYTES_TOTAL)})", "{{path}}")], "Bps"), w=12)
    return dashboard("kvobs-overview", "kvobs / Overview",
                     "KV-cache transfers on the prefetch, write_back and send paths.", lay)


def lock() -> dict:
    lay = Layout()
    lay.add(timeseries(
        "Lock wait p50 / p99 by lock and path",
        "Time spent waiting for the cache lock before a transfer. High waits mean forward passes and "
        "transfers serialise behind each other. Exemplars link to traces.",
        [target(quantile(0.5, sc.LOCK_WAIT_SECONDS, f"{LOCK}, {PATH}"), "p50 {{lock}} {{path}}", "A", exemplar=True),
         target(quantile(0.99, sc.LOCK_WAIT_SECONDS, f"{LOCK}, {PATH}"), "p99 {{lock}} {{path}}", "B", exemplar=True)],
        "s"), w=12)
    lay.add(timeseries(
        "Lock hold p50 / p99 by lock and path",
        "Time the cache lock was held per transfer. Exemplars link to traces.",
        [target(quantile(0.5, sc.LOCK_HOLD_SECONDS, f"{LOCK}, {PATH}"), "p50 {{lock}} {{path}}", "A", exemplar=True),
         target(quantile(0.99, sc.LOCK_HOLD_SECONDS, f"{LOCK}, {PATH}"), "p99 {{lock}} {{path}}", "B", exemplar=True)],
        "s"), w=12)
    lay.add(heatmap("Lock wait heatmap", "Distribution of lock waits over time (all locks and paths selected).",
                    sc.LOCK_WAIT_SECONDS), w=12)
    lay.add(heatmap("Lock hold heatmap", "Distribution of lock holds over time (all locks and paths selected).",
                    sc.LOCK_HOLD_SECONDS), w=12)
    lay.add(timeseries(
        "Lock timeouts per second by lock and path",
        "Acquisitions that gave up after the lock timeout; each is a transfer with outcome=timeout. "
        "KvobsLockTimeouts fires on any.",
        [target(f"sum by ({LOCK}, {PATH}) ({rate(sc.LOCK_TIMEOUTS_TOTAL)})", "{{lock}} {{path}}")], "ops"), w=8)
    lay.add(timeseries(
        "Time held by the current holder",
        "How long the current holder has held each lock; 0 when free. A line that keeps rising is a hung "
        "transfer or a leaked lock (KvobsLockHeldTooLong: above 5s for 1m).",
        [target(f"max by ({INSTANCE}, {LOCK}) ({sc.LOCK_HELD_SECONDS}{sel()})", "{{instance}} {{lock}}")], "s",
        thresholds=[GREEN, red_at(5)]), w=8)
    lay.add(timeseries(
        "Lock wait p99 (5m, as alerted)",
        f"Recording rule {REC_LOCK_WAIT_P99} (and {REC_LOCK_HOLD_P99}); KvobsLockWaitHigh fires when the wait "
        "p99 stays above 100ms for 10m.",
        [target(f"max by ({LOCK}, {PATH}) ({REC_LOCK_WAIT_P99}{sel()})", "wait {{lock}} {{path}}", "A"),
         target(f"max by ({LOCK}, {PATH}) ({REC_LOCK_HOLD_P99}{sel()})", "hold {{lock}} {{path}}", "B")],
        "s", thresholds=[GREEN, red_at(0.1)]), w=8)
    lay.add(timeseries(
        "Lock conflicts per second by path and holder path",
        "Acquisitions that had to wait, by the path that waited and the path holding what it wanted (with a "
        "block lock: the holder of some of the wanted blocks). A forward pass waiting on write-backs shows as "
        "path=forward, holder_path=write_back.",
        [target(f"sum by ({PATH}, {HOLDER_PATH}) ({rate(sc.LOCK_CONFLICTS_TOTAL)})",
                "{{path}} waited for {{holder_path}}")], "ops", stack=True), w=12)
    lay.add(timeseries(
        "Blocks claimed now by mode",
        "KV blocks claimed on the block lock at scrape time: shared (transfers reading blocks) and exclusive "
        "(prefetches and forward passes writing them). Always 0 for a whole-cache lock.",
        [target(f"sum by ({LOCK}, {MODE}) ({sc.LOCK_BLOCKS_CLAIMED}{sel()})", "{{lock}} {{mode}}")], "short"),
        w=12)
    return dashboard("kvobs-lock", "kvobs / Cache lock",
                     "The cross-process cache lock around storage prefetch/write-back and the forward pass.", lay)


def integrity() -> dict:
    lay = Layout()
    bad = f'{RESULT}=~"{sc.CHECK_NAN}|{sc.CHECK_INF}"'
    clean = f'{RESULT}="{sc.CHECK_CLEAN}"'
    lay.add(stat(
        "Checks that found NaN/Inf (range)",
        "Integrity checks with result nan or inf over the dashboard time range. Anything above 0 pages "
        "(KvobsNaNDetected).",
        [target(f"sum(increase({sc.NAN_CHECKS_TOTAL}{sel(bad)}[$__range]))", "bad checks", fmt="time_series")],
        "short", [GREEN, red_at(1)]), w=6, h=6)
    lay.add(stat(
        "Bad blocks (range)",
        "KV blocks found holding NaN or Inf over the dashboard time range.",
        [target(f"sum(increase({sc.NAN_BLOCKS_TOTAL}{sel()}[$__range]))", "bad blocks")],
        "short", [GREEN, red_at(1)]), w=6, h=6)
    lay.add(stat(
        "Clean check share (range)",
        "Share of integrity checks that were clean.",
        [target(f"sum(increase({sc.NAN_CHECKS_TOTAL}{sel(clean)}[$__range])) / "
                f"sum(increase({sc.NAN_CHECKS_TOTAL}{sel()}[$__range]))", "clean")],
        "percentunit", [{"color": "red", "value": None}, {"color": "green", "value": 1}]), w=12, h=6)
    lay.add(timeseries(
        "NaN/Inf checks per second by path and result",
        "Integrity checks of exactly the blocks each transfer touched, by result (clean, nan, inf).",
        [target(f"sum by ({PATH}, {RESULT}) ({rate(sc.NAN_CHECKS_TOTAL)})", "{{path}} {{result}}")], "ops"), w=12)
    lay.add(timeseries(
        "Bad blocks per second by path",
        "KV blocks found holding NaN or Inf, per path. Which blocks: see the span event "
        f"{sc.EVENT_INTEGRITY_BAD_BLOCKS} ({sc.ATTR_BAD_BLOCK_IDS}) in Tempo.",
        [target(f"sum by ({PATH}) ({rate(sc.NAN_BLOCKS_TOTAL)})", "{{path}}")], "short",
        thresholds=[GREEN, red_at(1e-9)]), w=12)
    return dashboard("kvobs-integrity", "kvobs / KV integrity",
                     "NaN/Inf checks of KV blocks at the transfer boundary.", lay)


def signals() -> dict:
    lay = Layout()
    lay.add(timeseries(
        "Pending early signals",
        "Early layer0 signals buffered because their transfer task was not registered yet.",
        [target(f"sum by ({INSTANCE}, {ENGINE}) ({sc.PENDING_SIGNALS}{sel()})", "{{instance}} {{engine}}")],
        "short"), w=12)
    lay.add(timeseries(
        "Oldest pending signal age",
        "Age of the oldest buffered signal, fresh at scrape time. A line that keeps rising is a signal whose "
        "task never registered: a request that will hang (KvobsStalePendingSignal: above 5s for 15s).",
        [target(f"max by ({INSTANCE}, {ENGINE}) ({sc.PENDING_SIGNAL_OLDEST_AGE_SECONDS}{sel()})",
                "{{instance}} {{engine}}")], "s", thresholds=[GREEN, red_at(5)]), w=12)
    lay.add(timeseries(
        "Signal outcomes per second",
        "ready (task already registered), buffered, recovered (buffered then matched), dropped_invalid, "
        "dropped_finished, expired, overflow, refused (a registration beyond max_slots, or a step record "
        "full: finish() or end_step() missing).",
        [target(f"sum by ({OUTCOME}) ({rate(sc.SIGNALS_TOTAL)})", "{{outcome}}")], "ops", stack=True), w=12)
    lay.add(timeseries(
        "Time buffered p50 / p99",
        "How long an early signal waited before its task registered and it was recovered. Exemplars link to "
        "traces.",
        [target(f"histogram_quantile(0.5, sum by (le) ({rate(sc.SIGNAL_BUFFERED_SECONDS + '_bucket')}))", "p50",
                "A", exemplar=True),
         target(f"histogram_quantile(0.99, sum by (le) ({rate(sc.SIGNAL_BUFFERED_SECONDS + '_bucket')}))", "p99",
                "B", exemplar=True)], "s"), w=12)
    lay.add(heatmap("Time buffered heatmap", "Distribution of time buffered.", sc.SIGNAL_BUFFERED_SECONDS), w=24)
    return dashboard("kvobs-signals", "kvobs / Early signals",
                     "Layer0 signals that arrive before their transfer task is registered.", lay)


DASHBOARDS = {
    "kvobs-overview.json": overview,
    "kvobs-lock.json": lock,
    "kvobs-integrity.json": integrity,
    "kvobs-signals.json": signals,
}


def render(build) -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if dashboards/*.json differ from the generator")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path = args.out / name
        text = render(build)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("out of date (run python tools/gen_dashboards.py):", *stale, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
