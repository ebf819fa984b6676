"""A request's trace context, carried from the prefill node to the decode node in SGLang's own status message.

SGLang's prefill tells each decode endpoint how a request's transfer ended with one multipart message,
`[tag?, room, status, prefill_rank, reason?]` (`CommonKVManager._encode_kv_status_message`); the decode side
reads it with `parse_kv_status_message`, which uses the first three frames after the tag and the fourth as the
failure reason when it is not empty, and ignores anything after. kvobs appends one frame holding the W3C
carrier of the request's send transfer, after an empty reason frame when the backend sends none, so a decode
node without kvobs reads exactly what it read before; a decode node with kvobs takes the frame off before
SGLang parses the message.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

FRAME_PREFIX = b"kvobs-trace-context:"
_CARRIER_KEYS = ("traceparent", "tracestate")


def with_trace_context(parts: list[bytes], carrier: dict[str, str], *, carries_reason: bool) -> list[bytes]:
    """The status message `parts` with the carrier frame appended (and an empty reason frame before it when
    the backend's messages carry no reason, so an unaware decode node still reads 'no reason')."""
    frame = FRAME_PREFIX + json.dumps(carrier, separators=(",", ":")).encode()
    return [*parts, frame] if carries_reason else [*parts, b"", frame]


def split_trace_context(msg: Any, *, tagged: bool, carries_reason: bool) -> tuple[Any, dict[str, str] | None]:
    """(the message as SGLang sent it, the carrier or None). Anything malformed is left to SGLang's parser."""
    if not isinstance(msg, list) or not msg or not isinstance(msg[-1], bytes) or not msg[-1].startswith(FRAME_PREFIX):
        return msg, None
    stock = msg[:-1]
    frames = 3 + int(tagged) + int(carries_reason)
    if len(stock) == frames + 1 and stock[-1] == b"":
        stock = stock[:-1]  # the empty reason frame kvobs added
    return stock, _carrier(msg[-1][len(FRAME_PREFIX):])


def _carrier(payload: bytes) -> dict[str, str] | None:
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    carrier = {k: v for k, v in value.items() if k in _CARRIER_KEYS and isinstance(v, str)}
    return carrier if "traceparent" in carrier else None


class RoomCarriers:
    """Carriers by bootstrap room, the newest `capacity` kept: a status message may be encoded (or parsed)
    after the request's transfers ended, or never, so entries are not tied to the request's lifetime."""

    def __init__(self, capacity: int = 65536) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._rooms: OrderedDict[Any, dict[str, str]] = OrderedDict()

    def put(self, room: Any, carrier: dict[str, str]) -> None:
        with self._lock:
            self._rooms[room] = carrier
            self._rooms.move_to_end(room)
            while len(self._rooms) > self._capacity:
                self._rooms.popitem(last=False)

    def get(self, room: Any) -> dict[str, str] | None:
        with self._lock:
            return self._rooms.get(room)

    def pop(self, room: Any) -> dict[str, str] | None:
        with self._lock:
            return self._rooms.pop(room, None)
