"""The lock rule of integrations that keep many copies open at once.

A transfer holds its lock until the engine reports its copy done, and such engines keep many copies in flight
(SGLang's write-throughs and loads, FastDeploy's per-layer sends). On one lock for the whole cache the
second copy would wait for the first one's completion, which the engine reports only later: a lock timeout
inside the engine. So the integration refuses such a lock when it is set up, not at the first copy.
"""

from __future__ import annotations

from typing import Any

from kvobs.errors import SharingLockRequired
from kvobs.locks._cache_lock import Claim

_TWO_READERS = (Claim("send", (0,), False), Claim("send", (1,), False))


def require_sharing_lock(obs: Any, integration: str, why: str) -> None:
    """SharingLockRequired unless two copies of different blocks can hold `obs.lock` at once (lock=None, a
    BlockLock). `why`: what the engine keeps open at once."""
    if obs.lock.overlaps(*_TWO_READERS):
        raise SharingLockRequired(integration, repr(obs.lock), why)
