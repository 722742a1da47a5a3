"""The restore decision (``quire._tiers.restore_plan.plan_restore``), in one process.

The views of N processes are generated from a world: which processes lost their directory,
which record each one holds of each step (none: never committed there, or damaged; two
records of one step: an overwrite that did not land everywhere), which owners' objects each
holds whole, what each lists of the persistent tier (ahead of the local tier or behind it),
and which step each asked for.  The oracle reads the world, not the code's helpers: the step
chosen is the newest one every process can restore (for one record, every owner's objects
held by some process; or the persistent tier, as the primary lists it, has it), or the one
asked for when it is restorable; every process computes it alike, whatever the order of the
entries in the views it received; processes that asked for steps that do not resolve to one
all get the same ``QuireError``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given
from props_budget import examples

from quire._tiers.restore_plan import PERSISTENT_SOURCE, parse_view, plan_restore, sources, view
from quire.errors import MultiProcessError, QuireError


@dataclass
class World:
    n: int
    primary: int
    records: list[dict[int, str]]  # process -> step -> the record (digest) it holds
    held: list[dict[int, set[int]]]  # process -> step -> owners whose objects it holds whole
    need: dict[tuple[int, str], set[int]]  # (step, record) -> its owners
    persistent: list[set[int]]  # process -> the persistent steps it lists
    wants: list[int | None]

    def views(self) -> list[dict[str, Any]]:
        out = []
        for p in range(self.n):
            steps = {
                str(s): {"d": d, "need": sorted(self.need[s, d]), "held": sorted(self.held[p][s])}
                for s, d in self.records[p].items()
            }
            out.append(view(self.wants[p], sorted(self.persistent[p]), steps))
        return out

    # ------------------------------------------------------------------ the oracle
    def whole(self, s: int) -> set[str]:
        """The records of step ``s`` whose every owner's objects some process holds."""
        out = set()
        for d in {r[s] for r in self.records if s in r}:
            held: set[int] = set()
            for p in range(self.n):
                if self.records[p].get(s) == d:
                    held |= self.held[p][s]
            if self.need[s, d] <= held:
                out.add(d)
        return out

    def restorable(self, s: int) -> bool:
        return bool(self.whole(s)) or s in self.persistent[self.primary]

    def newest(self) -> int | None:
        listed = {s for r in self.records for s in r} | self.persistent[self.primary]
        return max((s for s in listed if self.restorable(s)), default=None)


@st.composite
def worlds(draw: st.DrawFn) -> World:
    n = draw(st.integers(1, 5))
    primary = draw(st.integers(0, n - 1))
    procs = st.sets(st.integers(0, n - 1))
    steps = draw(st.lists(st.integers(1, 12), max_size=5, unique=True))
    lost = draw(procs)  # their local directory is gone: they hold and list nothing
    need: dict[tuple[int, str], set[int]] = {}
    for s in steps:
        for d in ("a", "b"):
            need[s, d] = draw(procs) | {primary}
    records: list[dict[int, str]] = [{} for _ in range(n)]
    held: list[dict[int, set[int]]] = [{} for _ in range(n)]
    # a split step: an overwrite that landed on some processes only (records "a" and "b")
    split = {s: draw(st.booleans()) for s in steps}
    for p in range(n):
        for s in steps:
            if p in lost:
                continue
            # none: killed before its commit there, or its record damaged
            d = draw(st.sampled_from(["a", "b", None] if split[s] else ["a", "a", None]))
            if d is not None:
                records[p][s] = d
                held[p][s] = draw(st.sets(st.sampled_from(sorted(need[s, d]))))
    # the persistent tier: some local steps promoted, maybe steps ahead or behind them
    promoted = st.sets(st.sampled_from(steps)) if steps else st.just(set())
    persistent = [draw(promoted) | draw(st.sets(st.integers(0, 14), max_size=2)) for _ in range(n)]
    if draw(st.booleans()):  # the usual case: every process lists the same
        persistent = [persistent[primary]] * n
    asked = st.none() | st.integers(0, 14)
    wants = [draw(asked)] * n if draw(st.booleans()) else [draw(asked) for _ in range(n)]
    return World(n, primary, records, held, need, persistent, wants)


