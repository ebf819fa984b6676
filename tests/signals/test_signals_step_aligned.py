"""StepAlignedSignalBuffer: tensor-parallel ranks release identical batches; progress, overflow and bounds per step."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from signals_support import FakeClock, RecordingLogger, counts, make_metrics, nothing_but, outcome_count

from kvobs import semconv as sc
from kvobs.signals import EarlySignalBuffer, Progress, ReadySignal, SignalBufferFull, StepAlignedSignalBuffer
from kvobs.signals._core import SignalBufferCore
from kvobs.signals._reporting import ATTR_WAITED_S

RANKS = 4
FEW_SLOTS = st.integers(0, 3)  # few slots and small counts: repeats, ties and full bounds come often
MAX_PENDING, MAX_SLOTS, TTL_STEPS = 3, 3, 2


def interleave(events: list[tuple], rng: random.Random) -> list[tuple]:
    """A random order of one step's events that keeps each slot's registrations and finishes in order."""
    order = events[:]
    rng.shuffle(order)
    ctl: dict[int, list[tuple]] = {}
    for e in events:
        if e[0] != "S":
            ctl.setdefault(e[1], []).append(e)
    return [ctl[e[1]].pop(0) if e[0] != "S" else e for e in order]


def apply(buf: StepAlignedSignalBuffer, event: tuple) -> None:
    kind, slot, *rest = event
    if kind == "S":
        buf.signal(slot, *rest)
    elif kind == "R":
        buf.register(slot, *rest)
    else:
        buf.finish(slot)


@st.composite
def scenarios(draw) -> list[list[tuple]]:
    """Valid per-step events (a slot is finished before it is registered again) for every rank."""
    live: set[int] = set()
    steps = []
    for _ in range(draw(st.integers(1, 10))):
        events: list[tuple] = []
        for slot in draw(st.lists(st.integers(0, 7), max_size=5, unique=True)):
            for _ in range(draw(st.integers(1, 2))):
                if slot in live:
                    events.append(("F", slot))
                    live.discard(slot)
                else:
                    events.append(("R", slot, draw(st.integers(0, 60))))
                    live.add(slot)
        for _ in range(draw(st.integers(0, 8))):
            events.append(("S", draw(st.integers(0, 7)), draw(st.sampled_from([0, 0, 1])), draw(st.integers(0, 60))))
        steps.append(events)
    return steps


def run_immediate(steps: list[list[tuple]], seed: int) -> list[list[list[tuple]]]:
    """Per rank, per step, what EarlySignalBuffer releases when each rank sees its own interleaving."""
    results = []
    for rank in range(RANKS):
        rng = random.Random(seed * 1000 + rank)
        buf = EarlySignalBuffer(max_pending=5)
        per_step = []
        for events in steps:
            released: list[tuple] = []  # (slot, layer, tokens) of each send started
            for event in interleave(events, rng):
                if event[0] == "S":
                    if buf.signal(*event[1:]):
                        released.append((event[1], 0, event[3]))
                elif event[0] == "R":
                    if (tokens := buf.register(event[1], event[2])) is not None:
                        released.append((event[1], 0, tokens))
                else:
                    buf.finish(event[1])
            per_step.append(released)
        results.append(per_step)
    return results


def run_step_aligned(steps: list[list[tuple]], seed: int, **options) -> list[list[list[tuple]]]:
    """Per rank, per step, the batch StepAlignedSignalBuffer releases when each rank sees its own interleaving."""
    results = []
    for rank in range(RANKS):
        rng = random.Random(seed * 1000 + rank)
        buf = StepAlignedSignalBuffer(ttl_steps=3, max_pending=5, **options)
        per_step = []
        for events in steps:
            for event in interleave(events, rng):
                apply(buf, event)
            per_step.append([(s.slot, s.layer, s.tokens) for s in buf.end_step()])
        results.append(per_step)
    return results


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=scenarios(), seed=st.integers(0, 2**32))
def test_ranks_release_identical_batches(steps, seed):
    results = run_step_aligned(steps, seed)
    assert all(r == results[0] for r in results[1:])


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=scenarios(), seed=st.integers(0, 2**32))
def test_ranks_agree_when_registrations_are_refused(steps, seed):
    results = run_step_aligned(steps, seed, max_slots=5)  # of 8 slots: registrations beyond 5 live are refused
    assert all(r == results[0] for r in results[1:])


def test_immediate_buffer_can_diverge_between_ranks_step_aligned_does_not():
    # step 1: an early signal waits; step 2: a newer signal and the registration race on each rank
    steps = [[("S", 3, 0, 64)], [("S", 3, 0, 128), ("R", 3, 200)]]
    orders = {tuple(run_immediate(steps, seed)[0][1]) for seed in range(50)}
    assert len(orders) > 1  # rank A: recovered 64 + ready 128; rank B: recovered 128 -> barrier mismatch
    for seed in range(20):
        results = run_step_aligned(steps, seed)
        assert all(r == [[], [(3, 0, 64), (3, 0, 128)]] for r in results)


def test_ranks_on_real_threads_agree_and_count_the_same():
    """4 ranks, each fed by a signal thread and a control thread racing within every step."""
    rng = random.Random(7)
    live: set[int] = set()
    steps = []
    for _ in range(200):
        ctl = []
        for slot in rng.sample(range(16), 3):
            if slot in live:
                ctl.append(("F", slot))
                live.discard(slot)
            else:
                ctl.append(("R", slot, rng.randrange(100)))
                live.add(slot)
        sig = [("S", rng.randrange(16), rng.choice([0, 0, 1]), rng.randrange(100)) for _ in range(6)]
        steps.append((ctl, sig))

    registries = []
    batches: list[list[list[tuple]]] = [[] for _ in range(RANKS)]

    def rank(index: int) -> None:
        registry, metrics = make_metrics(f"rank{index}")
        registries.append((registry, f"rank{index}"))
        buf = StepAlignedSignalBuffer(metrics=metrics, ttl_steps=4, max_pending=6)
        for ctl, sig in steps:
            feeders = [threading.Thread(target=lambda evs=evs: [apply(buf, e) for e in evs]) for evs in (ctl, sig)]
            if index % 2:
                feeders.reverse()
            for t in feeders:
                t.start()
            for t in feeders:
                t.join()
            batches[index].append([(s.slot, s.layer, s.tokens) for s in buf.end_step()])

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(RANKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(batches[0]) == 200 and sum(map(len, batches[0])) > 0
    assert all(b == batches[0] for b in batches[1:])
    scraped = {tuple(counts(reg, eng).items()) for reg, eng in registries}
    assert len(scraped) == 1 and dict(next(iter(scraped)))["recovered"] > 0


def test_end_step_decides_the_recorded_calls_through_the_early_buffers_own_decisions(monkeypatch):
    """Each decision is written once (issue 23): end_step() applies what was recorded through the very decisions
    an EarlySignalBuffer makes at each call (a signal's is the lock-free one its signal() and signal_batch() share),
    in canonical order."""
    decided: list[tuple] = []
    for name in ("_signal_locked", "register", "finish"):
        def spy(self, *args, _decide=getattr(SignalBufferCore, name), _name=name):
            decided.append((_name, *args))
            return _decide(self, *args)
        monkeypatch.setattr(SignalBufferCore, name, spy)
    buf = StepAlignedSignalBuffer(clock=FakeClock())
    buf.finish(3)
    buf.signal(2, 1, 4)
    buf.register(2, 9)
    buf.signal(1, 0, 5)
    assert decided == []  # recorded only
    assert buf.end_step() == []
    assert decided == [("register", 2, 9), ("finish", 3), ("_signal_locked", 1, 0, 5),
                       ("_signal_locked", 2, 1, 4)]
    assert buf.progress(2) == Progress(4, 1)


def test_calls_only_record_until_end_step_and_expire_in_steps():
    registry, metrics = make_metrics()
    buf = StepAlignedSignalBuffer(metrics=metrics, ttl_steps=2, clock=FakeClock())
    assert buf.signal(1, 0, 10) is None and buf.register(2, 10) is None
    with pytest.raises(ValueError, match="already registered"):
        buf.register(2, 10)  # duplicate within the step is caught when recorded
    assert buf.pending_count == 0 and buf.registered_slots() == frozenset()
    assert buf.end_step() == []
    assert buf.pending_count == 1 and buf.registered_slots() == frozenset({2})
    with pytest.raises(ValueError, match="already registered"):
        buf.register(2, 10)  # live as of the last step
    buf.signal(2, 0, 4)
    assert buf.end_step() == [ReadySignal(2, 0, 4, 0.0)]
    buf.end_step()
    assert buf.pending_count == 1  # buffered at step 1, now step 3: waited 2 steps, not more
    buf.end_step()
    assert buf.pending_count == 0 and outcome_count(registry, "expired") == 1
    buf.finish(2)
    buf.register(2, 5)  # finish then register in one step: allowed, applied in that order
    buf.end_step()
    assert buf.registered_slots() == frozenset({2})
    assert counts(registry) == nothing_but(buffered=1, ready=1, expired=1)


def test_layer1_signals_advance_progress_at_the_step_boundary():
    buf = StepAlignedSignalBuffer()
    buf.register(4, 100)
    buf.end_step()
    buf.signal(4, 1, 32)
    buf.signal(4, 3, 32)
    buf.signal(4, 2, 32)  # merged within the step: the furthest layer wins
    assert buf.progress(4) is None  # recorded, not decided
    assert buf.end_step() == []  # layers above 0 never release a send
    assert buf.progress(4) == Progress(tokens=32, layer=3)
    buf.signal(4, 1, 64)  # the next chunk: more tokens at a lower layer is further
    buf.signal(4, 0, 64)
    assert buf.end_step() == [ReadySignal(4, 0, 64, 0.0)]
    assert buf.progress(4) == Progress(64, 1)
    buf.signal(4, 5, 48)  # an older chunk's layer arriving late does not move progress back
    buf.end_step()
    assert buf.progress(4) == Progress(64, 1)


def test_slots_with_no_layer0_signal_release_nothing_and_buffer_nothing():
    registry, metrics = make_metrics()
    buf = StepAlignedSignalBuffer(metrics=metrics)
    buf.register(1, 100)
    buf.end_step()
    buf.signal(1, 2, 16)  # live slot, layer 2 only
    buf.signal(7, 1, 16)  # unregistered slot, layer 1 only: nothing to keep
    assert buf.end_step() == []
    assert buf.pending_count == 0 and buf.progress(7) is None and buf.progress(1) == Progress(16, 2)
    buf.register(7, 100)
    assert buf.end_step() == []  # nothing was waiting for slot 7
    assert counts(registry) == nothing_but()


def test_overflow_keeps_the_lowest_slots_on_every_rank_and_counts_the_rest():
    registry, metrics = make_metrics()
    logger = RecordingLogger()
    buf = StepAlignedSignalBuffer(metrics=metrics, logger=logger, max_pending=3, clock=FakeClock())
    for slot in (9, 4, 7, 1, 8, 2):  # six slots signal in one step; three fit
        buf.signal(slot, 0, slot * 10)
    buf.end_step()
    assert buf.pending_count == 3
    assert outcome_count(registry, "overflow") == 3 and outcome_count(registry, "buffered") == 3
    for slot in (1, 2, 4):
        buf.register(slot, 100)
    recovered = buf.end_step()
    assert [(s.slot, s.tokens) for s in recovered] == [(1, 10), (2, 20), (4, 40)]
    # the first overflow line: slot 9 was evicted from the step's record by slot 1, having never waited
    (line,) = [kw for _, _, kw in logger.records if kw[sc.ATTR_OUTCOME] == "overflow"]
    assert line == {sc.ATTR_SLOT: 9, sc.ATTR_TOKENS: 90, sc.ATTR_OUTCOME: "overflow", ATTR_WAITED_S: 0.0}


def test_a_signal_beyond_a_full_step_record_is_refused_having_never_waited():
    logger = RecordingLogger()
    buf = StepAlignedSignalBuffer(logger=logger, max_pending=1, clock=FakeClock())
    buf.signal(1, 0, 10)
    buf.signal(2, 0, 20)  # a higher slot than every kept one: refused at once, the record unchanged
    (line,) = [kw for _, _, kw in logger.records if kw[sc.ATTR_OUTCOME] == "overflow"]
    assert line == {sc.ATTR_SLOT: 2, sc.ATTR_TOKENS: 20, sc.ATTR_OUTCOME: "overflow", ATTR_WAITED_S: 0.0}
    buf.end_step()
    assert buf.pending_count == 1


def test_an_evicted_pending_signal_is_logged_with_its_age():
    clock = FakeClock()
    logger = RecordingLogger()
    buf = StepAlignedSignalBuffer(logger=logger, max_pending=2, ttl_steps=100, clock=clock)
    buf.signal(5, 0, 50)
    buf.end_step()
    clock.advance(1.5)
    buf.signal(6, 0, 60)
    buf.end_step()
    clock.advance(2.0)
    buf.signal(3, 0, 30)  # a third pending slot evicts the oldest pending one, slot 5, buffered 3.5 s ago
    buf.end_step()
    (line,) = [kw for _, _, kw in logger.records if kw[sc.ATTR_OUTCOME] == "overflow"]
    assert line == {sc.ATTR_SLOT: 5, sc.ATTR_TOKENS: 50, sc.ATTR_OUTCOME: "overflow", ATTR_WAITED_S: 3.5}
    buf.register(6, 60)
    clock.advance(0.5)
    assert buf.end_step() == [ReadySignal(6, 0, 60, 2.5)]  # buffered_s: from the step boundary that buffered it


def test_registrations_beyond_max_slots_are_refused_at_the_step_identically():
    registry, metrics = make_metrics()
    buf = StepAlignedSignalBuffer(metrics=metrics, max_slots=2)
    buf.signal(3, 0, 30)
    for slot in (5, 3, 1):  # in any order: the lowest slots win
        buf.register(slot, 100)
    assert buf.end_step() == [ReadySignal(3, 0, 30, 0.0)]
    assert buf.registered_slots() == frozenset({1, 3})
    assert outcome_count(registry, "refused") == 1
    buf.finish(1)
    buf.register(5, 100)  # a finish earlier in slot order makes room within the same step
    buf.end_step()
    assert buf.registered_slots() == frozenset({3, 5})


def test_calls_recorded_without_end_step_are_bounded_and_refused_with_a_clear_error():
    registry, metrics = make_metrics()
    buf = StepAlignedSignalBuffer(metrics=metrics, max_slots=3)
    for slot in range(3):
        buf.register(slot, 10)
        buf.finish(slot)
    with pytest.raises(SignalBufferFull, match=r"2\*max_slots=6 reached.*end_step\(\)") as refused:
        buf.register(99, 10)
    with pytest.raises(SignalBufferFull):
        buf.finish(98)
    assert refused.value.limit == "2*max_slots" and refused.value.size == 6
    assert outcome_count(registry, "refused") == 2
    buf.end_step()  # the step record is applied and emptied: room again
    buf.register(99, 10)
    buf.end_step()
    assert buf.registered_slots() == frozenset({99})


def test_constructor_rejects_bad_settings():
    for kwargs in (dict(ttl_steps=0), dict(max_pending=0), dict(max_slots=0)):
        (name,) = kwargs
        with pytest.raises(ValueError, match=name):
            StepAlignedSignalBuffer(**kwargs)
    with pytest.raises(TypeError, match="^ttl_steps must be an int"):
        StepAlignedSignalBuffer(ttl_steps=2.5)
    with pytest.raises(TypeError):
        StepAlignedSignalBuffer(on_recovered=print)  # signals are released by end_step() only


def test_bad_inputs_record_nothing():
    buf = StepAlignedSignalBuffer()
    with pytest.raises(TypeError, match="slot must be an int"):
        buf.signal(1.0, 0, 1)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        buf.signal_batch(0, [1, 2], [3, -1])
    with pytest.raises(ValueError, match="need_tokens must be >= 0"):
        buf.register(1, -1)
    assert buf.signal_batch(0, [1, 2], [3, 4], count=-1) is None
    buf.signal_batch(0, [1, 2], [3, 4], count=1)
    assert buf.end_step() == [] and buf.pending_count == 1


class StepAlignedAgainstImmediate(RuleBasedStateMachine):
    """A StepAlignedSignalBuffer against an EarlySignalBuffer fed each step's events in the canonical order
    (expire, then registrations and finishes slot by slot, then each slot's merged signals), with time counted
    in steps on both: same batches and counts at every step, same state after every call."""

    def __init__(self) -> None:
        super().__init__()
        self.registry, metrics = make_metrics("step")
        self.reference_registry, reference_metrics = make_metrics("immediate")
        self.step_clock, self.clock = FakeClock(0.0), FakeClock(0.0)
        self.buf = StepAlignedSignalBuffer(metrics=metrics, clock=self.step_clock, ttl_steps=TTL_STEPS,
                                           max_pending=MAX_PENDING, max_slots=MAX_SLOTS)
        self.recovered: list[ReadySignal] = []  # the reference's recoveries, with their waits
        self.reference = EarlySignalBuffer(metrics=reference_metrics, clock=self.clock, ttl_s=TTL_STEPS,
                                           max_pending=MAX_PENDING, max_slots=MAX_SLOTS,
                                           on_recovered=self.recovered.append)
        self.calls: list[tuple[int, int | None]] = []  # this step's registrations (need) and finishes (None)
        self.signals: dict[int, list[int]] = {}  # slot -> [layer0 tokens, furthest (tokens, layer) of layers > 0]
        self.refused_when_recorded = 0  # calls beyond the step record: refused by the step buffer alone
        self.overflow_when_recorded = 0  # slots beyond max_pending signalling in one step: the same
        self.staged: set[int] = set()  # the slots the step buffer keeps signals of this step

    @rule(slot=FEW_SLOTS, layer=st.integers(0, 3), tokens=st.integers(0, 5))
    def signal(self, slot, layer, tokens):
        self.buf.signal(slot, layer, tokens)
        self._model_signal(slot, layer, tokens)

    @rule(layer=st.integers(0, 1), batch=st.lists(st.tuples(FEW_SLOTS, st.integers(0, 5)), max_size=4))
    def signal_batch(self, layer, batch):
        self.buf.signal_batch(layer, [s for s, _ in batch], [t for _, t in batch])
        for slot, tokens in batch:
            self._model_signal(slot, layer, tokens)

    def _model_signal(self, slot: int, layer: int, tokens: int) -> None:
        if slot not in self.staged:  # a full step record keeps the lowest slots: one overflow per call beyond
            if len(self.staged) >= MAX_PENDING:
                self.overflow_when_recorded += 1
                if slot > max(self.staged):
                    return
                self.staged.remove(max(self.staged))
            self.staged.add(slot)
        merged = self.signals.setdefault(slot, [-1, (-1, -1)])
        if layer == 0:
            merged[0] = max(merged[0], tokens)
        else:
            merged[1] = max(merged[1], (tokens, layer))

    @rule(slot=FEW_SLOTS, need=st.integers(0, 5))
    def register(self, slot, need):
        own = [n for s, n in self.calls if s == slot]
        if own[-1] is not None if own else slot in self.buf.registered_slots():
            with pytest.raises(ValueError, match="already registered"):
                self.buf.register(slot, need)
        else:
            self._record(slot, need, self.buf.register)

    @rule(slot=FEW_SLOTS)
    def finish(self, slot):
        self._record(slot, None, lambda s, _: self.buf.finish(s))

    def _record(self, slot: int, need: int | None, call) -> None:
        if len(self.calls) >= 2 * MAX_SLOTS:
            self.refused_when_recorded += 1
            with pytest.raises(SignalBufferFull):
                call(slot, need)
        else:
            call(slot, need)
            self.calls.append((slot, need))

    @rule()
    def end_step(self):
        self.step_clock.advance(1.0)
        self.clock.advance(1.0)
        batch = self.buf.end_step()
        ref = self.reference
        ref.expire()
        for slot, need in sorted(self.calls, key=lambda call: call[0]):  # stable: arrival order within a slot
            if need is None:
                ref.finish(slot)
            else:
                try:
                    assert ref.register(slot, need) is None  # a recovery goes to self.recovered
                except SignalBufferFull:
                    pass
        expected, self.recovered[:] = list(self.recovered), []
        for slot in sorted(self.staged):
            layer0, (tokens, layer) = self.signals[slot]
            if layer > 0:
                ref.signal(slot, layer, tokens)
            if layer0 >= 0 and ref.signal(slot, 0, layer0):
                expected.append(ReadySignal(slot, 0, layer0, 0.0))
        assert batch == expected
        self.calls, self.signals, self.staged = [], {}, set()
        step, immediate = counts(self.registry, "step"), counts(self.reference_registry, "immediate")
        immediate["refused"] += self.refused_when_recorded
        immediate["overflow"] += self.overflow_when_recorded
        assert step == immediate

    @invariant()
    def same_state(self):
        assert self.buf.registered_slots() == self.reference.registered_slots()
        assert self.buf.pending_count == self.reference.pending_count
        for slot in self.reference.registered_slots():
            assert self.buf.progress(slot) == self.reference.progress(slot)


StepAlignedAgainstImmediate.TestCase.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
TestStepAlignedAgainstImmediate = StepAlignedAgainstImmediate.TestCase
