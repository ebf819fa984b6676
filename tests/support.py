"""Small helpers shared by the core tests."""

from __future__ import annotations


def lock_is_free(lock) -> bool:
    """Probe a real lock: free means it can be taken (and is then given back) at once."""
    if lock.acquire(0):
        lock.release()
        return True
    return False