def shuffled(views: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
    """The same views with every dict and list in another order, as JSON carries them."""
    out = []
    for v in json.loads(json.dumps(views)):
        items = list(v["steps"].items())
        rng.shuffle(items)
        for _, info in items:
            rng.shuffle(info["need"])
            rng.shuffle(info["held"])
        rng.shuffle(v["persistent"])
        keys = list(v)
        rng.shuffle(keys)
        out.append({k: dict(items) if k == "steps" else v[k] for k in keys})
    return out


def outcome(views: list[dict[str, Any]], primary: int) -> Any:
    try:
        plan = plan_restore(views, primary, "memory://root")
    except QuireError as e:
        return ("error", str(e))
    if plan is None:
        return None
    src = sources(plan.views, plan.step, plan.digest) if plan.digest is not None else {}
    return (plan.step, plan.digest, src)


def check(w: World, views: list[dict[str, Any]], want: int | None, got: Any) -> None:
    """``got``: the outcome when every process asked for ``want``."""
    step = w.newest() if want is None else want
    if step is None or not w.restorable(step):
        assert got is None, got
        return
    assert got is not None and got[0] == step, (got, step)
    _, digest, src = got
    if not w.whole(step):  # the persistent tier's record, which the primary lists
        assert digest is None and step in w.persistent[w.primary], got
        return
    # one record whole (the local tier first): each owner's objects from a process
    # holding them with that record
    assert digest in w.whole(step), got
    assert sorted(src) == sorted(w.need[step, digest])
    for j, who in src.items():
        assert who != PERSISTENT_SOURCE
        assert w.records[who].get(step) == digest and j in w.held[who][step]


@examples(300)
@given(worlds(), st.randoms(use_true_random=False))
def test_the_newest_step_every_process_can_restore(w: World, rng: random.Random) -> None:
    views = w.views()
    got = outcome(views, w.primary)
    # every process decides alike, whatever order its copy of the views has
    for _ in range(w.n):
        assert outcome(shuffled(views, rng), w.primary) == got
    newest = w.newest()
    chosen = {newest if want is None else want for want in w.wants}
    if len(chosen) > 1:
        assert got is not None and got[0] == "error", got
        assert "disagree on the step of memory://root" in got[1]
    else:
        check(w, views, None if None in w.wants else w.wants[0], got)
    # every step any tier lists, asked for by every process
    listed = {s for r in w.records for s in r} | w.persistent[w.primary]
    for want in [*sorted(listed), None]:
        for v in views:
            v["want"] = want
        check(w, views, want, outcome(views, w.primary))


def holds(steps: dict[int, tuple[str, list[int], list[int]]]) -> dict[str, Any]:
    return {str(s): {"d": d, "need": n, "held": h} for s, (d, n, h) in steps.items()}


def test_a_persistent_tier_ahead_of_or_behind_the_local_one() -> None:
    whole = holds({10: ("a", [0, 1], [0, 1])})
    ahead = [view(None, [8, 12], whole), view(None, [8, 12], whole)]
    plan = plan_restore(ahead, 0, "r")
    assert plan is not None and (plan.step, plan.digest) == (12, None)
    behind = [view(None, [8], whole), view(None, [8], whole)]
    plan = plan_restore(behind, 0, "r")
    assert plan is not None and (plan.step, plan.digest) == (10, "a")


def test_the_primary_lists_the_persistent_tier() -> None:
    # process 1 has not listed step 9 yet (or lists one the primary deleted): the primary's
    # listing counts, so every process restores the same step
    views = [view(None, [5, 9]), view(None, [5, 7])]
    plan = plan_restore(views, 0, "r")
    assert plan is not None and (plan.step, plan.digest) == (9, None)
    plan = plan_restore(views, 1, "r")
    assert plan is not None and plan.step == 7


def test_of_two_records_of_a_step_the_whole_one() -> None:
    # an overwrite of step 3 landed on processes 1 and 2 only: record "b" is whole there,
    # record "a" (process 0's) lacks owner 1
    views = [
        view(None, [], holds({3: ("a", [0, 1], [0])})),
        view(None, [], holds({3: ("b", [0, 1], [1])})),
        view(None, [], holds({3: ("b", [0, 1], [0])})),
    ]
    plan = plan_restore(views, 0, "r")
    assert plan is not None and (plan.step, plan.digest) == (3, "b")
    assert sources(views, 3, "b") == {0: 2, 1: 1}


def test_a_damaged_record_on_one_process_leaves_the_others_holders() -> None:
    # process 1's record of step 4 is damaged: its view omits the step; process 2 holds
    # owner 1's objects, so the step is still whole
    views = [
        view(None, [], holds({4: ("a", [0, 1, 2], [0, 2])})),
        view(None, [], {}),
        view(None, [], holds({4: ("a", [0, 1, 2], [2, 1])})),
    ]
    plan = plan_restore(views, 0, "r")
    assert plan is not None and (plan.step, plan.digest) == (4, "a")
    assert sources(views, 4, "a") == {0: 0, 1: 2, 2: 2}


@pytest.mark.parametrize(
    ("wants", "agreed"),
    [
        ([None, None], 6),  # the newest
        ([6, None], 6),  # explicit here, the newest there: the same step
        ([4, 4], 4),
        ([4, 6], None),
        ([None, 4], None),
        ([9, 9], "nothing"),  # asked for a step no tier lists: nothing agreed, no error
    ],
)
def test_processes_must_ask_for_one_step(wants: list[int | None], agreed: Any) -> None:
    steps = holds({4: ("a", [0], [0]), 6: ("b", [0], [0])})
    views = [view(wants[0], [], steps), view(wants[1], [], {})]
    if agreed is None:
        with pytest.raises(QuireError, match="disagree on the step of r to restore") as e:
            plan_restore(views, 0, "r")
        assert "process 0 asked for" in str(e.value) and "process 1 asked for" in str(e.value)
        return
    plan = plan_restore(views, 0, "r")
    if agreed == "nothing":
        assert plan is None
    else:
        assert plan is not None and plan.step == agreed


def test_the_step_a_process_asks_for_is_checked_as_published() -> None:
    for want in (None, 0, 7):
        good = view(want, [3], holds({4: ("a", [0, 1], [1])}))
        assert parse_view(json.dumps(good).encode(), 1, 2) == good
    for bad in ("7", -1, True, 1.5, [7]):
        raw = json.dumps(view(bad, [], {})).encode()  # type: ignore[arg-type]
        with pytest.raises(MultiProcessError, match="process 1 published a malformed view"):
            parse_view(raw, 1, 2)


def test_a_view_that_asks_nothing_follows_the_others() -> None:
    # a view found malformed is replaced by one holding nothing, which asks for nothing
    steps = holds({4: ("a", [0], [0]), 6: ("b", [0], [0])})
    views = [view(4, [], steps), {"steps": {}, "persistent": []}, view(4, [], {})]
    plan = plan_restore(views, 0, "r")
    assert plan is not None and plan.step == 4
