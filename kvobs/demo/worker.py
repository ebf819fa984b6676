"""The loop every queue-fed engine thread runs, written once: wait for an item, handle it and everything queued
behind it, then `tick()`. Handling the whole backlog before `tick()` matters to the messager: a signal already
queued is never mistaken for a lost one only because its thread was slow."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Item = TypeVar("Item")
POLL_S = 0.05  # how long an idle thread waits before it looks at the stop flag again


def drain(inbox: queue.Queue[Item]) -> Iterator[Item]:
    """Every item queued now, without waiting."""
    while True:
        try:
            yield inbox.get_nowait()
        except queue.Empty:
            return


@dataclass(eq=False)
class QueueWorker(Generic[Item]):
    """A component owning one engine thread and its inbox. Subclasses say what one item means (`handle`) and,
    if they keep time-driven state, what to do between batches (`tick`) and how long to wait (`wait_s`)."""

    stop: threading.Event
    inbox: queue.Queue[Item] = field(default_factory=queue.Queue, init=False, repr=False)

    def put(self, item: Item) -> None:
        self.inbox.put(item)

    @property
    def backlog(self) -> int:
        return self.inbox.qsize()

    def run(self) -> None:
        while not self.stop.is_set():
            for item in self._batch():
                self.handle(item)
            self.tick()

    def _batch(self) -> Iterator[Item]:
        """The next item (after waiting up to `wait_s()`) and the ones queued behind it, until stopped."""
        try:
            yield self.inbox.get(timeout=self.wait_s())
        except queue.Empty:
            return
        for item in drain(self.inbox):
            yield item
            if self.stop.is_set():
                return

    def handle(self, item: Item) -> None:
        raise NotImplementedError

    def tick(self) -> None:
        """Time-driven work after each batch (and each idle wait); nothing by default."""

    def wait_s(self) -> float:
        return POLL_S
