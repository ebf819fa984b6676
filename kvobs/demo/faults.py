"""Injected faults (`kvobs demo --fault ...`): what an operator's alerts and dashboards should see."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvobs.demo.messager import PHANTOM_SLOT
from kvobs.demo.messages import LayerReady
from kvobs.demo.stats import RunStats
from kvobs.demo.storage import StorageCache
from kvobs.demo.workload import Workload

POISONED_PREFIX_BLOCKS = 2  # poison only the first blocks of each family: the ones every hit loads


def inject_stale_signal(signal: Callable[[LayerReady], None], stats: RunStats, tokens: int) -> None:
    """`--fault stale-signal`: a layer0 signal for a slot whose task never registers."""
    stats.add(stale_signals_injected=1)
    signal(LayerReady(PHANTOM_SLOT, 0, tokens))


@dataclass(eq=False, kw_only=True)
class StoragePoisoner:
    """`--fault nan`: every `interval_s`, replace a stored prefix block with NaN."""

    stop: threading.Event
    storage: StorageCache
    stats: RunStats
    families: int
    interval_s: float
    seed: int

    def run(self) -> None:
        keys = [Workload.family_key(f, j) for f in range(self.families) for j in range(POISONED_PREFIX_BLOCKS)]
        rng = random.Random(self.seed ^ 0x5EED)
        while not self.stop.wait(self.interval_s):
            stored = [key for key in keys if key in self.storage]
            if stored and self.storage.poison(rng.choice(stored)):
                self.stats.add(poisoned_storage_entries=1)
