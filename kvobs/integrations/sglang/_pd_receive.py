"""The PD decode side: KV arriving into the decode node's pages as receive transfers, continuing the trace of
the prefill node's send.

`CommonKVReceiver.send_metadata(kv_indices, ...)` tells the prefill node which decode pages to write; the
prefill's status message (parsed by the manager's `parse_kv_status_message`, on its listener thread) then
says the data landed, and the receiver's `poll()` reports Success to the decode scheduler. The trace context
can only arrive with that message (it is the first thing the prefill node sends after its send began), so
the receive transfer is begun and completed when `poll()` first reports Success: its span is a child of the
prefill's send span, and the destination pages are checked then, before the decode scheduler uses them.

Corrupt destination pages (under the "raise" or "skip" policy) are not handed to the decode: the room is
failed as SGLang fails it (failure recorded, status Failed) and `poll()` answers Failed, so the scheduler
aborts the request through its usual path. A room that fails is recorded as a failed receive.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from kvobs import KVObserver
from kvobs import semconv as sc
from kvobs.errors import CopyNotConfirmed, CorruptKVError, KVObsError
from kvobs.integrations._common import int_list
from kvobs.integrations.sglang._carrier import RoomCarriers, split_trace_context
from kvobs.integrations.sglang._common import RoomHooks
from kvobs.integrations.sglang._pd_caches import ManagerCaches


class Receivers(RoomHooks):
    """Hooks of CommonKVReceiver (send_metadata, poll) and of the manager's status parser."""

    def __init__(self, obs: KVObserver, caches: ManagerCaches, carriers: RoomCarriers, poll: Any) -> None:
        super().__init__(obs, caches, carriers, poll)
        self._pages: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def send_metadata(self, original: Callable[..., Any], receiver: Any, kv_indices: Any, *args: Any,
                      **kwargs: Any) -> Any:
        result = original(receiver, kv_indices, *args, **kwargs)
        with self._lock:
            self._pages[receiver] = int_list(kv_indices)
        return result

    def parse(self, original: Callable[..., Any], manager: Any, msg: Any, *args: Any, **kwargs: Any) -> Any:
        """`parse_kv_status_message`: SGLang parses the message as the prefill node sent it; the carrier kvobs
        added is kept for the room."""
        carrier = None
        try:
            msg, carrier = split_trace_context(msg, tagged=manager.kv_status_msg_tag is not None,
                                               carries_reason=manager.kv_status_msg_carries_reason)
        except Exception as exc:  # noqa: BLE001 - on SGLang's listener thread
            self._errors("status_parse", exc)
        parsed = original(manager, msg, *args, **kwargs)
        if parsed is not None and carrier is not None:
            self._carriers.put(parsed[0], carrier)
        return parsed

    def poll(self, original: Callable[..., Any], receiver: Any, *args: Any, **kwargs: Any) -> Any:
        status = original(receiver, *args, **kwargs)
        if status != self._success and status != self._failed:
            return status
        with self._lock:
            pages = self._pages.pop(receiver, None)
        if pages is None:
            return status  # not observed (no metadata sent through kvobs), or already recorded
        try:
            if status == self._success:
                return self._received(receiver, pages)
            self._failed_receive(receiver, pages)
        except Exception as exc:  # noqa: BLE001 - inside the decode scheduler's poll
            self._errors("receive", exc)
        return status

    def _begin(self, receiver: Any, pages: Any) -> Any:
        room = receiver.bootstrap_room
        view = self._caches.of(receiver.kv_mgr)
        return self.obs.begin(sc.PATH_RECEIVE, block_ids=view.ids.from_pages(pages), cache=view.cache,
                              request_id=room, trace_context=self._carriers.pop(room))

    def _received(self, receiver: Any, pages: Any) -> Any:
        try:
            t = self._begin(receiver, pages)
            t.complete()
            bad = t.bad_block_ids
        except CorruptKVError as exc:
            bad = exc.bad_block_ids
        except KVObsError:
            return self._success  # refused or timed out: recorded; SGLang's answer stands
        if not bad:
            return self._success
        return self._fail_room(receiver, f"kvobs found NaN/Inf in the received KV pages {list(bad)[:8]}")

    def _fail_room(self, receiver: Any, reason: str) -> Any:
        manager, room = receiver.kv_mgr, receiver.bootstrap_room
        manager.record_failure(room, reason)
        manager.update_status(room, self._failed)
        receiver.conclude_state = self._failed
        return self._failed

    def _failed_receive(self, receiver: Any, pages: Any) -> None:
        records = getattr(receiver.kv_mgr, "failure_records", None)
        reason = records.get(receiver.bootstrap_room) if isinstance(records, dict) else None
        try:
            t = self._begin(receiver, pages)
        except KVObsError:
            return
        t.fail(CopyNotConfirmed(sc.PATH_RECEIVE, str(reason or "SGLang reported the transfer failed")))
