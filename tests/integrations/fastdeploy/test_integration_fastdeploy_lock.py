"""FastDeploy's own GPU-cache lock under kvobs: the same flock file, so kvobs and an unmodified FastDeploy exclude
each other; taken by the GPU worker on tensor-parallel rank 0 around execute_model; never held across the
tensor-parallel barrier of the cache transfer processes."""

from __future__ import annotations

import fcntl
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from fastdeploy_shaped.cluster import make_cluster, read_task
from fastdeploy_shaped.ipc_signal import IPCLock
from fastdeploy_shaped.worker_process import PaddleDisWorkerProc
from prometheus_client import CollectorRegistry

import kvobs
from kvobs.integrations import fastdeploy as kvfd
from kvobs.locks._block_lock import BlockLock
from kvobs.locks._lockfile import UnsafeLockFile
from kvobs.testing import capture

PORT = 8123
SHAPED = Path(__file__).resolve().parents[2] / "fastdeploy_shaped"


@pytest.fixture
def lock_dir(tmp_path):
    """A directory holding FastDeploy's lock file, created as FastDeploy's engine creates it."""
    IPCLock("gpu_cache_lock", suffix=PORT, create=True, lock_dir=str(tmp_path))
    return tmp_path


def held_by_someone(lock_dir) -> bool:
    """Probe as another FastDeploy process would: its own descriptor of the file, non-blocking."""
    fd = os.open(kvfd.gpu_cache_lock_path(PORT, lock_dir), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


class FastDeployProcess:
    """A separate process locking the file with FastDeploy's own IPCLock (no kvobs in it)."""

    def __init__(self, lock_dir) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SHAPED / "ipc_signal.py"), str(lock_dir), str(PORT)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, what: str, within: float = 60.0) -> bool:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self.answered(within)

    def answered(self, within: float) -> bool:
        ready, _, _ = select.select([self.proc.stdout], [], [], within)
        return bool(ready) and self.proc.stdout.readline().strip().endswith("d")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_kvobs_and_an_unmodified_fastdeploy_exclude_each_other(lock_dir):
    obs = kvobs.KVObserver("fd-lock", lock=kvfd.FastDeployLock(PORT, directory=lock_dir), lock_timeout=0.2,
                           registry=CollectorRegistry(), integrity=None)
    fastdeploy = FastDeployProcess(lock_dir)
    try:
        assert fastdeploy.ask("acquire")
        with pytest.raises(kvobs.LockTimeout), obs.hold():
            pass
        assert fastdeploy.ask("release")
        with obs.hold():
            assert not fastdeploy.ask("acquire", within=0.3)  # FastDeploy waits for kvobs
        assert fastdeploy.answered(within=60)  # and gets the lock once kvobs released it
    finally:
        fastdeploy.close()


def test_the_timeout_given_at_construction_bounds_a_direct_acquire(lock_dir):
    lock = kvfd.FastDeployLock(PORT, directory=lock_dir, timeout=0.3)
    fastdeploy = FastDeployProcess(lock_dir)
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(lock.acquire()), daemon=True)
    try:
        assert fastdeploy.ask("acquire")
        waiter.start()
        waiter.join(timeout=60)
        assert outcome == [False]  # not a wait for ever behind FastDeploy's holder
        with pytest.raises(kvobs.LockTimeout, match="within 0.300 s"):
            with lock:
                pass
        assert fastdeploy.ask("release")
        assert lock.acquire()  # free again: taken at once
        lock.release()
    finally:
        fastdeploy.close()  # a hung waiter gets the lock once FastDeploy's process is gone
        waiter.join(timeout=60)


def test_an_observer_without_lock_timeout_waits_as_long_as_its_lock_says(lock_dir):
    obs = kvobs.KVObserver("fd-lock", lock=kvfd.FastDeployLock(PORT, directory=lock_dir, timeout=0.3),
                           registry=CollectorRegistry(), integrity=None)
    fastdeploy = FastDeployProcess(lock_dir)
    try:
        assert obs.lock_timeout == 0.3  # not the 30 s default
        assert fastdeploy.ask("acquire")
        with pytest.raises(kvobs.LockTimeout), obs.hold():
            pass
    finally:
        fastdeploy.close()


