"""Multiprocess mode: prometheus_client writes every worker's values to files in PROMETHEUS_MULTIPROC_DIR.

prometheus_client decides the mode once, when it is imported, from the environment; a directory that is
missing or read-only only shows up later as a raw OSError from deep inside it. kvobs checks the directory
when its metrics are created and says which variable to fix.

A full directory is worse: prometheus_client grows its memory-mapped files with truncate, which allocates
nothing, and on a full tmpfs (Docker's 64 MB /dev/shm) the first write into such a page raises SIGBUS and
the process dies. So kvobs allocates a file's space (posix_fallocate) before it creates a series in it, and a
forked child allocates its copies of the parent's files before its first write (prometheus_client rewrites
every series into files of the new pid then). What cannot get its space is refused, counted and logged:
kvobs's series are written only through `ReservedMetric` and its `*Series`, which check first.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile
import threading
from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import values as prometheus_values
from prometheus_client.utils import floatToGoString

from kvobs import semconv as sc
from kvobs._runtime.forks import in_forked_child
from kvobs.errors import MultiprocessDirError, MultiprocessDirFull
from kvobs.telemetry._failures import STAGE_METRICS, TelemetryFailures

_LEGACY_VARIABLE = "prometheus_multiproc_dir"  # still honoured by prometheus_client


def multiprocess_dir() -> str | None:
    """The directory multiprocess mode writes to, or None in single-process mode."""
    return os.environ.get(sc.ENV_MULTIPROC_DIR) or os.environ.get(_LEGACY_VARIABLE) or None


def multiprocess_enabled() -> bool:
    """True when prometheus_client writes values to per-process mmap files."""
    return multiprocess_dir() is not None


def check_multiprocess_dir(*, writable: bool = True) -> None:
    """Raise MultiprocessDirError unless the directory exists and this process can use it.

    `writable=False` checks only that it can be read (the scraping process). Writing is checked by creating
    a file there, since permission bits alone say nothing for root or on a read-only mount; and a process
    that records must have had the variable when prometheus_client was imported.
    """
    path = multiprocess_dir()
    if path is None:
        return
    variable = sc.ENV_MULTIPROC_DIR if os.environ.get(sc.ENV_MULTIPROC_DIR) else _LEGACY_VARIABLE
    if not os.path.exists(path):
        raise MultiprocessDirError(variable, path, "does not exist")
    if not os.path.isdir(path):
        raise MultiprocessDirError(variable, path, "is not a directory")
    try:
        os.listdir(path)
    except OSError as exc:
        raise MultiprocessDirError(variable, path, f"cannot be read ({exc.strerror})") from exc
    if writable:
        try:
            with tempfile.TemporaryFile(dir=path, prefix=".kvobs-check-"):
                pass
        except OSError as exc:
            raise MultiprocessDirError(variable, path, f"is not writable ({exc.strerror})") from exc
        if prometheus_values.ValueClass is prometheus_values.MutexValue:
            raise MultiprocessDirError(
                variable, path, "was set after prometheus_client was imported (it chooses the mode at import, "
                "so this process would keep its values to itself); set it before the process starts")


# -- gauges of processes that are gone ------------------------------------------------------------------------

_LIVE_GAUGE_FILE = re.compile(r"gauge_live[a-z]+_(\d+)\.db")


def clear_dead_processes(directory: str | None = None) -> list[int]:
    """Remove the live-mode gauge files (livesum, livemax, ...) of every process that has ended; the pids.

    Why: prometheus_client keeps a worker's last gauge values until someone calls `mark_process_dead(pid)`, and
    forked workers that exit with os._exit or are killed never do: a dead worker's pending-signal age stayed
    in the sum and fired the stale-signal alert. Called before every multiprocess scrape (`scrape_registry`);
    an exporter of one's own calls it the same way. The scraping process must see the workers' pids (the same
    pid namespace, as in one container); counters and histograms of dead workers are kept, as they should be.
    """
    from prometheus_client.multiprocess import mark_process_dead

    directory = directory or multiprocess_dir()
    if directory is None:
        return []
    pids = set()
    for name in os.listdir(directory):
        match = _LIVE_GAUGE_FILE.fullmatch(name)
        if match:
            pids.add(int(match.group(1)))
    dead = sorted(pid for pid in pids if not _running(pid))
    for pid in dead:
        try:
            mark_process_dead(pid, directory)
        except FileNotFoundError:
            pass  # another scrape removed it first
    return dead


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (an exited child not yet reaped has ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rpartition(b")")[2].split()[0]
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in (b"Z", b"X")


# -- the space of this process's files ----------------------------------------------------------------------------

_NEW_FILE_BYTES = 1 << 16  # the size prometheus_client gives a new file; one that exists it keeps as it is
_ENTRY_BYTES = 32  # per entry beside its key: length field, padding to 8 bytes, value and timestamp
_USED = struct.Struct("i")  # a file's first field: the bytes in use


class FileSpace:
    """This process's metric files, given their space before prometheus_client writes into it (see above).

    `usable` is False in a forked child until its files are allocated (`writable()` does it, once), and for
    good in a process whose files could not be (`refused`). One per process: FILE_SPACE.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.usable = True
        self.refused = False
        self.template_pid: int | None = None  # in a forked child: the process whose files it copies
        self._series_bytes: dict[str, int] = {}  # prefix -> what kvobs's series take in a file of that prefix
        self._counters: dict[str, Any] = {}  # the process's failure counter, once it exists
        self._failed = TelemetryFailures("", self._counters)

    def count_in(self, counter: Any) -> None:
        """Count refusals in `counter` (kvobs_telemetry_errors_total{engine="", stage="metrics"}) from now on."""
        self._counters[STAGE_METRICS] = counter

    def writable(self) -> bool:
        """Whether kvobs may write its series in this process; a forked child allocates its files first."""
        if self.usable:
            return True
        if self.refused:  # read without the lock: a refusal is reported under it, and counting it writes
            return False
        with self.lock:
            return self._writable_locked()

    def reserve_series(self, prefix: str, nbytes: int) -> bool:
        """Room for `nbytes` more in this process's file `prefix` (the caller holds `lock` while it creates
        the series); False, reported, when it cannot be had."""
        if not self._writable_locked():
            return False
        path = _file_path(prefix, self.pid)
        size, allocated, used = _file_state(path)
        target = _grown(size, used + nbytes)
        if target > allocated:
            try:
                _allocate(path, target)
            except OSError as exc:
                if not size:
                    _remove(path)  # an empty file would break every scrape
                self._report(path, target, exc, "a new series is not recorded")
                return False
        self._series_bytes[prefix] = self._series_bytes.get(prefix, 0) + nbytes
        return True

    def _writable_locked(self) -> bool:
        if not self.usable and not self.refused:
            self._allocate_copies()
        return self.usable

    def _allocate_copies(self) -> None:
        """In a forked child: allocate this pid's files at the size of the template's (at least what kvobs's
        own series take, should the template's files be gone), before prometheus_client rewrites every series
        into them; on failure remove what was created and refuse for good."""
        sizes = dict(_files_of(self.template_pid))
        for prefix, nbytes in self._series_bytes.items():
            sizes[prefix] = max(sizes.get(prefix, 0), _grown(0, _USED.size * 2 + nbytes))
        created: list[str] = []
        path = ""
        size = 0
        try:
            for prefix, size in sizes.items():
                path = _file_path(prefix, self.pid)
                if not os.path.exists(path):
                    created.append(path)
                _allocate(path, size)
        except OSError as exc:
            for made in created:
                _remove(made)
            self.refused = True
            self._report(path, size, exc, f"kvobs records no metrics in this process (pid {self.pid})")
            return
        self.usable = True
        self.template_pid = None

    def _report(self, path: str, size: int, exc: OSError, consequence: str) -> None:
        self._failed(STAGE_METRICS, MultiprocessDirFull(path, size, exc.strerror or str(exc), consequence))

    def _after_fork_in_child(self) -> None:
        """The child's files do not exist yet: prometheus_client makes them at its first write."""
        self.lock = threading.Lock()
        if self.usable:  # else this process's own files were never made: the older template still holds
            self.template_pid = self.pid
        self.pid = os.getpid()
        self.usable = False


