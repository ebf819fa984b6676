"""Alert and recording rules (deploy/prometheus/rules) and the Alertmanager config, checked by the real tools.

promtool and amtool come from the Debian packages `prometheus` and `prometheus-alertmanager`; without them these
tests skip (and fail under CI=true). The structural checks run everywhere.
"""

from __future__ import annotations

import re

import pytest
from prometheus_client.utils import floatToGoString

from kvobs import semconv as sc
from ops_support import (
    ALERTMANAGER_CONFIG,
    PROM_CONFIG,
    RUNBOOK,
    RULE_TESTS,
    alert_rules,
    check_expr_names,
    exposed_series,
    load_yaml,
    recording_rules,
    require_binary,
    rule_files,
    run_tool,
    runbook_anchors,
    split_threshold,
)

# The alerts the issue asks for, each with the contract metric its expression must watch.
REQUIRED_ALERTS = {
    "KvobsStalePendingSignal": sc.PENDING_SIGNAL_OLDEST_AGE_SECONDS,
    "KvobsTransferNeverCompleted": sc.TRANSFERS_TOTAL,
    "KvobsNaNDetected": sc.NAN_CHECKS_TOTAL,
    "KvobsLockWaitHigh": "kvobs:lock_wait_seconds:p99_5m",
    "KvobsLockTimeouts": sc.LOCK_TIMEOUTS_TOTAL,
    "KvobsLockHeldTooLong": sc.LOCK_HELD_SECONDS,
    "KvobsTransferErrorRatioHigh": "kvobs:transfer_error_ratio:rate5m",
    "KvobsSignalsExpiring": sc.SIGNALS_TOTAL,
    "KvobsSignalsRefused": sc.SIGNALS_TOTAL,
    "KvobsTargetDown": "up",
}
SEVERITIES = {"critical", "warning"}
RUNBOOK_URL = re.compile(r"^https://\S+/docs/runbook\.md#(?P<anchor>[\w-]+)$")


def test_promtool_check_rules() -> None:
    promtool = require_binary("promtool")
    res = run_tool([promtool, "check", "rules", *map(str, rule_files())])
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_check_config() -> None:
    promtool = require_binary("promtool")
    res = run_tool([promtool, "check", "config", str(PROM_CONFIG)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rule files found" in res.stdout  # the rules were found through rule_files, not silently skipped


def test_promtool_test_rules() -> None:
    """Every alert fires when it should and stays silent when it should not (cases in the test file)."""
    promtool = require_binary("promtool")
    res = run_tool([promtool, "test", "rules", str(RULE_TESTS)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_amtool_check_config() -> None:
    amtool = require_binary("amtool")
    res = run_tool([amtool, "check-config", str(ALERTMANAGER_CONFIG)])
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize(("labels", "receiver"), [
    (["severity=critical", "alertname=KvobsStalePendingSignal"], "kvobs-pager"),
    (["severity=critical", "alertname=KvobsNaNDetected"], "kvobs-pager"),
    (["severity=warning", "alertname=KvobsLockWaitHigh"], "kvobs-tickets"),
])
def test_alertmanager_routes_by_severity(labels: list[str], receiver: str) -> None:
    amtool = require_binary("amtool")
    res = run_tool([amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER_CONFIG}", *labels])
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split() == [receiver], res.stdout


def test_required_alerts_exist_and_stale_signal_comes_first() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert sorted(names) == sorted(REQUIRED_ALERTS), names
    assert len(set(names)) == len(names)
    assert names[0] == "KvobsStalePendingSignal"
    for rule in rules:
        watched = REQUIRED_ALERTS[rule["alert"]]
        assert re.search(rf"(?<![\w:]){re.escape(watched)}(?![\w:])", rule["expr"]), (rule["alert"], rule["expr"])


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_alert_has_severity_summary_description_and_runbook(rule: dict) -> None:
    assert rule.get("labels", {}).get("severity") in SEVERITIES
    ann = rule.get("annotations", {})
    for key in ("summary", "description", "runbook_url"):
        assert ann.get(key, "").strip(), f"{rule['alert']} lacks annotation {key}"
    m = RUNBOOK_URL.match(ann["runbook_url"])
    assert m, ann["runbook_url"]
    assert m["anchor"] == rule["alert"].lower(), "the runbook anchor is the alert name, lower-cased"
    assert m["anchor"] in runbook_anchors(), f"docs/runbook.md has no section #{m['anchor']}"


def test_runbook_urls_share_one_base() -> None:
    bases = {r["annotations"]["runbook_url"].split("#")[0] for r in alert_rules()}
    assert len(bases) == 1, bases


def test_runbook_sections_say_what_to_check_and_do() -> None:
    text = RUNBOOK.read_text()
    for name in REQUIRED_ALERTS:
        section = text.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
        assert "**What it means.**" in section, name
        assert "**Check first.**" in section and "```promql" in section, name
        assert "**What to do.**" in section, name
        for block in re.findall(r"```promql\n(.*?)```", section, re.S):
            for line in block.splitlines():
                if line.strip() and not line.startswith("#"):
                    assert not check_expr_names(line.replace("ENGINE", "e").replace("INSTANCE", "i"),
                                                f"runbook {name}"), line


@pytest.mark.parametrize("rule", alert_rules() + recording_rules(), ids=lambda r: r.get("alert") or r["record"])
def test_rule_uses_only_contract_names(rule: dict) -> None:
    """Metrics from semconv (with _total/_bucket/_sum/_count as exposed) or recording rules; labels exist."""
    assert check_expr_names(rule["expr"], rule.get("alert") or rule["record"]) == []


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_alert_expr_is_signal_compared_to_threshold(rule: dict) -> None:
    # The integration test evaluates the signal side on a real Prometheus and rewrites thresholds.
    lhs, op, threshold = split_threshold(rule["expr"])
    assert lhs and op in {">", "==", "<", ">=", "<="}
    float(threshold)


def test_recording_rules_use_colon_names_and_raw_metrics_do_not() -> None:
    for rule in recording_rules():
        assert rule["record"].count(":") == 2 and rule["record"].startswith(sc.PREFIX + ":"), rule["record"]
    for name in sc.METRIC_LABELS:
        assert ":" not in name
        assert name.startswith(sc.PREFIX + "_"), name


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    tests = load_yaml(RULE_TESTS)["tests"]
    fires: dict[str, int] = {}
    silent: dict[str, int] = {}
    for case in tests:
        for check in case.get("alert_rule_test", []):
            bucket = fires if check.get("exp_alerts") else silent
            bucket[check["alertname"]] = bucket.get(check["alertname"], 0) + 1
    for name in REQUIRED_ALERTS:
        assert fires.get(name), f"no promtool case where {name} fires"
        assert silent.get(name), f"no promtool case where {name} stays silent"


def test_rule_test_inputs_carry_exact_kvobs_labels() -> None:
    """Input series of the promtool tests look like real scrapes: all contract labels plus job/instance."""
    series = exposed_series()
    selector = re.compile(r"^(?P<name>[\w:]+)\{(?P<labels>.*)\}$")
    for case in load_yaml(RULE_TESTS)["tests"]:
        for item in case["input_series"]:
            m = selector.match(item["series"])
            assert m, item["series"]
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
            expected, contract = series[m["name"]]
            assert set(labels) == expected, f"{item['series']}: labels {sorted(labels)} != {sorted(expected)}"
            problems = check_expr_names(item["series"], case["name"])
            assert problems == [], problems
            if "le" in labels and labels["le"] != "+Inf":
                assert labels["le"] in {floatToGoString(b) for b in sc.DEFAULT_LATENCY_BUCKETS}, labels["le"]
