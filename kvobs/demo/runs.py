"""The demo's runs: named configurations of one engine, run one after another on one seeded workload.

A run is a column of the table and a key of the `--json` document. Every run executes the same engine code;
a run decides how the engine's `KVObserver` is configured (which cache lock, whether early signals are
buffered, which NaN/Inf policy) and whether the engine has adopted the engine-side fix kvobs cannot make
for it (a finished request's blocks freed only once their write-back completed).

The unguarded run is the engine as it was when the incidents happened: no lock, no buffer, blocks freed at
request finish. Freeing them at once is also the main source of the NaN its prefix hits are served, so
giving it the fix would understate the incident; it does not change its throughput.

The two guarded runs differ only in the cache lock: one lock for the whole cache (every transfer's copy
excludes every forward step), or `kvobs.BlockLock` (claims of disjoint blocks never wait for each other).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import kvobs

LOCK_NONE = "none"
LOCK_GLOBAL = "global"
LOCK_BLOCK = "block"
LOCK_KINDS = (LOCK_NONE, LOCK_GLOBAL, LOCK_BLOCK)
CACHE_LOCK_NAME = "kv_cache"
GUARDED_INTEGRITY = {"prefetch": "raise", "write_back": "raise", "send": "skip"}


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
    def claims_blocks(self) -> bool:
        """True: the lock is claimed per block, so a lock file is needed (see `make_lock`)."""
        return self.lock == LOCK_BLOCK

    @property
    def engine_label(self) -> str:
        return f"demo-{self.name.replace('_', '-')}"

    def make_lock(self, num_blocks: int, directory: str | None = None) -> Any:
        """The cache lock for the run's observer (None: kvobs takes no lock, it only observes). A block lock
        keeps its lock file in `directory`, which the caller creates and removes."""
        if self.lock == LOCK_GLOBAL:
            return kvobs.ThreadLock(CACHE_LOCK_NAME)
        if self.lock == LOCK_BLOCK:
            if directory is None:
                raise ValueError(f"run {self.name!r}: a block lock needs a directory for its lock file")
            return kvobs.BlockLock(CACHE_LOCK_NAME, num_blocks, directory=directory)
        return None


UNGUARDED = RunSpec(
    "unguarded", "kvobs observes only (no lock, no signal buffer, NaN checks only count)",
    guarded=False, lock=LOCK_NONE, buffer_signals=False, integrity="count", free_after_write_back=False,
)
GLOBAL_LOCK = RunSpec(
    "global_lock", "one lock for the whole cache around transfers and forward steps, early-signal buffer, "
    "NaN checks enforced, blocks freed after their write-back",
    guarded=True, lock=LOCK_GLOBAL, buffer_signals=True, integrity=GUARDED_INTEGRITY, free_after_write_back=True,
)
BLOCK_LOCK = RunSpec(
    "block_lock", "as global_lock, but kvobs.BlockLock: each transfer and forward step claims only its blocks",
    guarded=True, lock=LOCK_BLOCK, buffer_signals=True, integrity=GUARDED_INTEGRITY, free_after_write_back=True,
)

RUNS: tuple[RunSpec, ...] = (UNGUARDED, GLOBAL_LOCK, BLOCK_LOCK)
SERVED_RUNS: tuple[RunSpec, ...] = (GLOBAL_LOCK, BLOCK_LOCK)  # what `kvobs demo --serve` keeps running
