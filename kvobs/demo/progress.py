"""What the demo tells the person watching it on stderr while it runs, and how it is told to stop."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any, TextIO


class Progress:
    """A background thread printing one status line per interval to `stream` (one rewritten line on a
    terminal)."""

    def __init__(self, stream: TextIO, interval: float, enabled: bool = True) -> None:
        self.stream = stream
        self.interval = interval
        self.enabled = enabled
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._line: Callable[[], str] = lambda: ""
        self._width = 0

    def start(self, line: Callable[[], str]) -> None:
        if not self.enabled:
            return
        self._line = line
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvobs-demo-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._emit()

    def _emit(self) -> None:
        try:
            text = self._line()
            if self.tty:
                pad = max(0, self._width - len(text))
                self._width = len(text)
                self.stream.write("\r" + text + " " * pad)
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
        except Exception:  # noqa: BLE001 - progress must never break the run
            pass

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self.tty:  # leave the final state on the rewritten line
            self._emit()
            self.stream.write("\n")
            self.stream.flush()
        self._width = 0


def status_line(engine: Any, duration_s: float | None) -> str:
    """One line of a SimEngine's ground-truth counters."""
    c = engine.stats.counters()
    clock = f"{engine.elapsed:5.1f}" + (f"/{duration_s:g} s" if duration_s else " s")
    return (
        f"[{engine.stats.mode}] {clock}  requests done {c['requests_completed']}  hung {c['hung_sends']}  "
        f"transfers {c['transfers_done']}  NaN stored {c['nan_blocks_written_to_storage']}  "
        f"NaN served {c['nan_blocks_served_to_prefix_hits']}  layer0 lost {c['lost_layer0_signals']}  "
        f"signals pending {engine.pending_signals()}"
    )


def install_stop_handlers(stop: threading.Event) -> Callable[[], None]:
    """SIGINT and SIGTERM set `stop` (main thread only); returns a function restoring the old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {}

    def handler(signum: int, frame: Any) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore
