"""Which KV pages a PD transfer is checked against, per SGLang KV manager.

A KV manager knows its KV only as raw pointers (`kv_args.kv_data_ptrs`); the pool itself lives with the
scheduler. So the cache comes from the user: an SGLang device pool (`MHATokenToKVPool`, `MLATokenToKVPool`),
a list of tensors indexed by page, or a callable(kv_manager) returning either (called at the manager's first
transfer, e.g. to look the pool up where the application keeps it). None: transfers observed, not checked.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, NamedTuple

from kvobs import KVObserver
from kvobs.integrations.sglang._pages import PageIds, page_views


class ManagerView(NamedTuple):
    ids: PageIds
    cache: Any


class ManagerCaches:
    def __init__(self, obs: KVObserver, cache: Any) -> None:
        self._obs = obs
        self._cache = cache
        self._lock = threading.Lock()
        self._views: weakref.WeakKeyDictionary[Any, ManagerView] = weakref.WeakKeyDictionary()

    def of(self, manager: Any) -> ManagerView:
        view = self._views.get(manager)
        if view is None:
            with self._lock:
                view = self._views.get(manager) or self._resolve(manager)
                self._views[manager] = view
        return view

    def _resolve(self, manager: Any) -> ManagerView:
        source = self._cache(manager) if callable(self._cache) else self._cache
        page_size = _engine_page_size(manager, source) or self._obs.page_size or 1
        ids = PageIds(self._obs.page_size, page_size)
        if source is None:
            return ManagerView(ids, None)
        views, why = page_views(source, page_size)
        if views is None:
            self._obs.logger.warning("kvobs.sglang: PD transfers observed without NaN/Inf checks", reason=why)
        return ManagerView(ids, views)


def _engine_page_size(manager: Any, source: Any) -> int | None:
    size = getattr(getattr(manager, "kv_args", None), "page_size", None)
    if not isinstance(size, int):
        size = getattr(source, "page_size", None)
    return size if isinstance(size, int) and size > 0 else None