def test_only_fastdeploys_own_regular_file_of_this_user_is_adopted(tmp_path):
    with pytest.raises(FileNotFoundError):
        kvfd.FastDeployLock(PORT, directory=tmp_path)  # FastDeploy's engine creates it, never kvobs
    target = tmp_path / "elsewhere"
    target.write_text("")
    os.symlink(target, kvfd.gpu_cache_lock_path(PORT, tmp_path))
    with pytest.raises(UnsafeLockFile, match="symlink"):
        kvfd.FastDeployLock(PORT, directory=tmp_path)
    os.unlink(kvfd.gpu_cache_lock_path(PORT, tmp_path))
    os.mkdir(kvfd.gpu_cache_lock_path(PORT, tmp_path))
    with pytest.raises(UnsafeLockFile, match="not a regular file"):
        kvfd.FastDeployLock(PORT, directory=tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving the file to another user needs root")
def test_a_file_owned_by_another_user_is_refused(lock_dir):
    os.chown(kvfd.gpu_cache_lock_path(PORT, lock_dir), 65534, 65534)
    with pytest.raises(UnsafeLockFile, match="owned by uid 65534"):
        kvfd.FastDeployLock(PORT, directory=lock_dir)


def test_the_lock_pickles_to_the_same_file(lock_dir):
    lock = kvfd.FastDeployLock(PORT, directory=lock_dir, timeout=3.0)
    copy = pickle.loads(pickle.dumps(lock))
    assert (copy.path, copy.timeout, copy.name) == (lock.path, 3.0, "fastdeploy_gpu_cache_lock")
    assert os.stat(copy.path).st_mode & 0o777 == 0o600  # adopted as FastDeploy made it, unchanged


def worker(lock_dir, local_rank: int, tp: int = 2) -> PaddleDisWorkerProc:
    proc = PaddleDisWorkerProc(local_rank, tp, PORT, lock_dir=str(lock_dir))
    proc.init_health_status()
    return proc


def test_upstream_leaks_the_lock_when_execute_model_raises(lock_dir):
    proc = worker(lock_dir, 0)
    proc.worker.during_step = lambda: 1 / 0
    with pytest.raises(ZeroDivisionError):
        proc.event_loop_step({}, 1)
    assert held_by_someone(lock_dir)  # FastDeploy's acquire/release has no try/finally


def test_the_worker_holds_fastdeploys_lock_on_rank_0_during_execute_model(lock_dir):
    with capture("fd-worker", lock=kvfd.FastDeployLock(PORT, directory=lock_dir), lock_timeout=1) as cap:
        procs = [worker(lock_dir, rank) for rank in (0, 1)]
        undo = [kvfd.instrument_worker_process(proc, cap.observer) for proc in procs]
        seen = {}
        for rank, proc in enumerate(procs):
            proc.worker.during_step = lambda rank=rank: seen.setdefault(rank, held_by_someone(lock_dir))
            proc.event_loop_step({"req": rank}, 1)
        assert seen == {0: True, 1: False}  # rank 1 never takes it, as upstream
        assert not held_by_someone(lock_dir)
        procs[0].worker.during_step = lambda: 1 / 0
        with pytest.raises(ZeroDivisionError):
            procs[0].event_loop_step({}, 1)
        assert not held_by_someone(lock_dir)  # released although execute_model raised
        assert cap.value("kvobs_lock_hold_seconds_count", path="forward", lock="fastdeploy_gpu_cache_lock") == 2
        for u in undo:
            u()
    assert "execute_model" not in vars(procs[0].worker) and "_acquire_kvcache_lock" not in vars(procs[0])
    procs[0].worker.during_step = lambda: seen.setdefault("undone", held_by_someone(lock_dir))
    procs[0].event_loop_step({}, 1)
    assert seen["undone"] and not held_by_someone(lock_dir)  # FastDeploy's own lock again


def test_the_worker_times_out_instead_of_hanging_behind_a_stuck_holder(lock_dir):
    with capture("fd-worker", lock=kvfd.FastDeployLock(PORT, directory=lock_dir), lock_timeout=0.2) as cap:
        proc = worker(lock_dir, 0, tp=1)
        kvfd.instrument_worker_process(proc, cap.observer)
        stuck = IPCLock("gpu_cache_lock", suffix=PORT, create=False, lock_dir=str(lock_dir))
        stuck.acquire()  # a FastDeploy process that hangs holding it (one that dies releases it: flock)
        with pytest.raises(kvobs.LockTimeout):
            proc.event_loop_step({}, 1)
        stuck.release()
        proc.event_loop_step({}, 1)
        assert len(proc.worker.steps) == 1


def test_with_a_block_lock_the_forward_pass_and_a_copy_exclude_each_other(lock_dir, tmp_path):
    lock = BlockLock("fd-blocks", 16, directory=tmp_path)
    with capture("fd-rank0", lock=lock, lock_timeout=0.3) as cap:
        proc = worker(lock_dir, 0, tp=1)
        undo = kvfd.instrument_worker_process(proc, cap.observer)
        copying, copied = threading.Event(), threading.Event()

        def copy() -> None:  # a storage load into blocks 3 and 4, in the cache transfer process
            with cap.observer.transfer("prefetch", block_ids=[3, 4]):
                copying.set()
                copied.wait(30)

        thread = threading.Thread(target=copy)
        thread.start()
        assert copying.wait(30)
        with pytest.raises(kvobs.LockTimeout):
            proc.event_loop_step({}, 1)  # the forward pass waits for the copy's blocks
        copied.set()
        thread.join(30)
        seen = []

        def copy_during_forward() -> None:
            try:
                with cap.observer.transfer("send", block_ids=[5]):
                    seen.append("copied")
            except kvobs.LockTimeout:
                seen.append("waited")

        def forward() -> None:
            other = threading.Thread(target=copy_during_forward)
            other.start()
            other.join(30)

        proc.worker.during_step = forward
        proc.event_loop_step({}, 1)
        assert seen == ["waited"] and len(proc.worker.steps) == 1  # a copy waits for the forward pass
        proc.worker.during_step = None
        with cap.observer.transfer("send", block_ids=[5]):
            pass  # and goes ahead once it is over
        undo()


# -- the tensor-parallel barrier -----------------------------------------------------------------------------


def two_ranks(stack: ExitStack, lock_dir, instrument) -> tuple:
    """Two ranks' transfer processes (threads), each with its own observer on FastDeploy's one lock file."""
    cluster = make_cluster(2, barrier_timeout=3.0)  # upstream waits for ever; 3 s bounds the test
    stack.callback(cluster.stop)
    records = []
    for rank in cluster.ranks:
        lock = kvfd.FastDeployLock(PORT, directory=lock_dir)
        cap = stack.enter_context(capture(f"fd-rank{rank.rank}", lock=lock, lock_timeout=0.5,
                                          integrity="raise", hooks=[records.append]))
        stack.callback(instrument(rank, cap.observer))
    cluster.fill(["h0", "h1"])
    cluster.start()
    cluster.engine.issue_prefetch_storage_task(read_task("t", ["h0", "h1"], [1, 2]), is_sync=False)
    return cluster, records


def naive(rank, obs):
    """The lock around read_storage_task: held from the copy through the barrier to the done signal."""
    return kvobs.instrument(rank, {"read_storage_task": obs.prefetch(block_ids="task.gpu_block_ids")})


def test_one_lock_held_across_the_barrier_deadlocks_the_ranks(lock_dir):
    with ExitStack() as stack:
        cluster, records = two_ranks(stack, lock_dir, naive)
        deadline = time.monotonic() + 60  # past the lock timeout (0.5 s) and the bounded barrier (3 s)
        while len(records) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(r.outcome for r in records) == ["ok", "timeout"]  # one rank never got the lock...
        time.sleep(0.2)
        assert "t" not in cluster.engine.storage_prefetch_block_ids  # ...and no rank answered: the engine waits


def test_the_lock_held_for_the_copy_only_lets_both_ranks_answer(lock_dir):
    with ExitStack() as stack:
        cluster, records = two_ranks(stack, lock_dir, kvfd.instrument_cache_transfer_manager)
        deadline = time.monotonic() + 60
        while len(records) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted((r.engine, r.outcome, r.blocks) for r in records) == [("fd-rank0", "ok", 2), ("fd-rank1", "ok", 2)]
        while cluster.engine.storage_prefetch_block_ids.get("t") != [1, 2] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cluster.engine.storage_prefetch_block_ids["t"] == [1, 2]  # both ranks' done signals arrived
