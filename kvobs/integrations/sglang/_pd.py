"""Put kvobs on SGLang's PD (prefill -> decode) KV transfer: one call, on both kinds of node."""

from __future__ import annotations

from typing import Any

from kvobs import Instrumentation, KVObserver
from kvobs.integrations._common import require_sharing_lock
from kvobs.integrations.sglang._carrier import RoomCarriers
from kvobs.integrations.sglang._common import COPIES_IN_FLIGHT
from kvobs.integrations.sglang._pd_caches import ManagerCaches
from kvobs.integrations.sglang._pd_receive import Receivers
from kvobs.integrations.sglang._pd_send import Senders


def instrument_pd(obs: KVObserver, *, cache: Any = None) -> Instrumentation:
    """Observe SGLang's PD transfers in this process (prefill, decode, or both):

    - prefill: each `CommonKVSender.send` chunk is a send transfer (sources checked before it is queued, and
      again when the backend concludes the room: corrupt then, the room fails), completed when `poll()`
      reports Success, failed on Failed or `abort()`; the request's trace context rides on the status
      message to decode;
    - decode: the pages named by `CommonKVReceiver.send_metadata` become a receive transfer when `poll()`
      reports Success, continuing the prefill's trace, destinations checked before decode uses them.

    `cache`: the KV to check, see `pd_caches` (an SGLang device pool, page-indexed tensors, a
    callable(kv_manager) returning either, or None to observe without checks). Patches SGLang's common
    classes, which Mooncake, NIXL and Mori derive from. Returns the undo handle. The observer's lock must be
    None or a BlockLock (`SharingLockRequired`); classes already instrumented for another observer are refused
    (`AlreadyInstrumented`)."""
    require_sharing_lock(obs, "instrument_pd", COPIES_IN_FLIGHT)
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import (
        CommonKVManager,
        CommonKVReceiver,
        CommonKVSender,
    )

    caches = ManagerCaches(obs, cache)
    senders = Senders(obs, caches, RoomCarriers(), KVPoll)
    receivers = Receivers(obs, caches, RoomCarriers(), KVPoll)
    patches = Instrumentation(owner=obs)
    try:
        for name, hook in (("send", senders.send), ("poll", senders.poll),
                           ("poll_pp_consensus", senders.poll), ("abort", senders.abort)):
            patches.wrap_method(CommonKVSender, name, hook)
        patches.wrap_method(CommonKVReceiver, "send_metadata", receivers.send_metadata)
        patches.wrap_method(CommonKVReceiver, "poll", receivers.poll)
        patches.wrap_method(CommonKVManager, "conclude_transfer", senders.conclude)
        patches.wrap_method(CommonKVManager, "_encode_kv_status_message", senders.encode)
        patches.wrap_method(CommonKVManager, "parse_kv_status_message", receivers.parse)
    except BaseException:
        patches.undo()
        raise
    patches.add(lambda: _abandon(senders))
    return patches


def _abandon(senders: Senders) -> None:
    for t in senders.open_transfers():
        t.abandon()  # their completion can no longer be observed
