"""Begin and end the integration's transfers through one observer, so that observing never changes vLLM.

A transfer kvobs refuses (kvobs records and logs the refusal itself) leaves the copy unobserved and vLLM
untouched; completing a transfer that already ended (abandoned past its deadline) changes nothing. Only an
integrity finding changes what vLLM sees, as the integrity mode says: `report` hands the bad block ids to
the caller, which tells vLLM; `raise` raises CorruptKVError, at once for a store's sources (the store is then
never submitted), and for a load's destinations at the next safe point (`raise_pending`), once the wrapped
connector has done its own bookkeeping for the step.
"""

from __future__ import annotations

from typing import Any

from kvobs import semconv as sc
from kvobs.errors import CorruptKVError, TransferRejected
from kvobs.policy import IntegrityPolicy


class _Marker:
    """A result no engine returns, kept as it is by the policy's copy of its skip result."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __copy__(self) -> _Marker:
        return self

    def __deepcopy__(self, memo: Any) -> _Marker:
        return self

    def __repr__(self) -> str:
        return self.name


CORRUPT = _Marker("<kvobs: corrupt blocks>")
_LOADS = (sc.PATH_PREFETCH, sc.PATH_RECEIVE)  # paths whose destinations are vLLM's KV blocks


def policy_for(mode: str) -> Any:
    """The kvobs integrity policy behind an integration mode (see `options.INTEGRITY_MODES`)."""
    if mode == "off":
        return False
    if mode == "report":
        return IntegrityPolicy("skip", skip_result=CORRUPT)
    return mode


class Transfers:
    """The integration's transfers on one observer; `cache` is what checks read (set once caches register).

    One vLLM copy in `every` is checked, whole: the one sampler draws once per copy, and every KV group's
    part of a checked copy is checked (a sampler drawn per part, as a sampling policy's would be, checks
    the same groups every time and others never).
    """

    def __init__(self, obs: Any, mode: str, every: int = 1) -> None:
        self.obs = obs
        self.mode = mode
        self._check = policy_for(mode)
        # None: every copy is checked (or none, when the mode is off), with no draw per copy
        self._sampler = None if self._check is False or every == 1 else IntegrityPolicy(every=every).sampler()
        self.cache: Any = None
        self.block_bytes: int | None = None  # bytes a block holds across the checked caches, when known
        self.group_caches: list[Any] | None = None  # per KV group, when there are several
        self.group_block_bytes: list[int | None] = []
        self._split: dict[tuple[str, Any], list[Any]] = {}  # (path, key) -> its per-group keys
        self._pending: CorruptKVError | None = None

    def begin(self, path: str, key: Any, *, request_id: Any, block_ids: list[int], group_sizes: Any = None,
              trace_context: Any = None) -> tuple[int, ...]:
        """Begin a transfer now (a reading one's sources are checked now). Returns the bad source ids that
        `report` found (the transfer has then ended as failed), else (); `raise` raises them.

        With several KV groups (`group_caches` set and `group_sizes` naming them), each group's ids are a
        transfer of their own, under (key, group), checked in that group's layers only: block ids are unique
        only within a group."""
        check = self._check if self._sampler is None or self._sampler.should_check() else False
        groups = None if self.group_caches is None else self._per_group(block_ids, group_sizes)
        if groups is None:
            return self._begin(path, key, check, request_id, block_ids, group_sizes, self.cache, self.block_bytes,
                               trace_context)
        bad: list[int] = []
        keys = []
        for group, ids in groups:
            keys.append((key, group))
            bad.extend(self._begin(path, (key, group), check, request_id, ids, None, self.group_caches[group],
                                   self.group_block_bytes[group], trace_context))
        self._split[(path, key)] = keys
        return tuple(bad)

    def _per_group(self, block_ids: list[int], group_sizes: Any) -> list[tuple[int, list[int]]] | None:
        if group_sizes is None or len(group_sizes) != len(self.group_caches):
            return None
        groups = []
        start = 0
        for group, size in enumerate(group_sizes):
            ids = list(block_ids[start:start + size])
            start += size
            if ids:
                groups.append((group, ids))
        return groups

    def _begin(self, path: str, key: Any, check: Any, request_id: Any, block_ids: list[int], group_sizes: Any,
               cache: Any, block_bytes: int | None, trace_context: Any) -> tuple[int, ...]:
        try:
            self.obs.begin(path, check=check, key=key, request_id=request_id, block_ids=block_ids,
                           group_sizes=group_sizes, cache=cache,
                           nbytes=None if block_bytes is None else len(block_ids) * block_bytes,
                           trace_context=trace_context)
        except CorruptKVError as exc:
            if self.mode == "raise":
                raise
            return exc.bad_block_ids
        except TransferRejected:
            pass  # recorded and logged by kvobs; the copy goes on, unobserved
        return ()

    def complete(self, path: str, key: Any) -> tuple[int, ...]:
        """The copy under `key` is done: check a writing transfer's destinations and end it. Returns the bad
        destination ids `report` found, else (); `raise` keeps its error for `raise_pending`."""
        if not self._split:
            return self._complete(path, key)
        bad: list[int] = []
        for part in self._split.pop((path, key), (key,)):
            found = self._complete(path, part)
            if found and path in _LOADS:
                self._scrub(part[1], found)
            bad.extend(found)
        return tuple(bad)

    def _scrub(self, group: int, block_ids: tuple[int, ...]) -> None:
        """Zero a corrupt load's blocks in their KV group's caches. With several groups vLLM takes the load's
        failure per request: it frees the request's blocks as they are and computes it from the start, and
        the next request given one of them reads its unwritten slots too (attention masks them, but a masked
        NaN still makes the scores NaN). Zeros are inert there, so recomputation gives the clean tokens."""
        try:
            for view in self.group_caches[group]:  # type: ignore[index]  (split transfers have group caches)
                view[list(block_ids)] = 0
        except Exception as exc:
            self.obs.logger.exception("kvobs.vllm: could not zero the blocks of a corrupt load",
                                      block_ids=list(block_ids[:8]), error=repr(exc))

    def _complete(self, path: str, key: Any) -> tuple[int, ...]:
        t = self.obs.open_transfer(path, key)
        if t is None:
            return ()
        try:
            if t.complete() is CORRUPT:
                return t.bad_block_ids
        except CorruptKVError as exc:
            if self._pending is None:
                self._pending = exc
        return ()

    def fail(self, path: str, key: Any, error: BaseException) -> None:
        """The copy under `key` failed (the engine said so)."""
        for part in self._split.pop((path, key), (key,)):
            self.obs.fail(path, part, error)

    def is_open(self, path: str, key: Any) -> bool:
        return any(self.obs.open_transfer(path, part) is not None for part in self._split.get((path, key), (key,)))

    @property
    def pending(self) -> bool:
        """Whether `complete` kept a CorruptKVError for `raise_pending`."""
        return self._pending is not None

    def raise_pending(self) -> None:
        """Raise the first CorruptKVError kept by `complete` under the `raise` mode, if any."""
        pending, self._pending = self._pending, None
        if pending is not None:
            raise pending
