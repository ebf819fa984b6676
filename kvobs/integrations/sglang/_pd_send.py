"""The PD prefill side: `CommonKVSender.send` / `poll` as send transfers, and the trace context shipped to decode.

`send(kv_indices, ...)` takes page indices and only queues the copy (`kv_mgr.add_transfer_request`); a
backend thread moves the data and sets the room's status, which `poll()` reports. A request is sent in
chunks (chunked prefill): each `send` is one transfer, begun before the chunk is queued (its source pages
checked then), all of a request's transfers completed when `poll()` first reports Success, failed when it
reports Failed, failed by `abort()`. The chunks of one request form one trace: later chunks continue the
first chunk's span, whose carrier also travels to decode (`carrier`).

Corrupt source pages (or a BlockLock timing out) are not queued: the room is failed through SGLang's own
path (`kv_mgr.conclude_failure`: failure recorded, status Failed, decode told), so the prefill scheduler
aborts the request at its next poll and the decode side stops waiting. Nothing hangs.

The copy runs later, on the backend's thread, so a NaN written into a page after `send` checked it and before
the copy (lock=None keeps nobody out) would go to decode. When the backend concludes the room with Success
(`conclude_transfer`, before SGLang tells anyone), the room's sent pages are checked again: corrupt ones turn
the conclusion into Failed with kvobs's reason, so both nodes fail the request through SGLang's path, and the
sends end in error (CorruptKVError). This sees what is still in the pages when the copy is done; a page
changed back before that, or garbled on the wire, is the decode side's check (`pd_receive`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvobs import KVObserver, Transfer
from kvobs import semconv as sc
from kvobs.errors import CopyNotConfirmed, CorruptKVError, KVObsError, LockTimeout
from kvobs.integrations.sglang._carrier import RoomCarriers, with_trace_context
from kvobs.integrations.sglang._common import RoomHooks
from kvobs.integrations.sglang._pd_caches import ManagerCaches


@dataclass(eq=False)
class SenderState:
    transfers: list[Transfer] = field(default_factory=list)  # open chunks
    carrier: dict[str, str] | None = None  # the first chunk's trace context


class Senders(RoomHooks):
    """Hooks of CommonKVSender (send, poll, poll_pp_consensus, abort) and of the manager's status encoder."""

    def __init__(self, obs: KVObserver, caches: ManagerCaches, carriers: RoomCarriers, poll: Any) -> None:
        super().__init__(obs, caches, carriers, poll)
        self._states: weakref.WeakKeyDictionary[Any, SenderState] = weakref.WeakKeyDictionary()

    def _state(self, sender: Any) -> SenderState:
        with self._lock:
            return self._states.setdefault(sender, SenderState())

    def send(self, original: Callable[..., Any], sender: Any, kv_indices: Any, *args: Any, **kwargs: Any) -> Any:
        if sender.conclude_state is not None:
            return original(sender, kv_indices, *args, **kwargs)  # concluded: SGLang returns at once
        state = self._state(sender)
        try:
            view = self._caches.of(sender.kv_mgr)
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be had: the send goes on unobserved
            self._errors("send_cache", exc)
            return original(sender, kv_indices, *args, **kwargs)
        try:
            t = self.obs.begin(sc.PATH_SEND, block_ids=view.ids.from_pages(kv_indices), cache=view.cache,
                               request_id=sender.bootstrap_room, trace_context=state.carrier)
        except (CorruptKVError, LockTimeout) as exc:
            self._stop(sender, exc)
            return None
        except KVObsError:
            return original(sender, kv_indices, *args, **kwargs)  # refused input: recorded, sent unobserved
        state.transfers.append(t)
        if state.carrier is None:
            state.carrier = t.carrier()
            if state.carrier:
                self._carriers.put(sender.bootstrap_room, state.carrier)
        try:
            return original(sender, kv_indices, *args, **kwargs)
        except BaseException as exc:
            state.transfers.remove(t)
            t.fail(exc)
            raise

    def _stop(self, sender: Any, exc: BaseException) -> None:
        """Fail the room the way SGLang's transfer threads do, so every party learns it ended."""
        room, manager, reason = sender.bootstrap_room, sender.kv_mgr, f"kvobs stopped the send: {exc}"
        try:
            conclude = getattr(manager, "conclude_failure", None)
            if conclude is not None:
                conclude(bootstrap_room=room, failure_reason=reason)
            else:
                manager.record_failure(room, reason)
                manager.update_status(room, self._failed)
        except Exception as error:  # noqa: BLE001
            self._errors("send_stop", error)

    def conclude(self, original: Callable[..., Any], manager: Any, *args: Any, **kwargs: Any) -> Any:
        """`conclude_transfer`: a Success whose sent pages are corrupt now is concluded as Failed instead."""
        try:
            if kwargs.get("status") == self._success:
                reason = self._sent_corrupt(manager, kwargs.get("bootstrap_room"))
                if reason is not None:
                    kwargs = {**kwargs, "status": self._failed, "failure_reason": reason}
        except Exception as exc:  # noqa: BLE001 - on the backend's transfer thread
            self._errors("send_conclude", exc)
        return original(manager, *args, **kwargs)

    def _sent_corrupt(self, manager: Any, room: Any) -> str | None:
        """Check the room's open sends on their sources again; fail the corrupt ones. The reason, or None."""
        with self._lock:
            transfers = [t for sender, state in self._states.items()
                         if sender.kv_mgr is manager and sender.bootstrap_room == room for t in state.transfers]
        bad: list[int] = []
        for t in transfers:
            found = t.check_copied() if t.outcome is None else None
            if found is not None:
                t.fail(CorruptKVError(sc.PATH_SEND, found))
                bad.extend(found.bad_block_ids)
        return f"kvobs found NaN/Inf in the sent KV pages {sorted(bad)[:8]}" if bad else None

    def poll(self, original: Callable[..., Any], sender: Any, *args: Any, **kwargs: Any) -> Any:
        status = original(sender, *args, **kwargs)
        if status == self._success:
            self._end(sender, None)
        elif status == self._failed:
            self._end(sender, self._reason(sender, "SGLang reported the transfer failed"))
        return status

    def abort(self, original: Callable[..., Any], sender: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(sender, *args, **kwargs)
        finally:
            self._end(sender, "the request was aborted")

    def _reason(self, sender: Any, default: str) -> str:
        records = getattr(sender.kv_mgr, "failure_records", None)
        reason = records.get(sender.bootstrap_room) if isinstance(records, dict) else None
        return str(reason) if reason else default

    def _end(self, sender: Any, failure: str | None) -> None:
        with self._lock:
            state = self._states.get(sender)
            transfers, state.transfers = (state.transfers, []) if state is not None else ([], [])
        try:
            for t in transfers:
                if failure is None:
                    t.complete()
                else:
                    t.fail(CopyNotConfirmed(sc.PATH_SEND, failure))
        except Exception as exc:  # noqa: BLE001 - inside the scheduler's poll
            self._errors("send_end", exc)

    def encode(self, original: Callable[..., Any], manager: Any, *args: Any, **kwargs: Any) -> Any:
        """`_encode_kv_status_message`: a terminal status carries the request's trace context to decode."""
        parts = original(manager, *args, **kwargs)
        try:
            if kwargs.get("status") in (self._success, self._failed):
                carrier = self._carriers.get(kwargs.get("bootstrap_room"))
                if carrier:
                    return with_trace_context(parts, carrier, carries_reason=manager.kv_status_msg_carries_reason)
        except Exception as exc:  # noqa: BLE001
            self._errors("status_encode", exc)
        return parts

    def open_transfers(self) -> list[Transfer]:
        with self._lock:
            return [t for state in self._states.values() for t in state.transfers if t.outcome is None]
