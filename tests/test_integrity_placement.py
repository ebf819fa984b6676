"""A check's pool threads read off the CPU of the thread that hands them their share, within the CPUs they may
use, and a refused mask never breaks a check (`kvobs.integrity.placement`)."""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

import pytest
import torch
from test_integrity import expect

from kvobs.integrity import check_blocks, kernel, placement, threads

pytest.importorskip("numba")

ALLOWED = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
needs_two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs sched_setaffinity and two usable CPUs")


def in_a_thread(fn: Any) -> Any:
    """`fn()` on a thread of its own, so that any mask it sets dies with that thread, not the test runner's."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.fixture
def fresh_pool(monkeypatch):
    """A pool of its own for the test (its threads start with the runner's mask; the shared pool is untouched),
    and every check split between the caller and one pool thread."""
    monkeypatch.setattr(threads, "_jobs", queue.SimpleQueue())
    monkeypatch.setattr(threads, "_started", 0)
    monkeypatch.setattr(threads, "MIN_BYTES_PER_THREAD", 1)
    monkeypatch.setattr(kernel, "CHUNK_BYTES", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)


def pool_share_waited_for(monkeypatch) -> list[frozenset[int]]:
    """Make the caller start its share only once a pool thread has begun its own, and note that pool thread's
    CPU mask as it begins (the caller could otherwise read every chunk before any pool thread wakes)."""
    masks: list[frozenset[int]] = []
    began = threading.Event()
    real = threads._mark_share

    def share(*args: Any) -> int:
        if threading.current_thread().name.startswith("kvobs-integrity-"):
            masks.append(frozenset(os.sched_getaffinity(0)))
            began.set()
        else:
            assert began.wait(10), "no pool thread took its share"
        return real(*args)

    monkeypatch.setattr(threads, "_mark_share", share)
    return masks


@needs_two_cpus
def test_the_pool_thread_reads_off_the_callers_cpu(fresh_pool, monkeypatch):
    callers_cpu = min(ALLOWED)
    monkeypatch.setattr(threads, "current_cpu", lambda: callers_cpu)
    masks = pool_share_waited_for(monkeypatch)
    cache = torch.ones(16, 64, dtype=torch.bfloat16)
    cache[11, 7] = float("nan")
    expect(check_blocks(cache, range(16), method="kernel"), nan={11})
    assert masks == [ALLOWED - {callers_cpu}]


@needs_two_cpus
def test_an_unknown_cpu_leaves_the_pool_thread_every_allowed_cpu(fresh_pool, monkeypatch):
    monkeypatch.setattr(threads, "current_cpu", lambda: -1)
    masks = pool_share_waited_for(monkeypatch)
    cache = torch.ones(16, 64, dtype=torch.bfloat16)
    cache[2, 0] = float("-inf")
    expect(check_blocks(cache, range(16), method="kernel"), inf={2})
    assert masks == [ALLOWED]


def test_a_refused_mask_never_breaks_a_check(fresh_pool, monkeypatch):
    """The kernel refuses the mask (a cpuset changed): the check is exact, and the thread stops steering."""
    calls = []

    def refuse(pid: int, mask: Any) -> None:
        calls.append(mask)
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(placement.os, "sched_setaffinity", refuse)
    monkeypatch.setattr(threads, "current_cpu", lambda: min(ALLOWED, default=0))
    pool_share_waited_for(monkeypatch)
    cache = torch.ones(16, 64, dtype=torch.float16)
    for bad in (3, 9):
        cache[bad, 1] = float("nan")
        expect(check_blocks(cache, range(16), method="kernel"), nan={bad})
        cache[bad, 1] = 1
    assert len(calls) == (1 if len(ALLOWED) > 1 else 0)  # tried once, then left placement to the OS


@needs_two_cpus
def test_the_mask_changes_only_when_the_callers_cpu_does(monkeypatch):
    calls = []
    real = os.sched_setaffinity
    monkeypatch.setattr(placement.os, "sched_setaffinity", lambda pid, mask: calls.append(mask) or real(pid, mask))
    first, second = sorted(ALLOWED)[:2]

    def steer() -> list[frozenset[int]]:
        avoider = placement.CpuAvoider()
        seen = []
        for cpu in (first, first, second, 10_000, -1, -1):  # 10_000: a CPU this thread may not use anyway
            avoider.avoid(cpu)
            seen.append(frozenset(os.sched_getaffinity(0)))
        return seen

    seen = in_a_thread(steer)
    assert seen == [ALLOWED - {first}] * 2 + [ALLOWED - {second}] + [ALLOWED] * 3
    assert calls == [ALLOWED - {first}, ALLOWED - {second}, ALLOWED]


def test_a_single_allowed_cpu_is_kept(monkeypatch):
    """Pinned to one CPU (by the engine, before the pool started): nothing to steer to, no call made."""
    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda pid: {3})
    monkeypatch.setattr(placement.os, "sched_setaffinity", lambda pid, mask: pytest.fail("no mask to set"))
    avoider = placement.CpuAvoider()
    avoider.avoid(3)
    avoider.avoid(-1)
    assert avoider.mask == {3}


def test_current_cpu_is_one_this_thread_may_run_on():
    cpu = placement.current_cpu()
    assert cpu == -1 or not ALLOWED or cpu in ALLOWED
