"""Everything a transfer on one path of one observer needs, built once per path by the observer.

A route is the only thing a Transfer knows of its observer: the lock and its timeout, the deadline, the
integrity policy, the telemetry recorder, the table of open transfers. So the lifecycle depends on no
observer, and per-guard variants (another integrity policy) are a copy of a route.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvobs._lifecycle.cache_checks import CacheCheck
from kvobs._lifecycle.fast_lane import lane_of
from kvobs._lifecycle.open_transfers import OpenTransfers
from kvobs.locks._cache_lock import CacheLock, Claim, NullLock
from kvobs.policy import IntegrityPolicy, Sampler
from kvobs.telemetry._recorder import Recorder


@dataclass(eq=False)
class Route:
    """The settings and collaborators of one path (or lock holder) of one observer."""

    path: str
    lock: CacheLock
    lock_timeout: float
    deadline_s: float
    reads_blocks: bool  # write-back, send: shared claims, sources checked at begin
    policy: IntegrityPolicy | None
    sampler: Sampler | None
    capacity: int | None
    page_size: int | None
    sync_required: bool
    recorder: Recorder
    open: OpenTransfers | None  # None for lock holders that are not transfers (the forward pass)
    caches: CacheCheck

    def __post_init__(self) -> None:
        self.whole_cache = Claim(self.path, (), not self.reads_blocks)
        # no lock (`lock=None`): nobody ever waits, so a transfer has no claim to build or take, and no re-entry
        # can wait for itself
        self.lock_free = isinstance(self.lock, NullLock)
        self.conflicted = self.recorder.conflicted
        self.lane = lane_of(self)  # the lifecycle's fast path, for transfers on a lock that has one
