"""The block lock's targets, judged on one demo's runs (same seed, same length):

- the forward pass's lock wait, p99 and total: the block-lock run removes at least 90% of the global-lock
  run's;
- throughput: the block-lock run's is at least 90% of the unguarded run's, whose hung requests are not
  counted (throughput counts completed requests only; a hung send is aborted, never served).

A target whose runs are not in the summary is left out; one whose baseline measured nothing has `met: null`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

RUN = "block_lock"
REQUIRED = 0.9

# name -> (field, baseline run, kind): a "reduction" target compares 1 - run/baseline, a "ratio" run/baseline.
TARGETS: dict[str, tuple[str, str, str]] = {
    "forward_lock_wait_p99": ("forward_lock_wait_p99_s", "global_lock", "reduction"),
    "forward_lock_wait_total": ("forward_lock_wait_total_s", "global_lock", "reduction"),
    "throughput": ("throughput_per_s", "unguarded", "ratio"),
}


def targets(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each target whose runs are present: the two values, the score (`reduction` or `ratio`), `required`
    and `met`."""
    run = runs.get(RUN)
    if run is None:
        return {}
    out = {}
    for name, (field, baseline_name, kind) in TARGETS.items():
        baseline = runs.get(baseline_name)
        if baseline is not None:
            out[name] = judge(field, run[field], baseline_name, baseline[field], kind)
    return out


def judge(field: str, value: float | None, baseline_name: str, baseline: float | None, kind: str) -> dict[str, Any]:
    """One target: `score` is None (and `met` None) when either value is missing or the baseline is 0."""
    score = None
    if value is not None and baseline:
        score = round(1.0 - value / baseline if kind == "reduction" else value / baseline, 4)
    return {
        "field": field, "run": RUN, "baseline": baseline_name, "run_value": value, "baseline_value": baseline,
        kind: score, "required": REQUIRED, "met": None if score is None else score >= REQUIRED,
    }
