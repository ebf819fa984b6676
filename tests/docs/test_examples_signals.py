"""examples/cache_messager.py: three threads around one buffer; early signals recovered once and sent through
obs.send, drops counted by reason, TP ranks in step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "cache_messager.py"


def test_cache_messager_example_recovers_sends_drops_and_keeps_ranks_in_step():
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env,
                          cwd=SCRIPT.parent.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    sends = [line for line in out.splitlines() if line.startswith("send started")]
    assert len(sends) == 2, out + proc.stderr  # the stale (slot 2), failed (3) and orphaned (7) signals never send
    assert sends[0] == "send started: slot 0, 128 tokens"  # registered first: ready at once
    assert sends[1].startswith("send started: slot 1, 64 tokens after waiting")  # recovered when it registered
    assert "slot 2 registered, stale signal dropped: True" in out
    assert "pending: 1, oldest waiting" in out and "expired: 1" in out
    assert "identical: True" in out
    assert "kvobs.signal.need_tokens=128 kvobs.signal.slot=2 kvobs.signal.tokens=512" in out  # stale, logged
    engine = 'engine="cache-messager-example"'
    for outcome, value in (("ready", 1), ("buffered", 4), ("recovered", 1), ("dropped_invalid", 1),
                           ("dropped_finished", 1), ("expired", 1)):
        assert f'kvobs_signals_total{{{engine},outcome="{outcome}"}} {value:.1f}' in out
    assert 'kvobs_signals_total{' + engine + ',outcome="overflow"}' not in out  # zero lines are not printed
    assert f'kvobs_transfers_total{{{engine},outcome="ok",path="send"}} 2.0' in out  # both sends guarded
