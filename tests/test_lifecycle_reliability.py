"""Issue 22, the lifecycle's part: the deadline thread survives and is supervised, a with-block's exit is as
interrupt-safe as a decorated call, `block_ids=None` is refused as the decorators refuse it, and floods of
rejected or abandoned transfers log a bounded number of lines with exact counts.

Real threads and real signals throughout (the storm is a SIGALRM interval timer whose handler raises).
"""

from __future__ import annotations

import threading

import pytest

import kvobs
from kvobs import semconv as sc
from kvobs.errors import LockTimeout, TransferRejected
from kvobs.block_lock import BlockLock
from support import lock_is_free

# --- block_ids=None is refused, omitting it claims the whole cache -------------------------------------------


@pytest.mark.parametrize("entry", ["begin", "transfer"])
@pytest.mark.parametrize("value", ["block_ids", "requests"])
def test_explicit_none_for_the_blocks_is_rejected_like_the_decorators_do(cap, entry, value):
    obs = cap.observer

    @obs.send(block_ids="ids")
    def send(ids):
        return ids

    with pytest.raises(TransferRejected, match="None"):
        send(None)
    with pytest.raises(TransferRejected, match="None"):
        if entry == "begin":
            obs.begin("send", **{value: None})
        else:
            with obs.transfer("send", **{value: None}):
                pass
    assert lock_is_free(obs.lock)
    assert cap.value(sc.TRANSFERS_TOTAL, path="send", outcome="rejected") == 2
    assert not cap.value(sc.TRANSFERS_TOTAL, path="send", outcome="ok")


def test_omitting_the_blocks_still_claims_the_whole_cache(tmp_path):
    lock = BlockLock("whole", 16, directory=tmp_path)
    obs = kvobs.KVObserver("whole", lock=lock, integrity=None, lock_timeout=0.05, enabled=False)
    whole = obs.begin("send")
    with pytest.raises(LockTimeout):
        obs.begin("prefetch", block_ids=[7])
    whole.complete()
    obs.begin("prefetch", block_ids=[7]).complete()
    with obs.transfer("send"):  # the same from another thread (here it would be a re-entry)
        errors = []
        waiter = threading.Thread(target=_begin_recording_error, args=(obs, errors))
        waiter.start()
        waiter.join()
        assert [type(e) for e in errors] == [LockTimeout]
    lock.close()


def _begin_recording_error(obs: kvobs.KVObserver, errors: list[BaseException]) -> None:
    try:
        obs.begin("prefetch", block_ids=[15]).complete()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        errors.append(exc)
