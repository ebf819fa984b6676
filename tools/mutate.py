#!/usr/bin/env python3
"""Sampled mutation testing of kvobs's core modules: do their tests catch a small deliberate bug?

A mutant is the module with one small change (an operator swapped, a constant changed, a statement or a
condition removed, a return value swapped). The tool finds every such change in a module with the standard
`ast` module, picks a seeded sample, and runs the module's own test files (MODULE_TESTS) against each
mutant. A mutant is *killed* when the tests fail, *survived* when they pass: a survivor is a behaviour no
test checks. Scores are killed / (sampled - equivalent), per module; a timeout counts as killed (the tests
noticed, by hanging) but is listed apart.

The real source is never edited: the tracked and untracked (not ignored) files of the working tree are
copied once into a scratch directory, and each mutant is written there, with a fresh mtime so that no
stale bytecode (or numba cache) of an earlier mutant is reused. The tests run with the scratch copy first
on PYTHONPATH, so subprocesses they spawn import the mutant too.

    .venv/bin/python tools/mutate.py --module kvobs/_lifecycle/validation.py --sample 40 --seed 1
    .venv/bin/python tools/mutate.py --all --sample 35 --seed 1 --json /tmp/mutation.json
    .venv/bin/python tools/mutate.py --module kvobs/policy.py --list          # the sample, nothing run
    .venv/bin/python tools/mutate.py --module kvobs/policy.py --ids 3,17      # rerun chosen mutants

Each run of the tests is bounded (`--timeout`, default three times the unmutated run, at least 90 s) and
stops at the first failure: the mapped files run one pytest each, in order, with `-x`, so a killed mutant
costs little; survivors run every mapped file.
Exit status: 0 when every module reached `--target`, 1 otherwise, 2 when an unmutated run already fails.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Core module (a file; a package directory, or several files joined by commas: their mutants are sampled
# together) -> the test files that exercise it, the quickest and most telling first (pytest -x stops at the
# first failure). The comma groups are the parts split out of a core module since the issue listed them.
MODULE_TESTS: dict[str, list[str]] = {
    "kvobs/_lifecycle/validation.py": [
        "tests/lifecycle/test_validation.py", "tests/lifecycle/test_batches.py", "tests/integrity/test_integrity_wiring.py",
    ],
    "kvobs/policy.py": [
        "tests/integrity/test_integrity_wiring.py", "tests/integrity/test_integrity.py",
    ],
    "kvobs/_runtime/atomic.py": [
        "tests/locks/test_locks.py", "tests/lifecycle/test_lifecycle_reliability.py", "tests/locks/test_block_lock.py",
    ],
    "kvobs/locks/_cache_lock.py": [
        "tests/locks/test_locks.py", "tests/lifecycle/test_guard.py", "tests/lifecycle/test_async.py", "tests/lifecycle/test_lifecycle_reliability.py",
    ],
    "kvobs/locks/_block_lock.py": [
        "tests/locks/test_block_lock.py", "tests/locks/test_block_lock_model.py", "tests/locks/test_block_lock_processes.py",
    ],
    "kvobs/locks/_block_plan.py,kvobs/locks/_block_descriptions.py,kvobs/locks/_block_claim.py": [
        "tests/locks/test_block_lock.py", "tests/locks/test_block_lock_model.py", "tests/locks/test_block_lock_processes.py",
        "tests/locks/test_block_lock_storm.py",
    ],
    "kvobs/locks/_polling.py,kvobs/_runtime/forks.py": [
        "tests/locks/test_locks.py", "tests/locks/test_block_lock.py", "tests/locks/test_block_lock_processes.py",
        "tests/signals/test_signals.py",
    ],
    "kvobs/_lifecycle/transfer.py,kvobs/_lifecycle/checks.py": [
        "tests/lifecycle/test_guard.py", "tests/lifecycle/test_async.py", "tests/lifecycle/test_faults.py", "tests/lifecycle/test_validation.py",
        "tests/lifecycle/test_async_engines.py", "tests/lifecycle/test_lifecycle_reliability.py", "tests/lifecycle/test_batches.py",
        "tests/integrity/test_integrity_wiring.py", "tests/telemetry/test_trace_propagation.py",
    ],
    "kvobs/_lifecycle/fast_lane.py": [
        "tests/lifecycle/test_fast_lane.py", "tests/lifecycle/test_guard.py", "tests/lifecycle/test_faults.py", "tests/lifecycle/test_lifecycle_reliability.py",
    ],
    "kvobs/guard.py": [
        "tests/lifecycle/test_guard.py", "tests/lifecycle/test_async.py", "tests/lifecycle/test_faults.py", "tests/lifecycle/test_lifecycle_reliability.py",
        "tests/lifecycle/test_batches.py", "tests/integrity/test_integrity_wiring.py", "tests/lifecycle/test_validation.py",
    ],
    "kvobs/_lifecycle/active.py,kvobs/_lifecycle/route.py": [
        "tests/lifecycle/test_guard.py", "tests/lifecycle/test_faults.py", "tests/lifecycle/test_lifecycle_reliability.py", "tests/lifecycle/test_async.py",
        "tests/lifecycle/test_batches.py", "tests/integrity/test_integrity_wiring.py",
    ],
    "kvobs/signals": [
        "tests/signals/test_signals.py", "tests/signals/test_signals_bounds.py", "tests/signals/test_signals_step_aligned.py",
        "tests/signals/test_signals_ratelimit.py", "tests/signals/test_signals_interrupts.py",
    ],
    "kvobs/integrity": [
        "tests/integrity/test_integrity.py", "tests/integrity/test_integrity_kernel.py", "tests/integrity/test_integrity_validation.py",
        "tests/integrity/test_integrity_dlpack.py", "tests/integrity/test_integrity_wiring.py",
    ],
}

# Mutants that cannot change behaviour, keyed by (file, enclosing scope, the stripped source line, the mutation
# as printed): by text rather than line number, so that edits elsewhere in a file do not unhook them.
_RETRIED = ("a real error swallowed by the fast path is raised by ofd.granted when _wait_for_runs retries the "
            "run (only a transient one would differ, by succeeding)")
_ONE_RUN_TEST = "if last - first == count - 1 and all(map(operator.lt, blocks, islice(blocks, 1, None))):"
_ONE_RUN = "the one-run fast path: _runs finds the same single run"
_WITH_ADDED = "return tuple(a for a in active if a.holds()) + (t,) if active else (t,)"
_EXPLICIT = "a default no caller uses: start() and both guard wrappers pass skippable explicitly"
_ONE_TOKEN = "the end token is an iterator over one item: taking up to 2 takes the same one"
_CONSUMED = "the deque only consumes the undo steps and is thrown away; any maxlen runs every step"
EQUIVALENT: dict[tuple[str, str, str, str], str] = {
    ("kvobs/_runtime/atomic.py", "one_shot_release",
     "return functools.partial(deque, map(CALL, chain(held, (held.clear,))), 0)", "0 -> 1"): _CONSUMED,
    ("kvobs/_runtime/atomic.py", "release_now", "deque(map(CALL, chain(held, (held.clear,))), 0)", "0 -> 1"): _CONSUMED,
    ("kvobs/locks/_cache_lock.py", "_ExclusiveLock.__enter__", "raise LockTimeout(self.name, self.timeout or 0.0)",
     "operand 2 of 'or' removed"):
        "only a timeout of 0 gets here (None waits until acquired): 0 and 0.0 compare and print the same",
    ("kvobs/locks/_cache_lock.py", "<module>", "_FIRST_SLEEP_S = 50e-6", "5e-05 -> 0.0"):
        "performance only: a first pause of 0 turns the back-off into a busy poll with the same results",
    ("kvobs/locks/_block_plan.py", "BlockPlanner.plan", _ONE_RUN_TEST, "condition -> False"): _ONE_RUN,
    ("kvobs/locks/_block_plan.py", "BlockPlanner.plan", _ONE_RUN_TEST, "1 -> 2"):
        _ONE_RUN + " (sorted distinct ids never span count - 2, so the fast path is never taken)",
    ("kvobs/locks/_block_plan.py", "BlockPlanner.locked_blocks", "return set(claim.blocks)", "statement removed"):
        "the no-gap fast path: without bridging, the plan's runs are exactly the claim's blocks (whole-cache "
        "claims never get here: overlaps() answers them first)",
    ("kvobs/locks/_block_plan.py", "BlockPlanner._runs", "if block < expected:", "'<' -> '<='"):
        "only reached when block != expected",
    **{("kvobs/_lifecycle/fast_lane.py", where, "if async_wait.waiting:", "condition -> True"):
       "performance only: with no coroutine waiting, wake_waiters finds no waiters and does nothing"
       for where in ("guarded.guarded_call", "_record")},
    ("kvobs/_lifecycle/fast_lane.py", "Slot.expired_keys",
     "return keys if keys and t.t_begin + t.route.deadline_s <= now else []", "'<=' -> '<'"):
        "a deadline met to the exact float by a polling thread: '<' abandons the same call one poll later",
    ("kvobs/_lifecycle/active.py", "<module>",
     'ACTIVE: ContextVar[tuple[Any, ...]] = ContextVar("kvobs_active_transfers", default=())',
     "'kvobs_active_transfers' -> 'XXkvobs_active_transfersXX'"): "a context variable's name only shows in its repr",
    ("kvobs/_lifecycle/active.py", "with_added", _WITH_ADDED, "condition -> True"):
        "the empty-context fast path: () + (t,) is (t,)",
    ("kvobs/_lifecycle/active.py", "forget", "if t in active:", "condition -> True"):
        "setting the context to the same transfers again changes nothing",
    ("kvobs/_lifecycle/route.py", "Route", "@dataclass(eq=False)", "False -> True"):
        "nothing compares or hashes routes (a transfer finds its lock through `route.lock is`)",
    ("kvobs/_lifecycle/transfer.py", "Transfer.validate",
     "if block_ids is UNSET and requests is UNSET and sync is None and self.keys is None \\", "condition -> False"):
        "the nothing-given fast path: the full checks of no inputs end in the same whole-cache claim",
    ("kvobs/_lifecycle/transfer.py", "Transfer.acquire", "def acquire(self, *, skippable: bool = False) -> None:",
     "False -> True"): _EXPLICIT,
    ("kvobs/_lifecycle/transfer.py", "Transfer.acquire_async",
     "async def acquire_async(self, *, skippable: bool = False) -> None:", "False -> True"): _EXPLICIT,
    **{("kvobs/_lifecycle/transfer.py", f"Transfer.{ending}", "mine.extend(islice(self._ending, 1))", "1 -> 2"): _ONE_TOKEN
       for ending in ("reject", "_time_out", "complete", "fail", "_end_as")},
    ("kvobs/_lifecycle/validation.py", "resolve_requests", "raise", "statement removed"):
        "unreachable: ids that pass for each request alone pass as a union too, so a failing union always has "
        "a request that fails alone and is named",
    ("kvobs/_lifecycle/transfer.py", "Transfer._time_out", "if mine:", "condition -> True"):
        "nothing else can end a transfer still waiting for its lock (it is in no open-transfer table yet)",
    ("kvobs/_lifecycle/transfer.py", "Transfer.holds", "return self.state in _HOLDING and bool(self._held)", "'and' -> 'or'"):
        "read only to refuse re-entry (claims of nothing are skipped, a NullLock overlaps nothing) and to prune "
        "ended entries; held-state with nothing to release, or the reverse, exists only within an ending",
    **{("kvobs/_lifecycle/transfer.py", "Transfer._ended", "if async_wait.waiting:", mutation):
       "performance only: a coroutine waiting for the lock still retries within its back-off (at most 5 ms)"
       for mutation in ("statement removed", "condition -> False")},
    ("kvobs/guard.py", "Guard._sync_wrapper.guarded", "if t.span is None:", "condition -> False"):
        "the no-span fast path: call_in_span runs the function the same way without a span",
    ("kvobs/guard.py", "Guard._sync_wrapper.guarded",
     "return t.returned(result, later) if later else t.complete(result)", "condition -> True"):
        "the synchronous fast path: t.returned(result, False) is t.complete(result)",
    ("kvobs/guard.py", "_call_in_span", "if span is None:", "statement removed"):
        "unreachable: its only caller runs the function directly when there is no span",
    ("kvobs/signals/_reporting.py", "SignalReporter.describes",
     "return outcome in _DROPS or (self._logger is not None and outcome in self._levels)", "'and' -> 'or'"):
        "performance only: a wider answer collects more decisions, and describe() skips, by the same levels, "
        "every one that no log line or span event records",
    ("kvobs/integrity/_kernel_numba.py", "_lane_test", "if xor == 0 and keep == top:",
     "operand 1 of 'and' removed"):
        "keep == top only in the sign-ignored rules, and every one of them has xor == 0 (see bits.lane_test)",
    ("kvobs/integrity/_kernel_numba.py", "ready",
     ("sample, segments, rule, test = np.zeros(1, word), np.zeros(1, np.int64), np.ones(4, word), "
      "np.zeros(5, np.uint64)"), "1 -> 2"):
        "the warm-up call's argument sizes: any valid call resolves the same argument types",
    **{("kvobs/signals/_core.py", function, line, mutation):
       "the plain-int fast path: as_int() returns a Python int >= 0 unchanged, 0 included"
       for function, line, mutations in (
           ("SignalBufferCore.finish", "if not (type(slot) is int and slot >= 0):",
            ("'>=' -> '>'", "0 -> 1", "condition -> True")),
           ("SignalBufferCore.signal",
            "if not (type(slot) is int and type(layer) is int and type(tokens) is int",
            ("condition -> True",)),
           ("SignalBufferCore.signal", "and slot >= 0 and layer >= 0 and tokens >= 0):", ("'>=' -> '>'", "0 -> 1")),
           ("SignalBufferCore.register",
            "if not (type(slot) is int and type(need_tokens) is int and slot >= 0 and need_tokens >= 0):",
            ("condition -> True", "'>=' -> '>'", "0 -> 1")))
       for mutation in mutations},
    **{("kvobs/signals/_core.py", function, line, mutation):
       "a narrower fast path: the rare path finds nothing due and room, and takes the same decision"
       for function, line, mutations in (
           ("SignalBufferCore._signal_locked", "if now <= self._expire_at and len(pending) < self._buffer_room:",
            ("'<=' -> '<'", "condition -> False")),
           ("SignalBufferCore.register",
            "if now <= self._expire_at and tokens <= need_tokens and len(live) < self._quiet_room:",
            ("'<=' -> '<'", "condition -> False")))
       for mutation in mutations},
    ("kvobs/signals/_core.py", "SignalBufferCore.finish",
     "if len(self._waits) >= FLUSH_AT:  # bounds the waits register() notes: see the class docstring", "'>=' -> '>'"):
        "a forced flush one finish() later: the noted waits stay bounded and every one still reaches the metrics",
    **{("kvobs/signals/_core.py", "SignalBufferCore._evict_oldest_locked", line, mutation):
       "performance only: compacting rebuilds the same dict in the same order; how often it runs changes only "
       "how far the walk to the oldest entry goes"
       for line, mutations in (
           ("self._evicted += 1", ("'+=' -> '-='", "statement removed", "1 -> 2")),
           ("if self._evicted > len(pending) // 8 + 64:",
            ("statement removed", "'>' -> '>='", "condition -> False", "condition -> True", "'+' -> '-'",
             "'//' -> '*'", "8 -> 9", "64 -> 65")),
           ("self._evicted = 0", ("statement removed", "0 -> 1")),
           ("pending.clear()", ("statement removed",)))
       for mutation in mutations},
    **{(module, function, line, "condition -> True"):
       "performance only: a sweep with nothing due expires nothing; it only recomputes _expire_at (-inf once "
       "nothing is pending, which sends the next buffered signal to the rare path, with the same decision)"
       for module, function, line in (
           ("kvobs/signals/_immediate.py", "EarlySignalBuffer._now_locked", "if now > self._expire_at:"),
           ("kvobs/signals/_step_aligned.py", "StepAlignedSignalBuffer._now_locked",
            "if self._step > self._expire_at:  # at the start of end_step(), or after an interrupted sweep"))},
    **{("kvobs/signals/_core.py", "held",
        'return type("Held", (), {"__slots__": (), "__enter__": lock.__enter__, "__exit__": lock.__exit__})()',
        mutation): "cosmetic: the one-off class's name, and whether its single instance has a __dict__"
       for mutation in ("'Held' -> 'XXHeldXX'", "'__slots__' -> 'XX__slots__XX'")},
    ("kvobs/signals/_reporting.py", "SignalReporter.__init__",
     "self._log = None if logger is None else RateLimitedLog(", "condition -> False"):
        "without a logger describe() finds no log level, so the rate-limited log is never used",
    ("kvobs/locks/_cache_lock.py", "_ExclusiveLock._mutex_locked", "raise NotImplementedError", "statement removed"):
        "an abstract method: both lock classes override it",
    ("kvobs/locks/_cache_lock.py", "ThreadLock.acquire_into",
     "if timeout == 0 or not push_if(held, lock.release, lock.acquire, True, _wait_arg(timeout)):",
     "operand 1 of 'or' removed"): "the no-wait fast path: lock.acquire(True, 0) is the same single try",
    ("kvobs/integrity/_kernel_numba.py", "_run_is_bad",
     "return whole < size and _max_key(words[start + whole : start + size], mask, flip, mask ^ mask) >= bad_min",
     "'^' -> '|'"):
        "performance only: a run wrongly suspected goes to _verdicts, which reads it value by value and clears it",
    ("kvobs/integrity/_kernel.py", "KernelPlan.block_bytes",
     "return self.segments.shape[0] * self.length * self.bits.width", "'*' -> '/'"):
        "performance only: it sizes the threads' shares of a split check, and every block is still checked once",
    ("kvobs/integrity/_torch_path.py", "_coalesce", "if i != prev + 1:", "'+' -> '-'"):
        "performance only: ids left uncoalesced are checked as runs of one, with the same verdicts",
    **{(module, "<module>", "if TYPE_CHECKING:", mutation): "imports for type checkers only, never run"
       for module in ("kvobs/locks/_block_claim.py", "kvobs/integrity/_check.py")
       for mutation in ("statement removed", "condition -> False")},
    ("kvobs/_lifecycle/transfer.py", "Transfer", "_cache_info: Any = None", "statement removed"):
        "read only by _check, after it returned for a transfer without a cache; validate() sets it whenever a "
        "cache comes with a policy, and without a policy _check is never called",
    **{("kvobs/_lifecycle/transfer.py", "Transfer._finish", line, "statement removed"):
       "the nothing-to-check fast path: the general path ends the same way when nothing moved and no policy"
       for line in ("if route.policy is None and moved is None and self.moved_from is None:  # nothing to check or count",
                    "return result  # the general path below would end the same way, only later")},
    ("kvobs/guard.py", "Guard.__exit__", "return None", "statement removed"):
        "never reached (__enter__ refuses), and a function without it returns None too",
    ("kvobs/locks/_block_lock.py", "<module>", "_FIRST_PAUSE_S = 50e-6", "5e-05 -> 0.0"):
        "performance only: a first pause of 0 turns the back-off into a busy poll with the same results",
    ("kvobs/locks/_block_lock.py", "BlockLock._lock", "raise", "statement removed"): _RETRIED,
    ("kvobs/locks/_block_lock.py", "BlockLock.close", "_LOCKS.discard(self)", "statement removed"):
        "a closed lock renewed in a forked child has nothing to renew: no descriptions, no claims",
    **{("kvobs/locks/_block_lock.py", "BlockLock._wait_for_runs",
        "if exclusive:  # through: the turnstile is for the next writer (UNLOCK_ALL would free it at the end)",
        mutation): "a turnstile kept while its writer holds the run's blocks exclusively stops only readers of "
                   "those blocks, who wait for the writer anyway; the release unlocks everything on the description"
       for mutation in ("condition -> False", "statement removed")},
    ("kvobs/guard.py", "Guard._sync_wrapper.guarded", "if result is not None and inspect.isawaitable(result):",
     "operand 1 of 'and' removed"): "the common-case shortcut: inspect.isawaitable(None) is False too",
    ("kvobs/_lifecycle/transfer.py", "Transfer.validate",
     "return self  # nothing given: the checks below would end in the same whole-cache claim", "statement removed"):
        "the nothing-given fast path: the full checks of no inputs end in the same whole-cache claim",
    ("kvobs/_lifecycle/transfer.py", "Transfer._after_wait", "self._release()", "statement removed"):
        "every caller of acquire() and acquire_async() releases on any exception it raises (start, __aenter__, "
        "both guard wrappers); this only releases a moment earlier",
    ("kvobs/locks/_block_lock.py", "_undo_newest", "deque(map(CALL, map(_POPLEFT, repeat(held, count))), 0)", "0 -> 1"):
        _CONSUMED,
    ("kvobs/locks/_block_lock.py", "BlockLock._lock", "try:", "statement removed"):
        "the one-pass fast path: _wait_for_runs takes the same runs one by one (granted, waited for, or raised)",
    ("kvobs/locks/_block_lock.py", "BlockLock._lock", "if not ofd.is_contention(exc):", "statement removed"):
        _RETRIED,
    ("kvobs/locks/_block_lock.py", "BlockLock._lock", "if not ofd.is_contention(exc):", "condition -> False"):
        _RETRIED,
}

_COMPARE_SWAPS = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
}
_BINOP_SWAPS = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv, ast.BitOr: ast.BitAnd, ast.BitAnd: ast.BitOr, ast.BitXor: ast.BitOr,
    ast.LShift: ast.RShift, ast.RShift: ast.LShift, ast.Pow: ast.Mult,
}
_NAME_SWAPS = {"min": "max", "max": "min", "any": "all", "all": "any"}
_SYMBOLS = {
    ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is",
    ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.Add: "+", ast.Sub: "-", ast.Mult: "*",
    ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.BitOr: "|", ast.BitAnd: "&", ast.BitXor: "^",
    ast.LShift: "<<", ast.RShift: ">>", ast.Pow: "**", ast.And: "and", ast.Or: "or",
}
# Statements a mutant may remove (replace by `pass`); definitions and imports are structure, not behaviour.
_REMOVABLE = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Raise, ast.Return, ast.If, ast.For,
              ast.While, ast.With, ast.Try, ast.Delete, ast.Assert)


@dataclass
class Mutant:
    id: int
    file: str  # relative to the repository root
    line: int
    scope: str  # the enclosing class and function ("Transfer.complete"), "<module>" at the top level
    description: str
    source_line: str
    start: int  # byte offsets in the file of the span replaced by `text`
    end: int
    text: str
    status: str = "pending"  # killed, survived, timeout, equivalent, invalid
    seconds: float = 0.0
    reason: str = ""
    failed_test: str = ""

    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class ModuleReport:
    module: str
    tests: list[str]
    candidates: int
    mutants: list[Mutant] = field(default_factory=list)
    baseline_s: float = 0.0
    timeout_s: float = 0.0

    def count(self, status: str) -> int:
        return sum(m.status == status for m in self.mutants)

    def score(self) -> float:
        counted = len(self.mutants) - self.count("equivalent") - self.count("invalid")
        caught = self.count("killed") + self.count("timeout")
        return caught / counted if counted else 1.0


# -- finding mutants --------------------------------------------------------------------------------------


class _Finder(ast.NodeVisitor):
    """Collects (node, replacement node or source text, description) for every mutation point of a module."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.AST, ast.AST | str, str, str]] = []
        self._skip: set[int] = set()
        self._scope: list[str] = []

    def add(self, node: ast.AST, replacement: ast.AST | str, description: str) -> None:
        if id(node) not in self._skip and hasattr(node, "end_col_offset"):
            self.found.append((node, replacement, description, ".".join(self._scope) or "<module>"))

    def _visit_scope(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._scope.append(node.name)
        try:
            self.generic_visit(node)
        finally:
            self._scope.pop()

    def skip_subtree(self, node: ast.AST | None) -> None:
        if node is not None:
            self._skip.update(id(n) for n in ast.walk(node))

    # Structure that is not behaviour: docstrings, annotations, imports, __all__, f-string internals.
    def visit_Module(self, node: ast.Module) -> None:
        self._skip_docstring(node)
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._skip_docstring(node)
        self._visit_scope(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._skip_docstring(node)
        self.skip_subtree(node.returns)
        for arg in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg,
                    node.args.kwarg):
            if arg is not None:
                self.skip_subtree(arg.annotation)
        self._visit_scope(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.skip_subtree(node.annotation)
        if node.value is not None and id(node) not in self._skip:
            self.add(node, "pass", "statement removed")
        self.generic_visit(node)

    def visit_Import(self, node: ast.AST) -> None:
        self.skip_subtree(node)

    visit_ImportFrom = visit_Import

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        self.skip_subtree(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        typing_only = isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) \
            and node.value.func.id in ("TypeVar", "ParamSpec", "NewType")
        if typing_only or any(isinstance(t, ast.Name) and t.id in ("__all__", "__slots__") for t in node.targets):
            self.skip_subtree(node)
            return
        self._statement(node)
        self.generic_visit(node)

    def _skip_docstring(self, node: ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            self.skip_subtree(body[0])

    def _statement(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            return  # `...` in a protocol body, or a docstring
        self.add(node, "pass", "statement removed")

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, _REMOVABLE) and not isinstance(node, (ast.Assign, ast.AnnAssign)):
            self._statement(node)
        super().generic_visit(node)

    # Expressions.
    def visit_Compare(self, node: ast.Compare) -> None:
        for i, op in enumerate(node.ops):
            swap = _COMPARE_SWAPS.get(type(op))
            if swap is not None:
                ops = list(node.ops)
                ops[i] = swap()
                self.add(node, ast.Compare(node.left, ops, node.comparators),
                         f"'{_SYMBOLS[type(op)]}' -> '{_SYMBOLS[swap]}'")
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        self.add(node, ast.BoolOp(other, node.values),
                 f"'{_SYMBOLS[type(node.op)]}' -> '{_SYMBOLS[type(other)]}'")
        for i in range(len(node.values)):
            rest = node.values[:i] + node.values[i + 1:]
            replacement = rest[0] if len(rest) == 1 else ast.BoolOp(node.op, rest)
            self.add(node, replacement, f"operand {i + 1} of '{_SYMBOLS[type(node.op)]}' removed")
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            self.add(node, node.operand, "'not' removed")
        elif isinstance(node.op, ast.USub):
            self.add(node, node.operand, "unary '-' removed")
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        swap = _BINOP_SWAPS.get(type(node.op))
        if swap is not None:
            self.add(node, ast.BinOp(node.left, swap(), node.right),
                     f"'{_SYMBOLS[type(node.op)]}' -> '{_SYMBOLS[swap]}'")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        swap = _BINOP_SWAPS.get(type(node.op))
        if swap is not None:
            self.add(node, ast.AugAssign(node.target, swap(), node.value),
                     f"'{_SYMBOLS[type(node.op)]}=' -> '{_SYMBOLS[swap]}='")
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        self.add(node.test, ast.Constant(True), "condition -> True")
        self.add(node.test, ast.Constant(False), "condition -> False")
        self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self.add(node.test, ast.Constant(True), "condition -> True")
        self.add(node.test, ast.Constant(False), "condition -> False")
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        value = node.value
        if value is not None and not (isinstance(value, ast.Constant) and value.value in (None, True, False)):
            self.add(node, ast.Return(ast.Constant(None)), "return value -> None")
        self.generic_visit(node)

    def visit_Break(self, node: ast.Break) -> None:
        self.add(node, ast.Continue(), "'break' -> 'continue'")

    def visit_Continue(self, node: ast.Continue) -> None:
        self.add(node, ast.Break(), "'continue' -> 'break'")

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in _NAME_SWAPS:
            self.add(node.func, ast.Name(_NAME_SWAPS[node.func.id], ast.Load()),
                     f"'{node.func.id}' -> '{_NAME_SWAPS[node.func.id]}'")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        value = node.value
        if isinstance(value, bool):
            self.add(node, ast.Constant(not value), f"{value} -> {not value}")
        elif isinstance(value, int):
            self.add(node, ast.Constant(value + 1), f"{value} -> {value + 1}")
        elif isinstance(value, float):
            new = 0.0 if value else 1.0
            self.add(node, ast.Constant(new), f"{value!r} -> {new!r}")
        elif isinstance(value, str) and value and " " not in value and len(value) <= 40:
            self.add(node, ast.Constant(f"XX{value}XX"), f"{value!r} -> 'XX{value}XX'")


def _line_offsets(source: bytes) -> list[int]:
    offsets = [0]
    for line in source.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    return offsets


def find_mutants(files: list[Path], sources: dict[str, bytes]) -> list[Mutant]:
    """Every valid mutant of `files`, in source order, numbered from 0; `sources` gets each file's text as
    read (the mutants' offsets refer to it). A mutant whose source does not compile, or that parses to the
    same tree as the original, is left out."""
    mutants: list[Mutant] = []
    next_id = 0
    for path in files:
        source = sources[str(path.relative_to(ROOT))] = path.read_bytes()
        tree = ast.parse(source)
        original_dump = ast.dump(tree)
        offsets = _line_offsets(source)
        lines = source.decode().splitlines()
        finder = _Finder()
        finder.visit(tree)
        seen: set[bytes] = set()
        rel = str(path.relative_to(ROOT))
        for node, replacement, description, scope in sorted(
                finder.found, key=lambda f: (f[0].lineno, f[0].col_offset, f[2])):
            start = offsets[node.lineno - 1] + node.col_offset
            end = offsets[node.end_lineno - 1] + node.end_col_offset
            if isinstance(replacement, str):
                text = replacement
            elif isinstance(replacement, ast.stmt):
                text = ast.unparse(replacement)
            else:
                text = f"({ast.unparse(replacement)})"
            mutated = source[:start] + text.encode() + source[end:]
            if mutated in seen:
                continue
            seen.add(mutated)
            try:
                if ast.dump(ast.parse(mutated)) == original_dump:
                    continue
                compile(mutated, str(path), "exec")
            except SyntaxError:
                continue
            mutants.append(Mutant(next_id, rel, node.lineno, scope, description,
                                  lines[node.lineno - 1].strip(), start, end, text))
            next_id += 1
    return mutants


def module_files(module: str) -> list[Path]:
    files: list[Path] = []
    for part in module.split(","):
        path = ROOT / part
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


# -- running ----------------------------------------------------------------------------------------------


def make_scratch() -> Path:
    """A copy of the working tree's tracked and untracked (not ignored) files, without bytecode."""
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, check=True, capture_output=True).stdout
    scratch = Path(tempfile.mkdtemp(prefix="kvobs-mutate-"))
    for name in filter(None, listing.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            dst = scratch / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    return scratch


class Runner:
    """Runs a module's tests in the scratch copy, one mutant at a time."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.env = dict(os.environ, PYTHONPATH=f"{scratch}{os.pathsep}{scratch / 'tests'}")
        self._stamp = int(time.time()) + 1_000_000  # strictly increasing mtimes: no stale bytecode

    def write(self, rel: str, data: bytes) -> None:
        path = self.scratch / rel
        path.write_bytes(data)
        self._stamp += 2
        os.utime(path, (self._stamp, self._stamp))

    def run_tests(self, tests: list[str], timeout: float) -> tuple[str, float, str]:
        """Run the test files one pytest at a time, in order, until one fails: a mutant killed by the first
        (light) file never pays for collecting the heavy ones. Returns ('passed' | 'failed' | 'timeout',
        seconds, the first failing test or file)."""
        start = time.monotonic()
        for test_file in tests:
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                return "timeout", time.monotonic() - start, test_file
            outcome, failed = self._pytest(test_file, left)
            if outcome != "passed":
                return outcome, time.monotonic() - start, failed or test_file
        return "passed", time.monotonic() - start, ""

    def _pytest(self, test_file: str, timeout: float) -> tuple[str, str]:
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header",
               "-o", "addopts=", test_file]
        proc = subprocess.Popen(cmd, cwd=self.scratch, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            outcome = "passed" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            outcome, out = "timeout", b""
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the tests' own subprocesses too
            except ProcessLookupError:
                pass
            proc.wait()
        for line in out.decode(errors="replace").splitlines():
            if line.startswith(("FAILED ", "ERROR ")):
                return outcome, line.split(" ", 2)[1]
        return outcome, ""


def run_module(runner: Runner | None, module: str, args: argparse.Namespace) -> ModuleReport:
    tests = args.tests.split(",") if args.tests else MODULE_TESTS[module]
    base = runner.scratch if runner else ROOT
    tests = [t for t in tests if (base / t).exists()]
    originals: dict[str, bytes] = {}
    mutants = find_mutants(module_files(module), originals)
    report = ModuleReport(module, tests, len(mutants))
    if args.ids:
        wanted = {int(i) for i in args.ids.split(",")}
        sample = [m for m in mutants if m.id in wanted]
    else:
        rng = random.Random(f"{args.seed}:{module}")
        sample = sorted(rng.sample(mutants, min(args.sample, len(mutants))), key=lambda m: m.id)
    report.mutants = sample
    print(f"\n== {module}: {len(sample)} of {len(mutants)} mutants; tests: {' '.join(tests)}", flush=True)
    if args.list:
        for m in sample:
            print(f"  #{m.id:<4} {m.where():32} {m.scope[:30]:30} {m.description:34} | {m.source_line[:60]}")
        return report
    outcome, report.baseline_s, failed = runner.run_tests(tests, args.timeout or 1200)
    if outcome != "passed":
        print(f"  the unmutated tests do not pass ({outcome} {failed}); module skipped", flush=True)
        report.mutants = []
        report.baseline_s = -1.0
        return report
    report.timeout_s = args.timeout or max(90.0, 3 * report.baseline_s)
    print(f"  unmutated run {report.baseline_s:.0f} s; timeout per mutant {report.timeout_s:.0f} s", flush=True)
    for rel, data in originals.items():  # the scratch copy may predate edits made since: use what we parsed
        runner.write(rel, data)
    for n, m in enumerate(sample, 1):
        reason = EQUIVALENT.get((m.file, m.scope, m.source_line, m.description))
        if reason:
            m.status, m.reason = "equivalent", reason
        else:
            source = originals[m.file]
            runner.write(m.file, source[:m.start] + m.text.encode() + source[m.end:])
            try:
                outcome, m.seconds, m.failed_test = runner.run_tests(tests, report.timeout_s)
            finally:
                runner.write(m.file, source)
            m.status = {"passed": "survived", "failed": "killed", "timeout": "timeout"}[outcome]
        print(f"  [{n}/{len(sample)}] {m.status.upper():10} #{m.id:<4} {m.where():32} {m.description:34} "
              f"{m.seconds:5.0f} s  {m.failed_test or m.reason}", flush=True)
    return report


def summarise(reports: list[ModuleReport], target: float) -> bool:
    print("\nmodule                  sampled killed survived equivalent timeout  score")
    ok = True
    for r in reports:
        if r.baseline_s < 0:
            print(f"{r.module:24} unmutated tests fail")
            ok = False
            continue
        score = r.score()
        ok = ok and score >= target
        print(f"{r.module:24} {len(r.mutants):7} {r.count('killed'):6} {r.count('survived'):8} "
              f"{r.count('equivalent'):10} {r.count('timeout'):7} {score:6.1%}")
    for r in reports:
        for m in r.mutants:
            if m.status in ("survived", "timeout", "equivalent"):
                extra = f" ({m.reason})" if m.reason else ""
                print(f"  {m.status:10} #{m.id:<4} {m.where():32} in {m.scope}: {m.description}{extra}\n"
                      f"{'':16}{m.source_line}")
    return ok


def iter_modules(args: argparse.Namespace) -> Iterator[str]:
    if args.all:
        yield from MODULE_TESTS
    for module in args.module or ():
        module = module.rstrip("/")
        if module not in MODULE_TESTS and not args.tests:
            raise SystemExit(f"no test mapping for {module}; known: {', '.join(MODULE_TESTS)} (or pass --tests)")
        yield module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", help="a core module or package (repeatable)")
    parser.add_argument("--all", action="store_true", help="every module in MODULE_TESTS")
    parser.add_argument("--sample", type=int, default=35, help="mutants per module (default 35)")
    parser.add_argument("--seed", default="1", help="sampling seed (default 1)")
    parser.add_argument("--ids", help="run these mutant ids instead of a sample (comma-separated)")
    parser.add_argument("--tests", help="test files to run instead of the mapping (comma-separated)")
    parser.add_argument("--timeout", type=float, help="seconds per mutant (default 3x the unmutated run)")
    parser.add_argument("--target", type=float, default=0.95, help="score each module must reach")
    parser.add_argument("--list", action="store_true", help="print the sampled mutants, run nothing")
    parser.add_argument("--json", help="write the reports to this file")
    parser.add_argument("--keep-scratch", action="store_true", help="leave the scratch copy in place")
    args = parser.parse_args(argv)
    modules = list(iter_modules(args))
    if not modules:
        parser.error("give --module or --all")
    scratch = None if args.list else make_scratch()
    try:
        runner = Runner(scratch) if scratch else None
        reports = [run_module(runner, module, args) for module in modules]
    finally:
        if scratch and not args.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.list:
        return 0
    ok = summarise(reports, args.target)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) | {"score": r.score()} for r in reports], indent=1))
    if any(r.baseline_s < 0 for r in reports):
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
