"""examples/cache_messager.py: early signals recovered once, drops counted by reason, TP ranks in step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "cache_messager.py"


def test_cache_messager_example_recovers_drops_and_keeps_ranks_in_step():
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "send started: slot 0, 128 tokens\n" in out
    assert "send started: slot 1, 64 tokens after waiting" in out
    assert out.count("send started") == 2  # the stale (slot 2), failed (3) and orphaned (7) signals never send
    assert "pending: 1, oldest waiting" in out and "expired: 1" in out
    assert "identical: True" in out
    assert "kvobs.signal.need_tokens=128 kvobs.signal.slot=2 kvobs.signal.tokens=512" in out  # stale, logged
    engine = 'engine="cache-messager-example"'
    for outcome, value in (("ready", 1), ("buffered", 4), ("recovered", 1), ("dropped_invalid", 1),
                           ("dropped_finished", 1), ("expired", 1)):
        assert f'kvobs_signals_total{{{engine},outcome="{outcome}"}} {value:.1f}' in out
