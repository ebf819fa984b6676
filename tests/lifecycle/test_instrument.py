"""instrument(): guard an engine class's methods by name, refuse double wrapping, undo exactly."""

from __future__ import annotations

import pytest

import kvobs
from kvobs import semconv as sc
from kvobs.testing import capture


class Base:
    def issue_write_back_storage_task(self, task, is_sync=True):
        return ("base", task.gpu_block_ids)


class PrefixCacheManager(Base):
    def issue_prefetch_storage_task(self, task, is_sync=True):
        return ("prefetched", task.gpu_block_ids)


class Task:
    keys = ["k1", "k2"]
    gpu_block_ids = [4, 5]


def test_instrument_guards_and_undo_restores(cap):
    obs = cap.observer
    original = PrefixCacheManager.__dict__["issue_prefetch_storage_task"]
    undo = kvobs.instrument(PrefixCacheManager, {
        "issue_prefetch_storage_task": obs.prefetch(keys="task.keys", block_ids="task.gpu_block_ids", sync="is_sync"),
        "issue_write_back_storage_task": obs.write_back(keys="task.keys", block_ids="task.gpu_block_ids"),
    })
    mgr = PrefixCacheManager()
    assert mgr.issue_prefetch_storage_task(Task()) == ("prefetched", [4, 5])
    assert mgr.issue_write_back_storage_task(Task()) == ("base", [4, 5])
    with pytest.raises(kvobs.TransferRejected, match="asynchronous"):
        mgr.issue_prefetch_storage_task(Task(), is_sync=False)
    assert cap.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 1
    assert cap.value(sc.TRANSFERS_TOTAL, path="write_back", outcome="ok") == 1
    again = kvobs.instrument(PrefixCacheManager, {"issue_prefetch_storage_task": obs.prefetch()})
    assert again.methods == ()  # idempotent: never wrapped twice
    mgr.issue_prefetch_storage_task(Task())
    assert cap.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 2
    again()
    undo()
    undo()  # idempotent
    assert PrefixCacheManager.__dict__["issue_prefetch_storage_task"] is original
    assert "issue_write_back_storage_task" not in PrefixCacheManager.__dict__
    assert PrefixCacheManager().issue_prefetch_storage_task(Task()) == ("prefetched", [4, 5])
    assert cap.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 2


def test_instrument_errors_name_the_problem(cap):
    with pytest.raises(AttributeError, match="has no method 'issue_swap'"):
        kvobs.instrument(PrefixCacheManager, {"issue_swap": cap.observer.send()})
    with pytest.raises(TypeError, match="expected obs.prefetch"):
        kvobs.instrument(PrefixCacheManager, {"issue_prefetch_storage_task": lambda f: f})
    # nothing was half-applied by the failed calls
    assert not hasattr(PrefixCacheManager.issue_prefetch_storage_task, "__kvobs_original__")


def test_instrument_as_context_manager(cap):
    with kvobs.instrument(PrefixCacheManager, {"issue_prefetch_storage_task": cap.observer.prefetch()}):
        PrefixCacheManager().issue_prefetch_storage_task(Task())
    assert not hasattr(PrefixCacheManager.issue_prefetch_storage_task, "__kvobs_original__")
    assert cap.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 1


def test_instrument_one_instance_with_self_specs_and_a_locked_section(cap):
    obs = cap.observer

    class Worker:
        def __init__(self):
            self.blocks = [3, 4]

        def transfer(self):
            return self.blocks

        def execute_model(self):
            return "logits"

    worker, other = Worker(), Worker()
    undo = kvobs.instrument(worker, {
        "transfer": obs.send(block_ids="self.blocks"),
        "execute_model": obs.locked("forward"),
    })
    assert worker.transfer() == [3, 4] and other.transfer() == [3, 4]
    assert worker.execute_model() == "logits"
    assert cap.value(sc.TRANSFER_BLOCKS_TOTAL, path="send") == 2  # only the instrumented instance counted
    assert cap.value(sc.LOCK_HOLD_SECONDS + "_count", lock="thread", path="forward") == 1
    undo()
    assert "transfer" not in vars(worker)
    worker.transfer()
    assert cap.value(sc.TRANSFER_BLOCKS_TOTAL, path="send") == 2


def test_a_second_observer_is_refused_and_the_same_one_changes_nothing(cap):
    with capture("other") as other:
        undo = kvobs.instrument(PrefixCacheManager, {"issue_prefetch_storage_task": cap.observer.prefetch()})
        try:
            same = kvobs.instrument(PrefixCacheManager, {"issue_prefetch_storage_task": cap.observer.prefetch()})
            assert same.methods == ()
            with pytest.raises(kvobs.AlreadyInstrumented, match=r"issue_prefetch_storage_task is already "
                                                                r"instrumented by kvobs for observer 'test'"):
                kvobs.instrument(PrefixCacheManager, {
                    "issue_write_back_storage_task": other.observer.write_back(),
                    "issue_prefetch_storage_task": other.observer.prefetch(),
                })
            assert "issue_write_back_storage_task" not in PrefixCacheManager.__dict__  # nothing half-applied
            PrefixCacheManager().issue_prefetch_storage_task(Task())
            assert cap.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 1  # the first one still sees it
        finally:
            undo()
        second = kvobs.instrument(PrefixCacheManager, {"issue_prefetch_storage_task": other.observer.prefetch()})
        PrefixCacheManager().issue_prefetch_storage_task(Task())
        second()
        assert other.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 1
