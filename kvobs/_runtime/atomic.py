"""Bookkeeping that an asynchronous exception cannot tear: what is held is always known, and released once.

Python runs signal handlers (Ctrl-C's KeyboardInterrupt among them) between bytecodes, notably right after a
call into C returns. So `ok = lock.acquire(); self.held = ok` can be interrupted after the lock is taken and
before anyone knows, and `self.held = False; lock.release()` after the record is cleared and before the lock
is free: either way the lock leaks. A bare `with threading.Lock():` never leaks, because the interpreter
acquires and registers the exit in C.

kvobs gets the same guarantee by never letting bytecode run between an action and its record:

- `push_if(held, undo, attempt, *args)` calls `attempt(*args)` and, when it succeeds, pushes `undo` onto the
  `held` deque inside ONE C-level call (`deque.extendleft` consuming a lazy `map`). At every bytecode
  boundary `held` lists exactly the undo steps of what is held, newest first.
- `one_shot_release(held)` is built BEFORE anything is acquired and returns a callable that runs every undo
  in `held` (newest first) and then clears it, again inside one C-level call. It does its work at most once,
  from any thread, so cleanup paths may call it freely.
- `one_shot_release_when_dropped(held)` is that callable together with a one-argument twin sharing its one
  shot, for a weak reference's callback: C code runs it when the referent dies, with no bytecode before it.
- `exit_releasing_when_dropped(held, exit_function, *args)` is the exit a `with` statement calls, watched so
  that its death releases `held` (see below): the with-statement holds it only on the interpreter stack.
- Who ends something is decided the same way: `mine.extend(islice(token_iterator, 1))` moves a one-shot
  token into the caller's own list in one C call, so the winner knows it won even if interrupted at once.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections import deque
from collections.abc import Callable
from itertools import chain, compress, starmap
from typing import Any

Held = deque  # of zero-argument undo callables, newest first

CALL = getattr(operator, "call", operator.methodcaller("__call__"))  # operator.call: Python 3.11+, faster
_SECOND = operator.itemgetter(1)


def push_if(held: Held, undo: Callable[[], Any], attempt: Callable[..., Any], *args: Any) -> bool:
    """Run `attempt(*args)`; if it returns a true value, record `undo` in `held` in the same C call.

    An exception raised by `attempt` records nothing. Returns whether `undo` was recorded.
    """
    before = len(held)
    held.extendleft(compress((undo,), starmap(attempt, (args,))))
    return len(held) != before


def push_unless_raises(held: Held, undo: Callable[[], Any], attempt: Callable[..., Any], *args: Any) -> None:
    """Run `attempt(*args)` (for calls such as `fcntl.flock` that return None and raise on failure) and
    record `undo` in the same C call unless it raised."""
    held.extendleft(map(_SECOND, zip(starmap(attempt, (args,)), (undo,))))


def one_shot_release(held: Held) -> Callable[[], Any]:
    """A callable that runs the undo steps in `held` (newest first), then empties it; a no-op afterwards.

    Build it before acquiring: the iterators read `held` lazily, when the callable first runs.
    """
    return functools.partial(deque, map(CALL, chain(held, (held.clear,))), 0)


def one_shot_release_when_dropped(held: Held) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """`one_shot_release(held)`, and a twin taking (and ignoring) one argument, as `weakref.ref` passes to its
    callback. They share one iterator over the undo steps: whichever runs first undoes `held`, the other then
    finds nothing to do. `functools.reduce` only consumes it (`operator.is_` never raises)."""
    steps = map(CALL, chain(held, (held.clear,)))
    return functools.partial(deque, steps, 0), functools.partial(functools.reduce, operator.is_, steps)


def exit_releasing_when_dropped(
    held: Held, exit_function: Callable[..., Any], *args: Any
) -> tuple[Callable[[], Any], functools.partial, weakref.ref]:
    """(`one_shot_release(held)`, the exit, its watch): the exit is `functools.partial(exit_function, *args)`,
    and its death runs the undo steps in `held` (in C: the watch's callback shares the release's one shot).

    Why: a signal handler that raises (Ctrl-C) can land at the first instruction of a Python `__exit__`, before
    anything there runs, or in `__enter__` after the lock is taken but before it returns, when `with` calls no
    `__exit__` at all. The `with` statement looks `__exit__` up BEFORE it calls `__enter__` and keeps the result
    only on the interpreter stack until it has called it; so an `__exit__` descriptor handing out this exit, with
    `__enter__` acquiring into `held`, releases the lock as an interrupt leaves the with-statement. After a
    complete exit `held` is empty and the callback does nothing.
    """
    release, release_when_dropped = one_shot_release_when_dropped(held)
    exit_call = functools.partial(exit_function, *args)
    watch = weakref.ref(exit_call, release_when_dropped)
    exit_call.watch = watch  # lives as long as the exit: a weak reference that died first would call nothing
    return release, exit_call, watch


def release_now(held: Held) -> None:
    """Undo everything in `held` at once. If interrupted before it starts, `held` is intact for a retry."""
    deque(map(CALL, chain(held, (held.clear,))), 0)

