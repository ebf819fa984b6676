"""What every SGLang hook shares: the lock rule, and the state both sides of a PD transfer keep."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from kvobs import KVObserver
from kvobs.integrations._common import HookFailures

if TYPE_CHECKING:
    from kvobs.integrations.sglang._carrier import RoomCarriers
    from kvobs.integrations.sglang._pd_caches import ManagerCaches

# Why an SGLang integration needs a lock that lets copies share (`_common.require_sharing_lock`).
COPIES_IN_FLIGHT = (
    "SGLang keeps many copies in flight (every node written through, several loads per step, one send per "
    "request) and acknowledges each only after the scheduler moves on"
)


class RoomHooks:
    """State both sides of a PD transfer share: the manager's caches, the rooms' trace carriers, the poll
    states that end a transfer, and one mutex for the per-object tables a subclass keeps."""

    def __init__(self, obs: KVObserver, caches: ManagerCaches, carriers: RoomCarriers, poll: Any) -> None:
        self.obs = obs
        self._caches = caches
        self._carriers = carriers
        self._success, self._failed = poll.Success, poll.Failed
        self._errors = HookFailures(obs)
        self._lock = threading.Lock()


def node_id(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`node_id` of `write`/`load(indices, priority=None, node_id=-1, ...)` however it was passed."""
    if "node_id" in kwargs:
        return kwargs["node_id"]
    return args[1] if len(args) > 1 else -1
