"""What a NaN/Inf finding does (raise, skip, count) and how often to look (every Nth call, or a fraction).

Kept apart from `kvobs.integrity` so that configuring an observer never imports torch.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

POLICIES = ("raise", "skip", "count")


class Sampler:
    """Decides per call whether to check. Thread-safe: `next()` on an itertools.count and `random()` on a
    random.Random are single atomic C calls."""

    __slots__ = ("_every", "_fraction", "_counter", "_random")

    def __init__(self, every: int, fraction: float | None, rng: random.Random | None = None):
        self._every = every
        self._fraction = fraction
        self._counter = itertools.count()
        self._random = (rng or random.Random()).random

    def should_check(self) -> bool:
        """True for calls 1, N+1, 2N+1, ... with `every=N`; with probability `fraction` otherwise."""
        if self._fraction is not None:
            return self._random() < self._fraction
        return next(self._counter) % self._every == 0


@dataclass(frozen=True)
class IntegrityPolicy:
    """What to do with corrupt blocks and how often to check (default: every call).

    `raise`: CorruptKVError before the data moves on. `skip`: the transfer ends as outcome="rejected" and
    the decorated call (or `complete()`) returns `skip_result` instead (a copy of it), so code that must go
    on, such as a pool thread that sends the engine's done signal, never raises: a bad write-back or send is
    not performed; a bad prefetch returns e.g. `skip_result=[]`, "nothing loaded, recompute". Code that
    cannot be skipped (a with-block, `obs.begin`) raises instead. `count`: metrics and logs only.
    """

    mode: str = "raise"
    every: int = 1
    fraction: float | None = None
    skip_result: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise ValueError(f"unknown integrity mode {self.mode!r}; allowed: {', '.join(POLICIES)}")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be an int >= 1, got {self.every!r}")
        if self.fraction is not None:
            if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)):
                raise ValueError(f"fraction must be a number in (0, 1], got {self.fraction!r}")
            if not 0.0 < self.fraction <= 1.0:
                raise ValueError(f"fraction must be in (0, 1], got {self.fraction!r}")
            if self.every != 1:
                raise ValueError("give either every > 1 or fraction, not both")

    def sampler(self, rng: random.Random | None = None) -> Sampler:
        """A fresh sampler; pass a seeded `rng` for reproducible fraction sampling."""
        return Sampler(self.every, self.fraction, rng)
