"""instrument(): guard an engine class's methods by name, refuse double wrapping, undo exactly."""

from __future__ import annotations

import pytest

import kvobs
from kvobs import semconv as sc


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
    with pytest.raises(ValueError, match="already instrumented"):
        kvobs.instrument(PrefixCacheManager, {"issue_prefetch_storage_task": obs.prefetch()})
    undo()
    undo()  # idempotent
    assert PrefixCacheManager.__dict__["issue_prefetch_storage_task"] is original
    assert "issue_write_back_storage_task" not in PrefixCacheManager.__dict__
    assert PrefixCacheManager().issue_prefetch_storage_task(Task()) == ("prefetched", [4, 5])
    assert cap.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 1


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
