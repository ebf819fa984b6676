"""The cache locks guarded transfers take: one lock for the whole cache, or a lock per block."""

from kvobs.locks._block_lock import BlockLock
from kvobs.locks._cache_lock import NullLock, ProcessLock, ThreadLock

__all__ = ["BlockLock", "NullLock", "ProcessLock", "ThreadLock"]
