"""What a NaN/Inf finding does (raise, skip, count) and how often to look (every Nth call, or a fraction).

Kept apart from `kvobs.integrity` so that configuring an observer never imports torch.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

POLICIES = ("raise", "skip", "count")


@dataclass(frozen=True)
class IntegrityPolicy:
    """`raise`: CorruptKVError before the data moves on. `skip`: a bad write-back or send is not performed
    (the call returns None, counted as outcome="rejected"); a prefetch cannot be undone, so it raises.
    `count`: metrics and logs only. `every`/`fraction` sample calls; the default checks every call."""

    mode: str = "raise"
    every: int = 1
    fraction: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise ValueError(f"integrity policy {self.mode!r} is unknown; use one of {', '.join(POLICIES)}")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be an int >= 1, got {self.every!r}")
        if self.fraction is not None:
            if not isinstance(self.fraction, (int, float)) or not 0 < self.fraction <= 1:
                raise ValueError(f"fraction must be in (0, 1], got {self.fraction!r}")
            if self.every != 1:
                raise ValueError("give either every or fraction, not both")

    def sampler(self, rng: random.Random | None = None) -> Sampler:
        return Sampler(self.every, self.fraction, rng)


class Sampler:
    """Decides per call whether to check; cheap and thread-safe (itertools.count and random are atomic)."""

    def __init__(self, every: int = 1, fraction: float | None = None, rng: random.Random | None = None) -> None:
        self._every = every
        self._fraction = fraction
        self._counter = itertools.count()
        self._random = (rng or random.Random()).random

    def should_check(self) -> bool:
        if self._fraction is not None:
            return self._random() < self._fraction
        return self._every == 1 or next(self._counter) % self._every == 0
