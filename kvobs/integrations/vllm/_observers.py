"""One KVObserver per engine label per process, shared by every KVObsConnector there.

vLLM may build a scheduler-side and a worker-side connector in one process (the uniprocess executor), and
kvobs allows one live observer per engine label, so connectors share it. An application that wants its own
observer (a `BlockLock`, a registry, a tracer provider, hooks) registers it with `use_observer` before vLLM
builds its connectors; otherwise the connector builds one that observes and checks without a lock, since
vLLM keeps many transfers open at once and a global lock would serialise them (the second one would wait
for the first one's completion, a step later, and time out).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvobs.integrations.vllm._options import Options

_lock = threading.Lock()
_observers: dict[str, Any] = {}
_built: set[str] = set()  # engine labels whose observer this module built (from the connector's options)


def use_observer(obs: Any) -> Callable[[], None]:
    """Make KVObsConnectors configured with engine label `obs.engine` in this process use `obs`. Returns the
    undo, which unregisters it (connectors already built keep it)."""
    from kvobs import KVObserver

    if not isinstance(obs, KVObserver):
        raise TypeError(f"use_observer needs a kvobs.KVObserver, got {obs!r}")
    with _lock:
        if _observers.get(obs.engine) not in (None, obs):
            raise ValueError(f"an observer for engine {obs.engine!r} is already in use in this process")
        _observers[obs.engine] = obs
        _built.discard(obs.engine)

    def undo() -> None:
        with _lock:
            if _observers.get(obs.engine) is obs:
                del _observers[obs.engine]

    return undo


def observer_for(options: Options) -> Any:
    """The observer for `options.engine`: the one registered, else one built once for this process."""
    from kvobs import KVObserver

    with _lock:
        obs = _observers.get(options.engine)
        if obs is None:
            obs = _observers[options.engine] = KVObserver(options.engine, lock=None, deadline=options.deadline,
                                                          tracer_provider=_tracer_provider(options))
            _built.add(options.engine)
            _clear_dead_processes(obs)
        elif options.engine in _built and options.deadline not in (None, obs.deadline):
            raise ValueError(
                f"KVObsConnector engine={options.engine!r}: this process already observes that engine with "
                f"deadline={obs.deadline}; give each configuration its own engine label"
            )
        return obs


def _tracer_provider(options: Options) -> Any:
    """With `tracing`, an OTLP exporter configured by the OTEL_* variables: vLLM's worker processes run no
    code of the application's, so the connector is where kvobs tracing gets set up there."""
    if not options.tracing:
        return None
    from kvobs import configure_tracing

    return configure_tracing(set_global=False)


def _clear_dead_processes(obs: Any) -> None:
    """Multiprocess mode: drop the live gauges (transfers in flight, oldest open age) of engine processes that
    are gone. vLLM's server scrapes the directory with prometheus_client's MultiProcessCollector, which keeps
    them until someone marks the process dead, and vLLM marks only its own server process: a killed engine
    core's loads would stay in flight on `/metrics` (and its oldest-open age fire the stuck-transfer alert)
    for as long as the directory lives, e.g. across a container restart. The next engine process to start
    clears them."""
    from kvobs import clear_dead_processes

    try:
        dead = clear_dead_processes()
    except OSError as exc:
        obs.logger.warning("kvobs.vllm: could not clear the gauges of dead processes", error=repr(exc))
        return
    if dead:
        obs.logger.info("kvobs.vllm: cleared the live gauges of processes that have ended", pids=dead[:8],
                        count=len(dead))
