"""Single-process PathMetrics and HolderMetrics: a record goes into the calling thread's buffer, and batches
are folded into the accumulators when a buffer is full and at every scrape (see buffers.py for why).

A batch is folded in two steps: `_prepare` reads the flat records by strided slices and computes every
update (this is where a bad record raises), then `_commit` applies them, which cannot fail. So a batch is
applied whole or not at all; one that cannot be is folded record by record, and a record that cannot be is
counted and dropped, never the batch.
"""

from __future__ import annotations

import operator
import time
from bisect import bisect_left
from collections.abc import Iterable
from itertools import compress
from typing import Any, ClassVar

from kvobs import semconv as sc
from kvobs.telemetry._failures import STAGE_METRICS
from kvobs.telemetry._metrics.accumulators import CounterCell, ExemplarSource, HistogramCell
from kvobs.telemetry._metrics.buffers import ThreadBuffers
from kvobs.telemetry._metrics.families import Failed, MetricFamilies
from kvobs.telemetry._metrics.path_metrics import HolderMetrics, LockSeries, PathMetrics

__all__ = ["BufferedHolderMetrics", "BufferedPathMetrics"]

_SECOND = operator.itemgetter(1)
_THIRD = operator.itemgetter(2)
_TRANSFER_WIDTH = 7  # outcome, duration, wait, hold, blocks, bytes, (exemplar, time) or None
_HOLDER_WIDTH = 3  # wait, hold, (exemplar, time) or None
_now = time.time
# (histogram, bucket index) -> the latest exemplar of that bucket in a batch: (source, amount, timestamp)
Latest = dict[tuple[HistogramCell, int], tuple[ExemplarSource, float, float]]
# histogram batches, counter increments, exemplars
Prepared = tuple[list[Any], list[tuple[CounterCell, float]], Latest]


class _Buffered(LockSeries):
    """Records of `width` values into per-thread buffers, folded in by `_prepare` and `_commit`."""

    width: ClassVar[int]

    def __init__(self, families: MetricFamilies, engine: str, lock_name: str, name: str, failed: Failed) -> None:
        super().__init__(families, engine, lock_name, name, failed)
        self._buffers = ThreadBuffers(self.width, self._apply, families.lock)
        self._local = self._buffers.local
        self._full = self._buffers.full
        families.add_buffers(self._buffers)

    def _apply(self, values: list[Any]) -> None:
        """Fold a batch in (under the families' lock): whole, else record by record."""
        try:
            _commit(self._prepare(values))
        except Exception:  # noqa: BLE001 - a bad record must not cost the others
            for start in range(0, len(values), self.width):
                try:
                    _commit(self._prepare(values[start:start + self.width]))
                except Exception as exc:  # noqa: BLE001
                    self._failed(STAGE_METRICS, exc)

    def _prepare(self, values: list[Any]) -> Prepared:
        raise NotImplementedError