FILE_SPACE = FileSpace()
in_forked_child(FILE_SPACE._after_fork_in_child)


def _grown(size: int, needed: int) -> int:
    """The size prometheus_client gives a file of `size` bytes (new: none) once `needed` bytes are in use:
    it doubles a file that is full."""
    target = size or _NEW_FILE_BYTES
    while needed > target:
        target *= 2
    return target


def _file_path(prefix: str, pid: int) -> str:
    return os.path.join(multiprocess_dir() or "", f"{prefix}_{pid}.db")


def _file_state(path: str) -> tuple[int, int, int]:
    """(size, bytes allocated from the start without a hole, bytes in use) of a metric file; a missing one has
    no size and its header in use."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return 0, 0, _USED.size * 2
    try:
        stat = os.fstat(fd)
        header = os.pread(fd, _USED.size, 0)
    finally:
        os.close(fd)
    used = _USED.unpack(header)[0] if len(header) == _USED.size else 0
    whole = stat.st_blocks * 512 >= stat.st_size  # no hole anywhere (tmpfs, ext4 and xfs count 512-byte units)
    return stat.st_size, stat.st_size if whole else 0, max(used, _USED.size * 2)


def _allocate(path: str, size: int) -> None:
    """Allocate bytes [0, size) of `path`, creating it (mode as prometheus_client's); never shrinks it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        os.posix_fallocate(fd, 0, max(size, os.fstat(fd).st_size))
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # already gone; or it stays, and the scrape reports it


def _files_of(pid: int | None) -> list[tuple[str, int]]:
    """(prefix, size) of every metric file of process `pid`."""
    if pid is None:
        return []
    directory = multiprocess_dir() or ""
    pattern = re.compile(rf"(.+)_{pid}\.db")
    found = []
    for name in os.listdir(directory):
        match = pattern.fullmatch(name)
        if match:
            found.append((match.group(1), os.stat(os.path.join(directory, name)).st_size))
    return found


# -- kvobs's prometheus_client metrics, written only after that check ------------------------------------------------

class ReservedMetric:
    """A prometheus_client Counter, Gauge or Histogram of kvobs's (multiprocess mode) whose `labels()` gives a
    series only once the series' space is allocated in this process's file, and a series that writes only
    while this process may (`FILE_SPACE.writable()`); a refused series records nothing."""

    def __init__(self, metric: Any, kind: str, name: str, documentation: str, labelnames: Sequence[str],
                 mode: str = "", buckets: Sequence[float] = ()) -> None:
        self.metric = metric
        self._kind = kind
        self._prefix = f"gauge_{mode}" if kind == "gauge" else kind
        self._name = name.removesuffix("_total") if kind == "counter" else name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        bounds = [float(b) for b in buckets]
        if bounds and bounds[-1] != math.inf:
            bounds.append(math.inf)  # as prometheus_client completes them
        self._bounds = [floatToGoString(b) for b in bounds]
        self._series: dict[tuple[str, ...], Any] = {}

    def labels(self, *labelvalues: Any) -> Any:
        key = tuple(str(v) for v in labelvalues)
        found = self._series.get(key)
        if found is not None:
            return found
        space = FILE_SPACE
        with space.lock:
            found = self._series.get(key)
            if found is None:
                if space.reserve_series(self._prefix, self._bytes_of(key)):
                    found = _SERIES[self._kind](self.metric.labels(*key), space)
                    self._series[key] = found
                else:
                    found = REFUSED  # not kept: a later call may find room
            return found

    def _bytes_of(self, labelvalues: tuple[str, ...]) -> int:
        """What the series adds to the file: one entry per value, keyed as prometheus_client keys them."""
        labels = dict(zip(self._labelnames, labelvalues))
        if self._kind == "histogram":
            samples = [(f"{self._name}_bucket", {**labels, "le": le}) for le in self._bounds]
            samples.append((f"{self._name}_sum", labels))
        elif self._kind == "counter":
            samples = [(f"{self._name}_total", labels)]
        else:
            samples = [(self._name, labels)]
        return sum(len(json.dumps([self._name, sample, sample_labels, self._documentation], sort_keys=True)
                       .encode()) + _ENTRY_BYTES for sample, sample_labels in samples)

    def describe(self) -> list[Any]:
        return list(self.metric.describe())

    def collect(self) -> list[Any]:
        return list(self.metric.collect())


class _Series:
    __slots__ = ("_child", "_space")

    def __init__(self, child: Any, space: FileSpace) -> None:
        self._child = child
        self._space = space


class CounterSeries(_Series):
    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        if self._space.usable or self._space.writable():
            self._child.inc(amount)


class GaugeSeries(_Series):
    __slots__ = ()

    def set(self, value: float) -> None:
        if self._space.usable or self._space.writable():
            self._child.set(value)


class HistogramSeries(_Series):
    __slots__ = ("_add_many",)

    def __init__(self, child: Any, space: FileSpace) -> None:
        super().__init__(child, space)
        self._add_many = histogram_adder(child)

    def observe(self, amount: float) -> None:
        if self._space.usable or self._space.writable():
            self._child.observe(amount)

    def observe_many(self, amounts: list[float]) -> None:
        if self._space.usable or self._space.writable():
            self._add_many(amounts)


class _RefusedSeries:
    """What a series that could not get its space records: nothing (the refusal was counted and logged)."""

    def inc(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass

    def observe_many(self, amounts: list[float]) -> None:
        pass


REFUSED = _RefusedSeries()
_SERIES: dict[str, type[_Series]] = {"counter": CounterSeries, "gauge": GaugeSeries, "histogram": HistogramSeries}


def histogram_adder(child: Any) -> Callable[[list[float]], None]:
    """Add many observations to a histogram child at once.

    kvobs's own histogram cell and series have `observe_many`. A prometheus_client child keeps non-cumulative
    `_buckets` for its `_upper_bounds` and a `_sum` (stable since 0.4): one inc per touched bucket and one for
    the sum, instead of two locked incs per value. Any other child gets one `observe()` per value.
    """

    def observe_each(values: list[float]) -> None:
        for value in values:
            child.observe(value)

    try:
        observe_many = getattr(child, "observe_many", None)
        if callable(observe_many):
            return observe_many
        bounds, buckets, total = (getattr(child, name, None) for name in ("_upper_bounds", "_buckets", "_sum"))
        fast = (isinstance(bounds, list) and isinstance(buckets, list) and len(bounds) == len(buckets)
                and all(callable(getattr(v, "inc", None)) for v in (*buckets, total)))
    except Exception:  # noqa: BLE001 - an odd child gets the public path; its failures are counted there
        fast = False
    if not fast:
        return observe_each

    def add(values: list[float]) -> None:
        values = sorted(values)
        below = 0  # values in the buckets before this one: a value goes into the first bucket whose bound >= it
        for index, bound in enumerate(bounds):
            upto = bisect_right(values, bound, below)
            if upto > below:
                buckets[index].inc(upto - below)
                below = upto
        total.inc(sum(values))

    return add
