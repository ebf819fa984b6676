"""The demo's runs: named configurations of one engine, run one after another on one seeded workload.

A run is a column of the table and a key of the `--json` document. Every run executes the same engine code;
a run decides how the engine's `KVObserver` is configured (which cache lock, whether early signals are
buffered, which NaN/Inf policy) and whether the engine has adopted the engine-side fix kvobs cannot make
for it (a finished request's blocks freed only once their write-back completed). Adding a run (a
block-granular lock, say) is one more entry in `RUNS`.

The unguarded run is the engine as it was when the incidents happened: no lock, no buffer, blocks freed at
request finish. Freeing them at once is also the main source of the NaN its prefix hits are served, so
giving it the fix would understate the incident; it does not change its throughput.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import kvobs

LOCK_NONE = "none"
LOCK_GLOBAL = "global"
LOCK_KINDS = (LOCK_NONE, LOCK_GLOBAL)
CACHE_LOCK_NAME = "kv_cache"


@dataclass(frozen=True)
class RunSpec:
    """How kvobs is configured for one run.

    name: the table's column and the key under `runs` in `--json`.
    legend: one line under the table's title saying what the run does.
    guarded: whether kvobs's protections are in force: the run must then show no incident, where an unguarded
        run is there to reproduce them.
    lock: which cache lock the transfers and the forward pass take (`LOCK_KINDS`).
    buffer_signals: whether the messager keeps early layer0 signals in kvobs's EarlySignalBuffer.
    integrity: the observer's NaN/Inf policy (a policy name or a mapping from path to one).
    free_after_write_back: the engine-side fix: a finished request's blocks go back to the allocator only
        once their write-back completed (False: at once, while the write-back may still be queued).
    """

    name: str
    legend: str
    guarded: bool
    lock: str
    buffer_signals: bool
    integrity: Any
    free_after_write_back: bool

    def __post_init__(self) -> None:
        if self.lock not in LOCK_KINDS:
            raise ValueError(f"run {self.name!r}: unknown lock kind {self.lock!r}; known: {', '.join(LOCK_KINDS)}")

    @property
    def takes_lock(self) -> bool:
        """False: kvobs takes no lock in this run, so it has no lock wait to report."""
        return self.lock != LOCK_NONE

    @property
    def engine_label(self) -> str:
        return f"demo-{self.name.replace('_', '-')}"

    def make_lock(self) -> Any:
        """The cache lock for the run's observer (None: kvobs takes no lock, it only observes)."""
        return kvobs.ThreadLock(CACHE_LOCK_NAME) if self.lock == LOCK_GLOBAL else None


UNGUARDED = RunSpec(
    "unguarded", "kvobs observes only (no lock, no signal buffer, NaN checks only count)",
    guarded=False, lock=LOCK_NONE, buffer_signals=False, integrity="count", free_after_write_back=False,
)
GUARDED = RunSpec(
    "guarded", "cache lock around transfers and forward steps, early-signal buffer, NaN checks enforced, "
    "blocks freed after their write-back",
    guarded=True, lock=LOCK_GLOBAL, buffer_signals=True,
    integrity={"prefetch": "raise", "write_back": "skip", "send": "skip"}, free_after_write_back=True,
)

RUNS: tuple[RunSpec, ...] = (UNGUARDED, GUARDED)
SERVED_RUN = GUARDED  # what `kvobs demo --serve` keeps running