class BufferedPathMetrics(_Buffered, PathMetrics):
    """`finished` adds one record to the calling thread's buffer."""

    width = _TRANSFER_WIDTH

    def finished(self, outcome: str, duration_s: float, wait_s: float, hold_s: float, blocks: int, nbytes: int,
                 exemplar: ExemplarSource | None = None) -> None:
        # ThreadBuffers.add, written out: the one call every transfer makes.
        try:
            values = self._local.values
        except AttributeError:
            values = self._buffers.new_buffer()
        values.extend((outcome, duration_s, wait_s, hold_s, blocks, nbytes, exemplar and (exemplar, _now())))
        if len(values) >= self._full:
            self._buffers.drain(values)

    def finished_many(self, outcome: str, duration_s: float, wait_s: float, hold_s: float,
                      moved: list[tuple[Any, int, int]], exemplar: ExemplarSource | None = None) -> None:
        records = [outcome, duration_s, wait_s, hold_s, 0, 0, exemplar and (exemplar, _now())] * len(moved)
        records[4::_TRANSFER_WIDTH] = map(_SECOND, moved)  # blocks, then bytes, filled in C
        records[5::_TRANSFER_WIDTH] = map(_THIRD, moved)
        self._buffers.add(records)

    def _prepare(self, values: list[Any]) -> Prepared:
        """Fields of the flat records (outcome, duration, wait, hold, blocks, bytes, exemplar) by slicing."""
        w = _TRANSFER_WIDTH
        outcomes = values[0::w]
        count = len(outcomes)
        batches = [self.lock_wait.prepare(values[2::w]), self.lock_hold.prepare(values[3::w])]
        if outcomes.count(sc.OUTCOME_OK) == count:
            batches.append(self.duration[sc.OUTCOME_OK].prepare(values[1::w]))
            moved_blocks = _total(values[4::w])
            moved_bytes = _total(values[5::w])
            increments = [(self.transfers[sc.OUTCOME_OK], count)]
        else:
            by_outcome: dict[str, list[float]] = {}
            for outcome, duration in zip(outcomes, values[1::w]):
                by_outcome.setdefault(outcome, []).append(duration)
            increments = []
            for outcome, durations in by_outcome.items():
                batches.append(self.duration[outcome].prepare(durations))
                increments.append((self.transfers[outcome], len(durations)))
            ok = [outcome == sc.OUTCOME_OK for outcome in outcomes]
            moved_blocks = _total(list(compress(values[4::w], ok)))
            moved_bytes = _total(list(compress(values[5::w], ok)))
        increments += [(self.blocks, moved_blocks), (self.bytes, moved_bytes)]
        touched = sum(len(batch[2]) for batch in batches) - len(batches[1][2])  # lock hold takes no exemplar
        return batches, increments, self._exemplars_of(values, outcomes, touched)

    def _exemplars_of(self, values: list[Any], outcomes: list[str], wanted: int) -> Latest:
        """The latest exemplar of each bucket the batch's lock waits and durations fell in (`wanted` of them)."""
        w = _TRANSFER_WIDTH
        exemplars = values[6::w]
        if exemplars.count(None) == len(exemplars):
            return {}
        wait_cell = self.lock_wait
        duration_cells = self.duration
        newest_first = zip(reversed(exemplars), reversed(outcomes), reversed(values[1::w]), reversed(values[2::w]))
        return _latest(((cell, amount, exemplar) for exemplar, outcome, duration, wait in newest_first if exemplar
                        for cell, amount in ((wait_cell, wait), (duration_cells[outcome], duration))), wanted)


class BufferedHolderMetrics(_Buffered, HolderMetrics):
    """`held` adds one record to the calling thread's buffer."""

    width = _HOLDER_WIDTH

    def held(self, wait_s: float, hold_s: float, exemplar: ExemplarSource | None = None) -> None:
        self._buffers.add((wait_s, hold_s, exemplar and (exemplar, _now())))

    def _prepare(self, values: list[Any]) -> Prepared:
        """Fields of the flat records (wait, hold, exemplar) by slicing."""
        waits = self.lock_wait.prepare(values[0::3])
        newest_first = zip(reversed(values[0::3]), reversed(values[2::3]))
        latest = _latest(((self.lock_wait, wait, exemplar) for wait, exemplar in newest_first if exemplar),
                         len(waits[2]))
        return [waits, self.lock_hold.prepare(values[1::3])], [], latest


def _latest(marks: Iterable[tuple[HistogramCell, float, tuple[ExemplarSource, float]]], wanted: int) -> Latest:
    """Per (histogram, bucket) the first of `marks` (cell, amount, (source, timestamp)), given newest first.

    Why: only the latest exemplar of a bucket is ever shown. A batch's records are in the order they were made,
    so scanning them newest first, a bucket keeps the first found, and the scan ends once the `wanted` buckets
    the batch touched have one: most batches then cost a few records, not one bisect per record."""
    latest: Latest = {}
    for cell, amount, (source, timestamp) in marks:
        if amount == amount:  # noqa: PLR0124 - NaN falls in no bucket
            key = (cell, bisect_left(cell.bounds, amount))
            if key not in latest:
                latest[key] = (source, amount, timestamp)
                if len(latest) == wanted:
                    break
    return latest


def _total(amounts: list[Any]) -> int:
    """The sum of per-record counts, refusing a negative one (a counter never goes down)."""
    if amounts and min(amounts) < 0:
        raise ValueError(f"negative count among {amounts[:8]}: counters never go down")
    return sum(amounts)


def _commit(prepared: Prepared) -> None:
    """Apply a prepared batch; nothing here can fail, so a batch is applied whole or not at all."""
    batches, increments, latest = prepared
    for cell, total, bucket_increments in batches:
        cell.commit(total, bucket_increments)
    for counter, amount in increments:
        counter.value += amount
    for (histogram, index), exemplar in latest.items():
        histogram.keep_exemplar(index, exemplar)
