#!/usr/bin/env python3
"""Build the kvobs Grafana dashboards with Grafana's typed builder, grafana-foundation-sdk (Grafana 11.6 schema).

    python tools/gen_dashboards.py          # rewrite dashboards/*.json
    python tools/gen_dashboards.py --check  # exit 1 if the committed JSON differs from what the builder makes

The SDK's types follow Grafana's own schema (panel options, field config, Prometheus queries, variables), so a
misspelt option is a Python error here instead of a setting Grafana silently drops. Metric and label names come
from kvobs.semconv, so a rename in the contract is followed here. The SDK is in the `test` extra;
tests/ops/test_deploy_config.py fails when the committed JSON does not match this builder or Grafana's schema.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.builders import common, dashboard, heatmap, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_model
from grafana_foundation_sdk.models import dashboard as dashboard_model
from grafana_foundation_sdk.models import heatmap as heatmap_model
from grafana_foundation_sdk.models import prometheus as prometheus_model

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout without installing kvobs
    sys.path.insert(0, str(ROOT))

from kvobs import semconv as sc  # noqa: E402

OUT_DIR = ROOT / "dashboards"
DATASOURCE = dashboard_model.DataSourceRef(type_val="prometheus", uid="${datasource}")
TAG = "kvobs"

# Selectors every panel applies: the template variables of the dashboard.
ENGINE = sc.LABEL_ENGINE
INSTANCE = "instance"
PATH = sc.LABEL_PATH
OUTCOME = sc.LABEL_OUTCOME
LOCK = sc.LABEL_LOCK
RESULT = sc.LABEL_RESULT
HOLDER_PATH = sc.LABEL_HOLDER_PATH
MODE = sc.LABEL_MODE

# Recording rules defined in deploy/prometheus/rules/kvobs-recording.yml that the dashboards read.
REC_ERROR_RATIO = "kvobs:transfer_error_ratio:rate5m"
REC_LOCK_WAIT_P99 = "kvobs:lock_wait_seconds:p99_5m"
REC_LOCK_HOLD_P99 = "kvobs:lock_hold_seconds:p99_5m"

Panel = Builder[dashboard_model.Panel]


def sel(*matchers: str) -> str:
    """`{engine=~"$engine",instance=~"$instance",...}`."""
    return "{" + ",".join([f'{ENGINE}=~"$engine"', f'{INSTANCE}=~"$instance"', *matchers]) + "}"


def rate(metric: str, *matchers: str) -> str:
    return f"rate({metric}{sel(*matchers)}[$__rate_interval])"


def quantile(q: float, histogram: str, by: str, *matchers: str) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) ({rate(histogram + '_bucket', *matchers)}))"


def query(expr: str, legend: str, ref: str = "A", *, exemplar: bool = False) -> prometheus.Dataquery:
    built = prometheus.Dataquery().datasource(DATASOURCE).ref_id(ref).expr(expr).legend_format(legend).range()
    return built.exemplar(True) if exemplar else built


def thresholds(*steps: tuple[str, float | None]) -> dashboard.ThresholdsConfig:
    return dashboard.ThresholdsConfig().mode(dashboard_model.ThresholdsMode.ABSOLUTE).steps(
        [dashboard_model.Threshold(color=color, value=value) for color, value in steps])


def red_at(value: float) -> dashboard.ThresholdsConfig:
    return thresholds(("green", None), ("red", value))


def timeseries_panel(title: str, description: str, queries: list[prometheus.Dataquery], unit: str, *,
                     stack: bool = False, alert_line: dashboard.ThresholdsConfig | None = None) -> timeseries.Panel:
    panel = (
        timeseries.Panel().title(title).description(description).datasource(DATASOURCE).targets(queries)
        .unit(unit).draw_style(common_model.GraphDrawStyle.LINE).line_width(1).fill_opacity(10)
        .show_points(common_model.VisibilityMode.NEVER).span_nulls(False)
        .legend(common.VizLegendOptions().display_mode(common_model.LegendDisplayMode.TABLE)
                .placement(common_model.LegendPlacement.BOTTOM).show_legend(True).calcs(["lastNotNull", "max"]))
        .tooltip(common.VizTooltipOptions().mode(common_model.TooltipDisplayMode.MULTI)
                 .sort(common_model.SortOrder.DESCENDING))
    )
    if stack:
        panel = panel.stacking(common.StackingConfig().mode(common_model.StackingMode.NORMAL).group("A"))
    if alert_line:
        panel = panel.thresholds(alert_line).thresholds_style(
            common.GraphThresholdsStyleConfig().mode(common_model.GraphThresholdsStyleMode.LINE_AND_AREA))
    return panel


def stat_panel(title: str, description: str, expr: str, legend: str, unit: str,
               steps: dashboard.ThresholdsConfig) -> stat.Panel:
    return (
        stat.Panel().title(title).description(description).datasource(DATASOURCE)
        .targets([query(expr, legend).format(prometheus_model.PromQueryFormat.TIME_SERIES)])
        .unit(unit).thresholds(steps)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False))
        .color_mode(common_model.BigValueColorMode.BACKGROUND).graph_mode(common_model.BigValueGraphMode.AREA)
        .text_mode(common_model.BigValueTextMode.AUTO).justify_mode(common_model.BigValueJustifyMode.AUTO)
        .orientation(common_model.VizOrientation.AUTO)
    )


def heatmap_panel(title: str, description: str, histogram: str) -> heatmap.Panel:
    expr = f"sum by (le) (increase({histogram}_bucket{sel()}[$__rate_interval]))"
    return (
        heatmap.Panel().title(title).description(description).datasource(DATASOURCE)
        .targets([query(expr, "{{le}}", exemplar=True).format(prometheus_model.PromQueryFormat.HEATMAP)])
        .calculate(False).cell_gap(1)
        .color(heatmap.HeatmapColorOptions().mode(heatmap_model.HeatmapColorMode.SCHEME).scheme("Oranges")
               .scale(heatmap_model.HeatmapColorScale.EXPONENTIAL).exponent(0.5).steps(64))
        .exemplars_color("rgba(255,0,255,0.7)")
        .y_axis(heatmap.YAxisConfig().unit("s").axis_placement(common_model.AxisPlacement.LEFT))
        .rows_frame(heatmap.RowsHeatmapOptions().layout(common_model.HeatmapCellLayout.AUTO))
        .mode(common_model.TooltipDisplayMode.SINGLE).show_y_histogram().show_legend()
        .scale_distribution(common.ScaleDistributionConfig().type(common_model.ScaleDistribution.LINEAR))
    )


def label_values_variable(name: str, selector: str) -> dashboard.QueryVariable:
    """A multi-select variable over the values of label `name`, "All" by default."""
    definition = f"label_values({selector}, {name})"
    return (
        dashboard.QueryVariable(name).label(name).datasource(DATASOURCE)
        .query({"query": definition, "refId": name})
        .refresh(dashboard_model.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dashboard_model.VariableSort.ALPHABETICAL_ASC)
        .multi(True).include_all(True).all_value(".*")
        .current(dashboard_model.VariableOption(text=["All"], value=["$__all"]))
    )


def build_dashboard(uid: str, title: str, description: str, panels: list[tuple[Panel, int, int]]) -> dict:
    """Panels as (builder, width, height), laid out left to right by the SDK and numbered from 1."""
    board = (
        dashboard.Dashboard(title).uid(uid).description(description).tags([TAG]).version(1).editable()
        .tooltip(dashboard_model.DashboardCursorSync.CROSSHAIR).time("now-1h", "now").refresh("10s")
        .timezone("browser")
        .annotation(dashboard.AnnotationQuery().name("Annotations & Alerts").built_in(1).enable(True).hide(True)
                    .icon_color("rgba(0, 211, 255, 1)").type("dashboard")
                    .datasource(dashboard_model.DataSourceRef(type_val="grafana", uid="-- Grafana --")))
        .link(dashboard.DashboardLink("kvobs dashboards").type(dashboard_model.DashboardLinkType.DASHBOARDS)
              .tags([TAG]).as_dropdown(False).include_vars(True).keep_time(True))
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
                       .current(dashboard_model.VariableOption(text="Prometheus", value="prometheus")))
        .with_variable(label_values_variable(ENGINE, sc.TRANSFERS_TOTAL))
        .with_variable(label_values_variable(INSTANCE, f'{sc.TRANSFERS_TOTAL}{{{ENGINE}=~"$engine"}}'))
    )
    for number, (panel, width, height) in enumerate(panels, start=1):
        board = board.with_panel(panel.id(number).span(width).height(height))
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def overview() -> dict:
    not_ok = f'{OUTCOME}!="{sc.OUTCOME_OK}"'
    return build_dashboard("kvobs-overview", "kvobs / Overview",
                           "KV-cache transfers on the prefetch, write_back and send paths.", [
        (timeseries_panel(
            "Transfers per second by path and outcome",
            "Guarded transfers ended per second. outcome: ok, error (the transfer or its completion failed), "
            "timeout (the cache lock was not acquired in time), rejected (refused before the copy: bad "
            "arguments, or corrupt blocks left out by the integrity policy), abandoned (never completed before "
            "its deadline).",
            [query(f"sum by ({PATH}, {OUTCOME}) ({rate(sc.TRANSFERS_TOTAL)})", "{{path}} {{outcome}}")],
            "ops", stack=True), 12, 8),
        (timeseries_panel(
            "Transfer duration p50 / p99 by path",
            "Wall time of a guarded transfer call (validation, lock wait, transfer, integrity check). Exemplar "
            "dots link to the trace of that transfer in Tempo.",
            [query(quantile(0.5, sc.TRANSFER_DURATION_SECONDS, PATH), "p50 {{path}}", "A", exemplar=True),
             query(quantile(0.99, sc.TRANSFER_DURATION_SECONDS, PATH), "p99 {{path}}", "B", exemplar=True)],
            "s"), 12, 8),
        (timeseries_panel(
            "Open transfers by path",
            "Transfers begun and not yet completed: holding their lock while the copy runs, in this process or "
            "elsewhere (a thread pool, a later engine step, an acknowledgement). A value that never returns to 0 "
            "is a completion that is not coming.",
            [query(f"sum by ({PATH}) ({sc.TRANSFERS_IN_FLIGHT}{sel()})", "{{path}}")], "short"), 6, 8),
        (timeseries_panel(
            "Oldest open transfer by path",
            "Age of the oldest transfer still waiting for its completion. It saw-tooths with normal copies; at "
            "the deadline (KVOBS_TRANSFER_DEADLINE, default 60s) the transfer is abandoned and "
            "KvobsTransferNeverCompleted fires.",
            [query(f"max by ({PATH}) ({sc.TRANSFER_OLDEST_OPEN_AGE_SECONDS}{sel()})", "{{path}}")], "s",
            alert_line=red_at(60)), 6, 8),
        (timeseries_panel(
            "Errors per second by path and outcome",
            "Transfers that did not end ok: error, timeout, rejected and abandoned, per path.",
            [query(f"sum by ({PATH}, {OUTCOME}) ({rate(sc.TRANSFERS_TOTAL, not_ok)})", "{{path}} {{outcome}}")],
            "ops", stack=True), 6, 8),
        (timeseries_panel(
            "Transfer error ratio (5m) by path",
            "Share of transfers ending in error, timeout or abandonment over 5 minutes (recording rule "
            f"{REC_ERROR_RATIO}); KvobsTransferErrorRatioHigh fires above 5% for 5m.",
            [query(f"max by ({PATH}) ({REC_ERROR_RATIO}{sel()})", "{{path}}")], "percentunit",
            alert_line=red_at(0.05)), 6, 8),
        (timeseries_panel(
            "Blocks per second by path",
            "KV blocks moved by guarded transfers.",
            [query(f"sum by ({PATH}) ({rate(sc.TRANSFER_BLOCKS_TOTAL)})", "{{path}}")], "short"), 12, 8),
        (timeseries_panel(
            "Bytes per second by path",
            "Bytes moved by guarded transfers.",
            [query(f"sum by ({PATH}) ({rate(sc.TRANSFER_BYTES_TOTAL)})", "{{path}}")], "Bps"), 12, 8),
    ])


def lock() -> dict:
    lock_path = f"{LOCK}, {PATH}"
    return build_dashboard("kvobs-lock", "kvobs / Cache lock",
                           "The cross-process cache lock around storage prefetch/write-back and the forward pass.", [
        (timeseries_panel(
            "Lock wait p50 / p99 by lock and path",
            "Time spent waiting for the cache lock before a transfer. High waits mean forward passes and "
            "transfers serialise behind each other. Exemplars link to traces.",
            [query(quantile(0.5, sc.LOCK_WAIT_SECONDS, lock_path), "p50 {{lock}} {{path}}", "A", exemplar=True),
             query(quantile(0.99, sc.LOCK_WAIT_SECONDS, lock_path), "p99 {{lock}} {{path}}", "B", exemplar=True)],
            "s"), 12, 8),
        (timeseries_panel(
            "Lock hold p50 / p99 by lock and path",
            "Time the cache lock was held per transfer. Exemplars link to traces.",
            [query(quantile(0.5, sc.LOCK_HOLD_SECONDS, lock_path), "p50 {{lock}} {{path}}", "A", exemplar=True),
             query(quantile(0.99, sc.LOCK_HOLD_SECONDS, lock_path), "p99 {{lock}} {{path}}", "B", exemplar=True)],
            "s"), 12, 8),
        (heatmap_panel("Lock wait heatmap", "Distribution of lock waits over time (all locks and paths selected).",
                       sc.LOCK_WAIT_SECONDS), 12, 8),
        (heatmap_panel("Lock hold heatmap", "Distribution of lock holds over time (all locks and paths selected).",
                       sc.LOCK_HOLD_SECONDS), 12, 8),
        (timeseries_panel(
            "Lock timeouts per second by lock and path",
            "Acquisitions that gave up after the lock timeout; each is a transfer with outcome=timeout. "
            "KvobsLockTimeouts fires on any.",
            [query(f"sum by ({lock_path}) ({rate(sc.LOCK_TIMEOUTS_TOTAL)})", "{{lock}} {{path}}")], "ops"), 8, 8),
        (timeseries_panel(
            "Time held by the current holder",
            "How long the current holder has held each lock; 0 when free. A line that keeps rising is a hung "
            "transfer or a leaked lock (KvobsLockHeldTooLong: above 5s for 1m).",
            [query(f"max by ({INSTANCE}, {LOCK}) ({sc.LOCK_HELD_SECONDS}{sel()})", "{{instance}} {{lock}}")], "s",
            alert_line=red_at(5)), 8, 8),
        (timeseries_panel(
            "Lock wait p99 (5m, as alerted)",
            f"Recording rule {REC_LOCK_WAIT_P99} (and {REC_LOCK_HOLD_P99}); KvobsLockWaitHigh fires when the "
            "wait p99 stays above 100ms for 10m.",
            [query(f"max by ({lock_path}) ({REC_LOCK_WAIT_P99}{sel()})", "wait {{lock}} {{path}}", "A"),
             query(f"max by ({lock_path}) ({REC_LOCK_HOLD_P99}{sel()})", "hold {{lock}} {{path}}", "B")],
            "s", alert_line=red_at(0.1)), 8, 8),
        (timeseries_panel(
            "Lock conflicts per second by path and holder path",
            "Acquisitions that had to wait, by the path that waited and the path holding what it wanted (with a "
            "block lock: the holder of some of the wanted blocks). A forward pass waiting on write-backs shows "
            "as path=forward, holder_path=write_back.",
            [query(f"sum by ({PATH}, {HOLDER_PATH}) ({rate(sc.LOCK_CONFLICTS_TOTAL)})",
                   "{{path}} waited for {{holder_path}}")], "ops", stack=True), 12, 8),
        (timeseries_panel(
            "Blocks claimed now by mode",
            "KV blocks claimed on the block lock at scrape time: shared (transfers reading blocks) and "
            "exclusive (prefetches and forward passes writing them). Always 0 for a whole-cache lock.",
            [query(f"sum by ({LOCK}, {MODE}) ({sc.LOCK_BLOCKS_CLAIMED}{sel()})", "{{lock}} {{mode}}")], "short"),
         12, 8),
    ])


def integrity() -> dict:
    bad = f'{RESULT}=~"{sc.CHECK_NAN}|{sc.CHECK_INF}"'
    clean = f'{RESULT}="{sc.CHECK_CLEAN}"'
    return build_dashboard("kvobs-integrity", "kvobs / KV integrity",
                           "NaN/Inf checks of KV blocks at the transfer boundary.", [
        (stat_panel(
            "Checks that found NaN/Inf (range)",
            "Integrity checks with result nan or inf over the dashboard time range. Anything above 0 pages "
            "(KvobsNaNDetected).",
            f"sum(increase({sc.NAN_CHECKS_TOTAL}{sel(bad)}[$__range]))", "bad checks", "short", red_at(1)), 6, 6),
        (stat_panel(
            "Bad blocks (range)",
            "KV blocks found holding NaN or Inf over the dashboard time range.",
            f"sum(increase({sc.NAN_BLOCKS_TOTAL}{sel()}[$__range]))", "bad blocks", "short", red_at(1)), 6, 6),
        (stat_panel(
            "Clean check share (range)",
            "Share of integrity checks that were clean.",
            f"sum(increase({sc.NAN_CHECKS_TOTAL}{sel(clean)}[$__range])) / "
            f"sum(increase({sc.NAN_CHECKS_TOTAL}{sel()}[$__range]))", "clean", "percentunit",
            thresholds(("red", None), ("green", 1))), 12, 6),
        (timeseries_panel(
            "NaN/Inf checks per second by path and result",
            "Integrity checks of exactly the blocks each transfer touched, by result (clean, nan, inf).",
            [query(f"sum by ({PATH}, {RESULT}) ({rate(sc.NAN_CHECKS_TOTAL)})", "{{path}} {{result}}")], "ops"),
         12, 8),
        (timeseries_panel(
            "Bad blocks per second by path",
            "KV blocks found holding NaN or Inf, per path. Which blocks: see the span event "
            f"{sc.EVENT_INTEGRITY_BAD_BLOCKS} ({sc.ATTR_BAD_BLOCK_IDS}) in Tempo.",
            [query(f"sum by ({PATH}) ({rate(sc.NAN_BLOCKS_TOTAL)})", "{{path}}")], "short",
            alert_line=red_at(1e-9)), 12, 8),
    ])


def signals() -> dict:
    buffered = sc.SIGNAL_BUFFERED_SECONDS + "_bucket"
    return build_dashboard("kvobs-signals", "kvobs / Early signals",
                           "Layer0 signals that arrive before their transfer task is registered.", [
        (timeseries_panel(
            "Pending early signals",
            "Early layer0 signals buffered because their transfer task was not registered yet.",
            [query(f"sum by ({INSTANCE}, {ENGINE}) ({sc.PENDING_SIGNALS}{sel()})", "{{instance}} {{engine}}")],
            "short"), 12, 8),
        (timeseries_panel(
            "Oldest pending signal age",
            "Age of the oldest buffered signal, fresh at scrape time. A line that keeps rising is a signal whose "
            "task never registered: a request that will hang (KvobsStalePendingSignal: above 5s for 15s).",
            [query(f"max by ({INSTANCE}, {ENGINE}) ({sc.PENDING_SIGNAL_OLDEST_AGE_SECONDS}{sel()})",
                   "{{instance}} {{engine}}")], "s", alert_line=red_at(5)), 12, 8),
        (timeseries_panel(
            "Signal outcomes per second",
            "ready (task already registered), buffered, recovered (buffered then matched), dropped_invalid, "
            "dropped_finished, expired, overflow, refused (a registration beyond max_slots, or a step record "
            "full: finish() or end_step() missing).",
            [query(f"sum by ({OUTCOME}) ({rate(sc.SIGNALS_TOTAL)})", "{{outcome}}")], "ops", stack=True), 12, 8),
        (timeseries_panel(
            "Time buffered p50 / p99",
            "How long an early signal waited before its task registered and it was recovered. Exemplars link "
            "to traces.",
            [query(f"histogram_quantile(0.5, sum by (le) ({rate(buffered)}))", "p50", "A", exemplar=True),
             query(f"histogram_quantile(0.99, sum by (le) ({rate(buffered)}))", "p99", "B", exemplar=True)],
            "s"), 12, 8),
        (heatmap_panel("Time buffered heatmap", "Distribution of time buffered.", sc.SIGNAL_BUFFERED_SECONDS),
         24, 8),
    ])


DASHBOARDS: dict[str, Callable[[], dict]] = {
    "kvobs-overview.json": overview,
    "kvobs-lock.json": lock,
    "kvobs-integrity.json": integrity,
    "kvobs-signals.json": signals,
}


def render(build: Callable[[], dict]) -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if dashboards/*.json differ from the builder")
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
