"""The engine threads that move KV blocks on a kvobs-guarded path (prefetch, write-back, send).

The prefetch and send threads decorate their copy method per instance (every run has its own observer) with
the same specs a user writes at class level, e.g.
`@obs.prefetch(keys="task.keys", block_ids="task.gpu_block_ids", sync="is_sync", cache="self.gpu_cache")`;
the write-back thread begins and completes its transfers itself (`obs.begin`, `t.complete`).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import kvobs
from kvobs.demo.stats import RunStats
from kvobs.demo.worker import Item, QueueWorker


@dataclass(eq=False, kw_only=True)
class TransferWorker(QueueWorker[Item]):
    """A queue worker whose items are copies of KV blocks through a method guarded by the run's observer."""

    observer: kvobs.KVObserver
    gpu_cache: torch.Tensor  # the paged cache, named as the specs name it ("self.gpu_cache")
    stats: RunStats

    def guarded(self, guard: Callable[[Callable[..., Any]], Callable[..., Any]],
                method: Callable[..., Any]) -> Callable[..., Any]:
        """`method` (a plain function of this class) decorated by `guard` and bound to this worker."""
        return types.MethodType(guard(method), self)
