"""HiCache: SGLang's device <-> host KV copies as kvobs write-back and prefetch transfers.

- `write(device_indices, ..., node_id)` queues the device -> host copy (its `start_writing()` runs inside,
  unless a hybrid controller is told `flush=False`; on a GPU the copy then runs on a stream): the write-back
  transfer begins before it, so the source pages are checked before it is queued. Corrupt sources (or a
  BlockLock that times out) are not copied: `write` answers None, SGLang's own answer when host memory is
  full, and the node stays on the device only. Nothing waits for an acknowledgement that will never come.
- At the write's acknowledgement the host pages it filled are checked: a NaN written into the device pages
  after `write` and before the copy ran (with lock=None nothing keeps the forward pass out) lands there, and
  only this check sees it. The write-back then ends in error (CorruptKVError, the host pages in
  `bad_block_ids`). SGLang has no failure path for a finished write-through (its tree publishes the host copy
  as the ack is taken), so the copy stays; a later load of it is checked at its destination again.
- `load(host_indices, ..., node_id)` only allocates destination slots and queues the host -> device copy: the
  prefetch transfer begins when it returns (on the slots it returned), its copy starts in `start_loading()`.
- Both complete when SGLang takes the copy's acknowledgement off its list (`acks.AckList`): destinations of a
  load are checked then, on the pages that moved. A corrupt load is recorded (outcome error, CorruptKVError,
  counted and logged) and never raised into SGLang's checks.

Token slots are mapped to pages with the controller's page size (`pages.PageIds`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvobs import Instrumentation, KVObserver, Transfer
from kvobs import semconv as sc
from kvobs.errors import CopyNotConfirmed, CorruptKVError, KVObsError, LockTimeout
from kvobs.integrations._common import HookFailures, require_sharing_lock
from kvobs.integrations.sglang._acks import AckList, AckWatcher
from kvobs.integrations.sglang._common import COPIES_IN_FLIGHT, node_id
from kvobs.integrations.sglang._pages import PageIds, host_page_views, page_views

DEVICE_POOL = "device_pool"
CacheOf = Callable[[Any], Any]


@dataclass(eq=False)
class ControllerState:
    """What kvobs keeps per HiCache controller."""

    ids: PageIds
    cache: Any
    bytes_per_slot: int | None
    writes: AckWatcher
    loads: AckWatcher
    host_cache: Any = None  # the host pool as pages, where a write's copy lands
    written: weakref.WeakKeyDictionary[Transfer, Any] = field(default_factory=weakref.WeakKeyDictionary)

    def nbytes(self, indices: Any) -> int | None:
        return None if self.bytes_per_slot is None else len(indices) * self.bytes_per_slot


class Controllers:
    """The hooks of `write` and `load`, and per-controller state created at a controller's first copy."""

    def __init__(self, obs: KVObserver, cache: CacheOf | str | None) -> None:
        self.obs = obs
        self._cache = cache
        self._errors = HookFailures(obs)
        self._states: weakref.WeakKeyDictionary[Any, ControllerState] = weakref.WeakKeyDictionary()
        self._states_lock = threading.Lock()
        self._inside = threading.local()  # a subclass's write/load calling the base's: observed once

    def state(self, controller: Any) -> ControllerState:
        state = self._states.get(controller)
        if state is None:
            with self._states_lock:
                state = self._states.get(controller) or self._attach(controller)
        return state

    def _observed(self, controller: Any) -> ControllerState | None:
        """The controller's state; None (logged once) when it cannot be observed, e.g. a page size that is
        not the observer's: a class instrumented before the server built its controller finds out only now,
        inside SGLang, where the copy must go on unobserved rather than fail."""
        try:
            return self.state(controller)
        except Exception as exc:  # noqa: BLE001
            self._errors("attach", exc)
            return None

    def _attach(self, controller: Any) -> ControllerState:
        ids = PageIds(self.obs.page_size, controller.page_size)
        writes = AckWatcher(sc.PATH_WRITE_BACK, self._errors, verify=lambda t: self._host_copy_corrupt(state, t))
        loads = AckWatcher(sc.PATH_PREFETCH, self._errors)
        cache = self._cache_for(controller)
        state = ControllerState(ids, cache, _bytes_per_slot(controller), writes, loads,
                                host_cache=None if cache is None else self._host_cache(controller))
        controller.ack_write_queue = AckList(controller.ack_write_queue, writes)
        controller.ack_load_queue = AckList(controller.ack_load_queue, loads)
        self._states[controller] = state
        return state

    def _cache_for(self, controller: Any) -> Any:
        if self._cache is None:
            return None
        if self._cache != DEVICE_POOL:
            return self._cache(controller)
        views, why = page_views(controller.mem_pool_device, controller.page_size)
        if views is None:
            self.obs.logger.warning("kvobs.sglang: HiCache copies observed without NaN/Inf checks", reason=why)
        return views

    def _host_cache(self, controller: Any) -> Any:
        views, why = host_page_views(controller.mem_pool_host, controller.page_size)
        if views is None:
            self.obs.logger.warning("kvobs.sglang: write-backs not checked on the host at their ack", reason=why)
        return views

    @staticmethod
    def _host_copy_corrupt(state: ControllerState, t: Transfer) -> BaseException | None:
        """At the write's ack: the host pages it filled, checked; the error that fails it, or None."""
        host_indices = state.written.pop(t, None)
        if host_indices is None or state.host_cache is None:
            return None
        found = t.check_copied(state.host_cache, state.ids.from_slots(host_indices))
        return None if found is None else CorruptKVError(sc.PATH_WRITE_BACK, found)

    def write(self, original: Callable[..., Any], controller: Any, device_indices: Any, *args: Any,
              **kwargs: Any) -> Any:
        state = None if getattr(self._inside, "on", False) else self._observed(controller)
        if state is None:
            return original(controller, device_indices, *args, **kwargs)
        try:
            t = self.obs.begin(sc.PATH_WRITE_BACK, block_ids=state.ids.from_slots(device_indices),
                               cache=state.cache, nbytes=state.nbytes(device_indices),
                               request_id=node_id(args, kwargs))
        except (CorruptKVError, LockTimeout):
            return None  # not copied (recorded): SGLang's answer when host memory is full
        except KVObsError:
            return self._call(original, controller, device_indices, *args, **kwargs)  # refused input: recorded
        state.writes.queued(t)
        try:
            host_indices = self._call(original, controller, device_indices, *args, **kwargs)
        except BaseException as exc:
            state.writes.unqueued(t)
            t.fail(exc)
            raise
        if host_indices is None:
            state.writes.unqueued(t)
            t.fail(CopyNotConfirmed(sc.PATH_WRITE_BACK, "SGLang had no host memory for it: nothing was copied"))
        else:
            state.written[t] = host_indices
        return host_indices

    def load(self, original: Callable[..., Any], controller: Any, host_indices: Any, *args: Any,
             **kwargs: Any) -> Any:
        state = None if getattr(self._inside, "on", False) else self._observed(controller)
        if state is None:
            return original(controller, host_indices, *args, **kwargs)
        device_indices = self._call(original, controller, host_indices, *args, **kwargs)
        if device_indices is None or len(device_indices) == 0:
            return device_indices
        try:
            t = self.obs.begin(sc.PATH_PREFETCH, block_ids=state.ids.from_slots(device_indices),
                               cache=state.cache, nbytes=state.nbytes(device_indices),
                               request_id=node_id(args, kwargs))
        except KVObsError:
            return device_indices  # recorded; the slots are SGLang's already, so the load goes on unobserved
        state.loads.queued(t)
        return device_indices

    def _call(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._inside.on = True
        try:
            return original(*args, **kwargs)
        finally:
            self._inside.on = False

    def detach(self) -> None:
        """Give every controller its plain lists back; transfers still open can no longer be completed."""
        with self._states_lock:
            states = list(self._states.items())
            self._states.clear()
        for controller, state in states:
            controller.ack_write_queue = list(controller.ack_write_queue)
            controller.ack_load_queue = list(controller.ack_load_queue)
            for t in state.writes.open_transfers() + state.loads.open_transfers():
                t.abandon()


def _bytes_per_slot(controller: Any) -> int | None:
    host = controller.mem_pool_host
    anchor = getattr(host, "anchor_entry", None)  # a hybrid controller's host pool group
    size = getattr(anchor.host_pool if anchor is not None else host, "size_per_token", None)
    return size if isinstance(size, int) else None


def instrument_hicache(obs: KVObserver, target: Any = None, *,
                       cache: CacheOf | str | None = DEVICE_POOL) -> Instrumentation:
    """Observe HiCache's copies: `target` is a controller object, a controller class, or None for SGLang's
    `HiCacheController` and `HybridCacheController` (the radix cache's). `cache`: "device_pool" checks the
    controller's own device KV pool; a callable(controller) returns what to check; None checks nothing.
    Returns the undo handle. The observer's lock must be None or a BlockLock (`SharingLockRequired`); a
    controller already instrumented for another observer is refused (`AlreadyInstrumented`)."""
    require_sharing_lock(obs, "instrument_hicache", COPIES_IN_FLIGHT)
    if cache is not None and cache != DEVICE_POOL and not callable(cache):
        raise TypeError(f"cache must be 'device_pool', a callable(controller) or None, got {cache!r}")
    hooks = Controllers(obs, cache)
    patches = Instrumentation(owner=obs)
    patches.add(hooks.detach)
    try:
        for each in _controller_classes() if target is None else [target]:
            if not patches.claims(each, "write", "load"):
                continue  # kvobs observes it already, for this observer
            if not isinstance(each, type):
                hooks.state(each)  # a controller object: checked (page size) and its lists watched from now on
            patches.wrap_method(each, "write", hooks.write)
            patches.wrap_method(each, "load", hooks.load)
    except BaseException:
        patches.undo()
        raise
    return patches


def _controller_classes() -> list[type]:
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        HybridCacheController,
    )

    return [HiCacheController, HybridCacheController]
