"""One trace per request across FastDeploy's prefill and decode nodes.

The prefill engine hands each request to its decode node with `SplitwiseConnector.send_splitwise_tasks`
(the request, with its `disaggregate_info` dict, travels to the decode node). The bridge begins the
request's send transfer there and puts its W3C trace context into that dict (under `TRACE_KEY`); the
transfer completes when the prefill engine learns from its cache messagers that the cache was sent
(`engine_worker_queue.get_finished_req()`: `[[request_id, status]]`), or fails on an error status.
On the decode node, `send_cache_info_to_prefill` hands the request's allocated blocks to the prefill node:
the bridge begins the receive transfer there, continuing the prefill node's trace, and `received()` /
`failed()` end it when the decode engine learns the cache arrived. Transfers nobody ends are abandoned at
the observer's deadline. The engines hold no KV tensors: these transfers are traced, counted and (if the
observer has one) locked, not checked; the checks run where the tensors are (`send`, `transfer`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvobs import Instrumentation, KVObserver
from kvobs import semconv as sc
from kvobs.errors import KVObsError, SendFailed

TRACE_KEY = "kvobs_trace"  # in a request's `disaggregate_info`: the prefill send's W3C trace context


def instrument_prefill_connector(connector: Any, obs: KVObserver) -> Instrumentation:
    """Send transfers per request on a prefill engine's `SplitwiseConnector`. Returns the undo handle."""
    patches = Instrumentation(owner=obs)
    if not (patches.claims(connector, "send_splitwise_tasks")
            and patches.claims(connector.engine_worker_queue, "get_finished_req")):
        return patches  # instrumented for this observer already
    patches.replace(connector, "send_splitwise_tasks", lambda send: _handing_over(obs, send))
    patches.replace(connector.engine_worker_queue, "get_finished_req", lambda get: _finishing(obs, get))
    return patches


def _handing_over(obs: KVObserver, send: Callable[..., Any]) -> Callable[..., Any]:
    def send_splitwise_tasks(tasks: Any, current_id: Any) -> Any:
        for task in _with_info(tasks):
            t = _begin(obs, sc.PATH_SEND, task.request_id, block_ids=getattr(task, "block_tables", None))
            if t is not None:
                task.disaggregate_info[TRACE_KEY] = t.carrier()
        return send(tasks, current_id)

    return send_splitwise_tasks


def _finishing(obs: KVObserver, get: Callable[[], Any]) -> Callable[[], Any]:
    def get_finished_req() -> Any:
        finished = get()
        for request_id, status, *_ in finished or ():
            if "error" in str(status):
                obs.fail(sc.PATH_SEND, request_id, SendFailed(request_id, status))
            else:
                obs.complete(sc.PATH_SEND, request_id)
        return finished

    return get_finished_req


class DecodeReceives(Instrumentation):
    """The undo handle of `instrument_decode_connector`, which also ends the receive transfers."""

    def __init__(self, obs: KVObserver) -> None:
        super().__init__(owner=obs)
        self._obs = obs

    def received(self, request_id: Any) -> None:
        """The request's cache arrived (the decode engine got the prefill node's first token)."""
        self._obs.complete(sc.PATH_RECEIVE, request_id)

    def failed(self, request_id: Any, error: BaseException) -> None:
        self._obs.fail(sc.PATH_RECEIVE, request_id, error)


def instrument_decode_connector(connector: Any, obs: KVObserver) -> DecodeReceives:
    """Receive transfers per request on a decode engine's `SplitwiseConnector`, continuing the prefill trace."""
    receives = DecodeReceives(obs)
    receives.replace(connector, "send_cache_info_to_prefill", lambda send: _allocated(obs, send))
    return receives


def _allocated(obs: KVObserver, send: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def send_cache_info_to_prefill(tasks: Any) -> Any:
        for task in _with_info(tasks):
            info = task.disaggregate_info
            _begin(obs, sc.PATH_RECEIVE, task.request_id, block_ids=info.get("block_tables"),
                   trace_context=info.get(TRACE_KEY) or None)
        return send(tasks)

    return send_cache_info_to_prefill


def _with_info(tasks: Iterable[Any]) -> list[Any]:
    return [task for task in tasks if isinstance(getattr(task, "disaggregate_info", None), dict)]


def _begin(obs: KVObserver, path: str, request_id: Any, **values: Any) -> Any:
    """Begin the request's transfer; a refusal is logged and the engine goes on untraced."""
    try:
        return obs.begin(path, key=request_id, request_id=request_id, **values)
    except (KVObsError, TimeoutError, ValueError, TypeError) as exc:
        obs.logger.warning("kvobs.fastdeploy.transfer_not_begun", path=path, request_id=str(request_id),
                           error=repr(exc))
        return None
