"""The parts a ``quire.Checkpointer`` holds, each tested on its own (no Checkpointer): the
step ledger (a state machine against a model of sets), the background tasks on quire's
loop, the save decision, and retention on a real memory:// root."""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import quire
from quire._checkpointer.background import BackgroundTasks
from quire._checkpointer.deciding import SaveDecider, preempted
from quire._checkpointer.ledger import StepLedger
from quire._checkpointer.retain import Retention
from quire._format import root as _root
from quire._runtime import ioloop as _io
from quire._store.url import open_backend
from quire.policies import EveryNSteps, LatestN, OnPreemption, SaveContext, SavePolicy, StepInfo

pytestmark = pytest.mark.quick  # the quick tier (CONTRIBUTING.md)

STEPS = st.integers(0, 5)  # few steps: pins, deletions and saves meet often


# ============================================================================= ledger
class LedgerMachine(RuleBasedStateMachine):
    """The ledger against a model: sets of committed / deleting steps, pin counts, the
    step in flight, and the rules of ``choose_victims`` written out again here."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = StepLedger()
        self.committed: set[int] = set()
        self.read: set[int] = set()  # committed steps whose info the ledger has
        self.deleting: set[int] = set()
        self.pins: collections.Counter[int] = collections.Counter()
        self.inflight: int | None = None
        self.deferred = False

    def live(self) -> set[int]:
        return self.committed - self.deleting

    @rule(step=STEPS)
    def start(self, step: int) -> None:
        self.ledger.start(step)
        self.inflight = step

    @rule(step=STEPS)
    def commit(self, step: int) -> None:
        self.ledger.start(step)
        self.ledger.committed(StepInfo(step, 0.0))
        self.committed.add(step)
        self.read.add(step)
        self.inflight = None

    @rule()
    def abandon(self) -> None:
        self.ledger.abandoned()
        self.inflight = None

    @rule(found=st.sets(STEPS))
    def relist(self, found: set[int]) -> None:
        self.ledger.replace(found)
        self.committed = set(found)
        self.read &= found

    @rule(step=st.none() | STEPS)
    def pin(self, step: int | None) -> None:
        got, deleting = self.ledger.pin(step)
        want = step if step is not None else max(self.live(), default=None)
        assert got == want
        assert deleting == (want is not None and want in self.deleting)
        if want is not None:
            self.pins[want] += 1

    @precondition(lambda self: bool(self.pins))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(self.pins)))
        self.pins[step] -= 1
        if not self.pins[step]:
            del self.pins[step]
        due = self.deferred and not self.pins
        if due:
            self.deferred = False
        assert self.ledger.unpin(step) == due

    @rule(keep=st.sets(STEPS))
    def choose(self, keep: set[int]) -> None:
        seen: list[set[int]] = []

        def policy(infos: list[StepInfo]) -> set[int]:
            seen.append({i.step for i in infos})
            return keep

        victims = self.ledger.choose_victims(policy)
        live = self.live()
        if not live:
            assert victims == [] and not seen
            return
        assert seen == [live & self.read]  # the policy sees the live steps it has infos of
        kept = keep | {max(live)} | ({self.inflight} if self.inflight is not None else set())
        out = live - kept
        self.deferred = any(self.pins[s] for s in out)
        want = sorted(s for s in out if not self.pins[s])
        assert victims == want
        assert max(live) not in victims and self.inflight not in victims
        self.deleting |= set(victims)

    @precondition(lambda self: bool(self.deleting))
    @rule(data=st.data(), failed=st.booleans())
    def finish_deletion(self, data: st.DataObject, failed: bool) -> None:
        step = data.draw(st.sampled_from(sorted(self.deleting)))
        self.deleting.discard(step)
        if failed:
            self.ledger.kept(step)
        else:
            self.ledger.deleted(step)
            self.committed.discard(step)
            self.read.discard(step)

    @invariant()
    def agrees(self) -> None:
        live = self.live()
        assert self.ledger.live() == sorted(live)
        assert self.ledger.latest() == max(live, default=None)
        floor = [s for s in (max(live, default=None), self.inflight) if s is not None]
        assert self.ledger.floor() == max(floor, default=None)
        protected = self.deleting | {s for s, n in self.pins.items() if n}
        if self.inflight is not None:
            protected.add(self.inflight)
        assert self.ledger.protected() == protected
        assert {i.step for i in self.ledger.infos()} == live & self.read


TestLedger = LedgerMachine.TestCase
TestLedger.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_ledger_fill_reads_missing_infos_and_drops_vanished_steps() -> None:
    ledger = StepLedger()
    ledger.replace([1, 2, 3])
    ledger.committed(StepInfo(3, 3.0, {"loss": 0.5}))
    asked: list[int] = []

    async def read(step: int) -> StepInfo | None:
        asked.append(step)
        return None if step == 2 else StepInfo(step, float(step))  # 2: deleted by another

    asyncio.run(ledger.fill(read))
    assert sorted(asked) == [1, 2]  # 3's info was known
    assert ledger.live() == [1, 3]
    assert [(i.step, dict(i.metrics)) for i in ledger.infos()] == [(1, {}), (3, {"loss": 0.5})]


# ============================================================================= tasks
def test_background_errors_are_kept_until_asked_for_then_raised_once() -> None:
    tasks = BackgroundTasks("memory://parts")

    async def fail(msg: str) -> None:
        raise OSError(msg)

    futs = [tasks.spawn(fail("first")), tasks.spawn(fail("second"))]
    for f in futs:
        with pytest.raises(OSError):
            f.result(10)
    tasks.drain()
    with pytest.raises(OSError) as got:
        tasks.raise_errors()
    assert str(got.value) in {"first", "second"}
    notes = getattr(got.value, "__notes__", [])
    assert len(notes) == 1 and "another background task failed too" in notes[0]
    tasks.raise_errors()  # reported once


def test_scheduled_tasks_run_in_order_one_at_a_time_even_after_a_failure() -> None:
    tasks = BackgroundTasks("memory://parts")
    log: list[tuple[str, int]] = []

    def make(i: int) -> Any:
        async def run() -> None:
            log.append(("start", i))
            await asyncio.sleep(0.01 * (3 - i % 3))  # later tasks are quicker
            log.append(("end", i))
            if i == 1:
                raise ValueError("task 1")

        return run

    for i in range(5):
        tasks.schedule(make(i))
    tasks.drain()
    assert log == [(k, i) for i in range(5) for k in ("start", "end")]
    with pytest.raises(ValueError, match="task 1"):
        tasks.raise_errors()


def test_wait_save_waits_for_the_save_and_drain_for_tasks_started_by_tasks() -> None:
    tasks = BackgroundTasks("memory://parts")
    done: list[str] = []

    async def save() -> None:
        await asyncio.sleep(0.05)
        done.append("save")

    async def child() -> None:
        await asyncio.sleep(0.05)
        done.append("child")

    async def parent() -> None:
        tasks.spawn(child())  # from the loop's thread
        done.append("parent")

    tasks.start_save(save())
    tasks.wait_save()
    assert done == ["save"]
    tasks.spawn(parent())
    tasks.drain()
    assert done == ["save", "parent", "child"]
    assert BackgroundTasks.run(asyncio.sleep(0, result=7)) == 7


# ============================================================================= deciding
class Recording(SavePolicy):
    def __init__(self, answer: bool) -> None:
        self.answer, self.seen = answer, []

    def should_save(self, ctx: SaveContext) -> bool:
        self.seen.append(ctx)
        return self.answer


def test_decider_floors_and_the_answer_without_a_policy() -> None:
    d = SaveDecider(None, 4, without_policy=True, follow_primary=True)
    assert not d.due(4) and not d.due(3)  # at or below the last saved step
    assert d.due(5) and not d.due(5, 5) and not d.due(5, None, 7) and d.due(8, None, 7)
    local = SaveDecider(None, None, without_policy=False, follow_primary=False)
    assert not local.due(100)  # a local tier without a policy never asks to save


def test_decider_shows_the_policy_its_last_save() -> None:
    p = Recording(True)
    d = SaveDecider(p, 2, without_policy=True, follow_primary=True)
    t0 = time.monotonic()
    assert d.due(3, 1)
    assert p.seen[-1].last_saved_step == 2 and p.seen[-1].step == 3
    d.saved(3)
    assert not d.due(3)  # never at the last saved step, whatever the policy says
    assert d.due(10)
    assert p.seen[-1].last_saved_step == 3 and p.seen[-1].last_save_time >= t0
    p.answer = False
    assert not d.due(11)
    steps = SaveDecider(EveryNSteps(5), None, without_policy=True, follow_primary=True)
    assert [s for s in range(1, 12) if steps.due(s)] == [5, 10]


def test_preempted_looks_inside_combined_policies() -> None:
    notice = OnPreemption()
    assert not preempted([None, EveryNSteps(3) | notice])
    notice.notify()
    assert preempted([None, EveryNSteps(3) | notice])
    assert preempted([notice, None]) and not preempted([EveryNSteps(3), None])


# ============================================================================= retention
def _root_with_steps(steps: list[int]) -> tuple[str, Any, _root.StepFormat]:
    root = f"memory://quire-parts/{uuid.uuid4().hex}"
    fmt = _root.StepFormat(_root.DEFAULT_STEP_FORMAT)
    for s in steps:
        quire.save(f"{root}/{fmt.name(s)}", {"x": np.full(3, s, np.float32)})
    return root, open_backend(root), fmt


def _records(backend: Any, fmt: _root.StepFormat) -> list[int]:
    return sorted(_io.submit(_root.committed_steps(backend, fmt)).result())


@pytest.mark.parametrize("maintainer", [True, False])
def test_retention_deletes_what_the_policy_leaves_out(maintainer: bool) -> None:
    root, backend, fmt = _root_with_steps([1, 2, 3, 4, 5])
    ledger = StepLedger()
    ledger.replace(_records(backend, fmt))
    keep = Retention(
        backend, root, fmt, ledger, LatestN(2), None, maintainer=maintainer, incremental=False
    )
    ledger.pin(1)  # being loaded
    _io.submit(keep.retain()).result()
    assert ledger.live() == [1, 4, 5]
    # only the maintainer deletes; the others just forget the steps
    assert _records(backend, fmt) == ([1, 4, 5] if maintainer else [1, 2, 3, 4, 5])
    assert ledger.unpin(1)  # the deletion deferred for the pinned step is due now
    _io.submit(keep.retain()).result()
    assert ledger.live() == [4, 5]
    assert _records(backend, fmt) == ([4, 5] if maintainer else [1, 2, 3, 4, 5])


def test_retention_collects_garbage_after_the_first_commit_only_as_maintainer() -> None:
    root, backend, fmt = _root_with_steps([1])

    def orphan(step: int) -> str:  # an uncommitted step's data
        key = f"{fmt.name(step)}/d/abc/x"
        _io.submit(backend.put(key, [b"bytes"])).result()
        return key

    def exists(key: str) -> bool:
        return bool(_io.submit(backend.exists(key)).result())

    def retention(keep: Any, maintainer: bool) -> Retention:
        ledger = StepLedger()
        ledger.replace([1])
        return Retention(
            backend, root, fmt, ledger, keep, 0.0, maintainer=maintainer, incremental=False
        )

    first = orphan(2)
    time.sleep(0.01)  # older than the grace period of 0 s
    other = retention(None, maintainer=False)
    assert _io.submit(other.after_commit()).result() is False  # no keep policy to run
    assert exists(first)
    keep = retention(LatestN(1), maintainer=True)
    assert _io.submit(keep.after_commit()).result() is True
    assert not exists(first)
    second = orphan(3)
    time.sleep(0.01)
    assert _io.submit(keep.after_commit()).result() is True
    assert exists(second)  # once: a later save never races a collection
