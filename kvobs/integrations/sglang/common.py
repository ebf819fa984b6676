"""What every SGLang hook shares: the lock rule, reporting a hook's own failure without raising, and the
state both sides of a PD transfer keep."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from kvobs.locks import ProcessLock, ThreadLock
from kvobs.observer import KVObserver

if TYPE_CHECKING:
    from kvobs.integrations.sglang.carrier import RoomCarriers
    from kvobs.integrations.sglang.pd_caches import ManagerCaches


def refuse_global_lock(obs: KVObserver) -> None:
    """SGLang keeps many copies in flight (every node written through, several loads per step, one send per
    request). A transfer holds its lock until SGLang acknowledges the copy, so on one global lock the second
    copy would wait for the first acknowledgement, which comes only after the scheduler moves on: a lock
    timeout inside the engine. Refused when the integration is set up, not at the first request."""
    if isinstance(obs.lock, (ThreadLock, ProcessLock)):
        raise ValueError(  # noqa: TRY004 - a kvobs lock, the wrong kind for SGLang
            f"the observer's lock {obs.lock.name!r} is one lock for the whole cache, held by every transfer until "
            "SGLang acknowledges its copy; SGLang keeps many copies in flight, so they would wait on each other "
            "and time out. Build the observer with lock=None (observe and check only) or a "
            "kvobs.block_lock.BlockLock (copies of different pages never wait on each other)"
        )


class HookErrors:
    """Logs a failure of kvobs's own hook code once per stage; the engine never sees it."""

    def __init__(self, obs: KVObserver) -> None:
        self._logger = obs.logger
        self._seen: set[str] = set()

    def __call__(self, stage: str, exc: BaseException) -> None:
        if stage in self._seen:
            return
        self._seen.add(stage)
        try:
            self._logger.error("kvobs.sglang: a hook failed; SGLang went on unobserved", stage=stage,
                               error=repr(exc))
        except Exception:  # noqa: BLE001, S110 - a broken logger must not break the engine either
            pass


class RoomHooks:
    """State both sides of a PD transfer share: the manager's caches, the rooms' trace carriers, the poll
    states that end a transfer, and one mutex for the per-object tables a subclass keeps."""

    def __init__(self, obs: KVObserver, caches: ManagerCaches, carriers: RoomCarriers, poll: Any) -> None:
        self.obs = obs
        self._caches = caches
        self._carriers = carriers
        self._success, self._failed = poll.Success, poll.Failed
        self._errors = HookErrors(obs)
        self._lock = threading.Lock()


def node_id(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`node_id` of `write`/`load(indices, priority=None, node_id=-1, ...)` however it was passed."""
    if "node_id" in kwargs:
        return kwargs["node_id"]
    return args[1] if len(args) > 1 else -1
