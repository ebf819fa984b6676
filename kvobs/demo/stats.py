"""What one run did, counted by the simulation itself: ground truth, never read back from kvobs.

Every engine thread counts into one `RunStats` through `add()`, so no component touches another's state.
The counters' meanings are documented with the `--json` schema in docs/demo.md.
"""

from __future__ import annotations

import threading
from collections import deque

COUNTERS: tuple[str, ...] = (
    # requests
    "requests_admitted", "requests_completed", "requests_aborted", "prefix_hits", "prefix_hit_blocks",
    # the incidents, and the stale blocks no NaN check can see
    "nan_blocks_written_to_storage", "nan_blocks_served_to_prefix_hits", "stale_blocks_written_to_storage",
    "lost_layer0_signals", "hung_sends",
    # transfers completed, refused or failed
    "prefetch_done", "write_back_done", "send_done",
    "prefetch_corrupt", "write_back_rejected", "write_back_skipped_busy", "send_rejected",
    "transfer_errors", "lock_timeouts",
    # signals, faults, steps
    "signals_recovered", "stale_signals_injected", "poisoned_storage_entries", "forward_steps",
    "prefix_probes", "forward_requests_deferred",
)
FORWARD_WAITS_KEPT = 20_000


class RunStats:
    """The run's counters, its length, the forward pass's own lock waits (their total, and the latest
    FORWARD_WAITS_KEPT for percentiles), and the time its scheduler spent asking the block lock."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.elapsed_s = 0.0
        self.forward_lock_waits: deque[float] = deque(maxlen=FORWARD_WAITS_KEPT)
        self.forward_lock_wait_total_s = 0.0
        self.prefix_probe_total_s = 0.0
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._lock = threading.Lock()

    def add(self, **counts: int) -> None:
        """Add to named counters, atomically across threads; an unknown name is a bug, raised at once."""
        unknown = counts.keys() - self._counts.keys()
        if unknown:
            raise KeyError(f"RunStats has no counter {sorted(unknown)}")
        with self._lock:
            for name, n in counts.items():
                self._counts[name] += n

    def forward_waited(self, seconds: float) -> None:
        """A forward step waited `seconds` for its lock (called by the forward thread only)."""
        self.forward_lock_waits.append(seconds)
        self.forward_lock_wait_total_s += seconds

    def probed(self, seconds: float, free: bool) -> None:
        """The scheduler asked the block lock whether a prefix was free (forward thread only)."""
        self.prefix_probe_total_s += seconds
        self.add(prefix_probes=1, forward_requests_deferred=0 if free else 1)

    def counters(self) -> dict[str, int]:
        """A consistent snapshot of every counter, plus `transfers_done` (all paths together)."""
        with self._lock:
            out = dict(self._counts)
        out["transfers_done"] = out["prefetch_done"] + out["write_back_done"] + out["send_done"]
        return out
