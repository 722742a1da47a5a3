"""A stateful test of ``quire.Checkpointer`` (issue 29): saves, ``should_save``, retention,
restarts, overwrites, partial saves, incremental steps and gc in an order Hypothesis draws,
against a model that knows the policies' rules but none of quire's code.

The model (``Model``) holds the committed steps with the values and metrics saved at each,
the steps this Checkpointer has saved or started, and the partial-save journals.  It
answers ``should_save`` (a step above every committed or started one, and the save policy
says yes: ``EveryNSteps``, ``SpecificSteps``) and runs retention after each commit with its
own reading of the keep policies (``LatestN``; ``BestN``: steps without the metric or with
NaN never kept by it, ties to the later step; ``KeepEveryNSteps``; the latest step always
kept).  After every rule:

* the Checkpointer lists exactly the model's committed steps (retention kept exactly what
  the policies say);
* every committed step loads bit for bit, and ``quire.verify`` passes (so no gc, retention
  or overwrite removed a byte a committed step needs; incremental roots borrow bytes from
  earlier steps, which is where that could go wrong);
* every partial-save journal still loads its latest version.

A gc with the default grace period runs while a save is in flight (from another
Checkpointer on the root, as another process would); the save then commits and loads, so
gc spared the bytes the in-flight save needs (its txid is young; an incremental save's
lease protects what it borrows).  A gc with no grace period runs only when nothing is in
flight (no grace means no protection, by design).

Budget: ``ci``: a fixed handful of sequences (``props_budget``); ``deep``: the profile's.
"""

from __future__ import annotations

import math
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from props_budget import examples

import quire
from quire.policies import BestN, EveryNSteps, KeepEveryNSteps, LatestN, SpecificSteps

SHAPE = (8, 16)
FROZEN = 3  # leaves that keep their value (and, while they are not restarted, their object)


def value(seed: int) -> np.ndarray:
    """A leaf's value: random bits of float32 (NaN payloads included)."""
    raw = np.random.default_rng(seed).integers(0, 2**32, math.prod(SHAPE), dtype=np.uint32)
    return raw.view(np.float32).reshape(SHAPE)


@dataclass
class Saved:
    """What a committed step holds: the seed of every leaf, and its metrics."""

    seeds: dict[str, int]
    metrics: dict[str, Any] | None


# ------------------------------------------------------------------------------ the policies
# Each policy is drawn as plain data; ``build_*`` makes quire's object, ``Model`` reads the
# data itself.
SAVE_POLICIES = st.sampled_from(
    [None, ("every", 2), ("every", 3), ("specific", (1, 2, 4, 7, 8, 12, 13)), ("every|specific", 4)]
)
KEEP_ONE = st.one_of(
    st.tuples(st.just("latest"), st.integers(1, 3)),
    st.tuples(st.just("best"), st.integers(1, 2), st.sampled_from(["max", "min"])),
    st.tuples(st.just("every"), st.integers(2, 4)),
)
KEEP_POLICIES = st.none() | st.lists(KEEP_ONE, min_size=1, max_size=3)
METRICS = st.none() | st.sampled_from([0.5, 0.25, 1.0, 0.5, 2.0, math.nan]).map(
    lambda v: {"loss": v}
)


def build_save(spec: Any) -> Any:
    if spec is None:
        return None
    kind, arg = spec
    if kind == "every":
        return EveryNSteps(arg)
    if kind == "specific":
        return SpecificSteps(arg)
    return EveryNSteps(arg) | SpecificSteps([1, 3])


def build_keep(specs: list[Any] | None) -> Any:
    if specs is None:
        return None
    out = None
    for s in specs:
        p = (
            LatestN(s[1])
            if s[0] == "latest"
            else BestN(s[1], metric="loss", mode=s[2])
            if s[0] == "best"
            else KeepEveryNSteps(s[1])
        )
        out = p if out is None else out | p
    return out


@dataclass
class Model:
    save_spec: Any
    keep_specs: list[Any] | None
    committed: dict[int, Saved] = field(default_factory=dict)
    started: int | None = None  # the highest step this Checkpointer saved (or was opened at)

    def policy_says(self, step: int) -> bool:
        if self.save_spec is None:
            return True
        kind, arg = self.save_spec
        if kind == "every":
            return step % arg == 0
        if kind == "specific":
            return step in arg
        return step % arg == 0 or step in (1, 3)

    def should_save(self, step: int) -> bool:
        seen = [s for s in (max(self.committed, default=None), self.started) if s is not None]
        if seen and step <= max(seen):
            return False
        return self.policy_says(step)

    def retain(self) -> None:
        """The keep policies after a commit, as documented (docs/checkpointer.md)."""
        if self.keep_specs is None or not self.committed:
            return
        live = sorted(self.committed)
        keep = {live[-1]}
        for s in self.keep_specs:
            if s[0] == "latest":
                keep |= set(live[-s[1] :])
            elif s[0] == "every":
                keep |= {x for x in live if x % s[1] == 0}
            else:
                scored = []
                for x in live:
                    v = (self.committed[x].metrics or {}).get("loss")
                    if v is not None and not math.isnan(v):
                        scored.append((v, x))
                sign = -1.0 if s[2] == "max" else 1.0
                scored.sort(key=lambda vx: (sign * vx[0], -vx[1]))
                keep |= {x for _, x in scored[: s[1]]}
        for x in live:
            if x not in keep:
                del self.committed[x]
                event("retention deleted a step")


# ------------------------------------------------------------------------------ the machine
class CheckpointerMachine(RuleBasedStateMachine):
    base: Path  # set per module from pytest's temporary directory

    @initialize(save=SAVE_POLICIES, keep=KEEP_POLICIES, incremental=st.booleans())
    def open(self, save: Any, keep: list[Any] | None, incremental: bool) -> None:
        self.dir = self.base / uuid.uuid4().hex[:12]
        self.root = self.dir / "root"
        self.model = Model(save, keep)
        self.incremental = incremental
        self.step = 0
        self.partials: dict[int, dict[str, int]] = {}  # step -> leaf -> seed
        self.seeds = {f"frozen{i}": 1000 + i for i in range(FROZEN)}
        self.objects: dict[str, Any] = {}  # the jax.Arrays handed to the last save
        self.ck = self._open()

    def _open(self) -> quire.Checkpointer:
        event(
            f"incremental={self.incremental} save={self.model.save_spec} keep={self.model.keep_specs is not None}"
        )
        return quire.Checkpointer(
            self.root,
            save_policy=build_save(self.model.save_spec),
            keep=build_keep(self.model.keep_specs),
            incremental=self.incremental,
            gc_grace_period=None,
        )

    def _tree(self, change: int) -> dict[str, Any]:
        """The tree of a new step: ``change`` leaves get new values, the rest keep theirs
        (as the very jax.Array saved last time, which an incremental save carries)."""
        self.seeds["step"] = self.step * 7919 + 1
        for i in range(min(change, FROZEN)):
            self.seeds[f"frozen{i}"] = self.step * 31 + i
        tree: dict[str, Any] = {}
        for k, seed in self.seeds.items():
            prev = self.objects.get(k)
            if prev is not None and prev[0] == seed:
                tree[k] = prev[1]
            else:
                arr = jnp.asarray(value(seed))
                self.objects[k] = (seed, arr)
                tree[k] = arr
        tree["n"] = self.step
        return tree

    def _saved(self, metrics: dict[str, Any] | None) -> Saved:
        return Saved(dict(self.seeds), metrics)

    # -------------------------------------------------------------------------- rules
    def _advance(self, gap: int) -> None:
        """``gap`` > 0: that many steps on; 0: on to the next step the model says is due."""
        if gap:
            self.step += gap
            return
        nxt = self.step + 1
        while not self.model.should_save(nxt) and nxt < self.step + 16:
            nxt += 1
        self.step = nxt

    @rule(gap=st.integers(0, 3), change=st.integers(0, FROZEN), metrics=METRICS)
    def save(self, gap: int, change: int, metrics: dict[str, Any] | None) -> None:
        self._advance(gap)
        want = self.model.should_save(self.step)
        assert self.ck.should_save(self.step) is want, (self.step, self.model)
        tree = self._tree(change)
        assert self.ck.save(self.step, tree, metrics=metrics) is want
        self.ck.wait()
        event(f"save: {'saved' if want else 'not due'}")
        if want:
            self.model.started = self.step
            self.model.committed[self.step] = self._saved(metrics)
            self.model.retain()

    @rule(gap=st.integers(0, 2), change=st.integers(0, FROZEN))
    def save_then_load_at_once(self, gap: int, change: int) -> None:
        """While a save is in flight: its step is not due again, and ``load()`` waits for
        it and returns it (the latest step)."""
        self._advance(gap)
        want = self.model.should_save(self.step)
        tree = self._tree(change)
        assert self.ck.save(self.step, tree) is want
        if want:
            assert self.ck.should_save(self.step) is False
            got = self.ck.load()
            for k, seed in self.seeds.items():
                assert np.asarray(got[k]).tobytes() == value(seed).tobytes(), k
        self.ck.wait()
        if want:
            self.model.started = self.step
            self.model.committed[self.step] = self._saved(None)
            self.model.retain()

    @precondition(lambda self: bool(self.model.committed))
    @rule(data=st.data(), metrics=METRICS)
    def overwrite(self, data: st.DataObject, metrics: dict[str, Any] | None) -> None:
        """``force=True`` replaces a committed step (any, not only the latest)."""
        step = data.draw(st.sampled_from(sorted(self.model.committed)))
        self.seeds["step"] = step * 7919 + 2
        tree = self._tree(1)
        assert self.ck.save(step, tree, metrics=metrics, force=True) is True
        self.ck.wait()
        self.model.started = max(step, self.model.started or step)
        self.model.committed[step] = self._saved(metrics)
        self.model.retain()

    @rule()
    def restart(self) -> None:
        """A new Checkpointer on the same root: a restarted run (new arrays too)."""
        self.ck.close()
        self.objects.clear()
        self.ck = self._open()
        self.model.started = max(self.model.committed, default=None)

    @rule(gap=st.integers(1, 2), finalize=st.booleans())
    def partial_save(self, gap: int, finalize: bool) -> None:
        """A step written with quire.partial under the root: listed by nobody until it is
        finalized (then, after ``reload``, an ordinary committed step)."""
        self.step += gap
        url = self.root / f"step_{self.step:08d}"
        seeds = {"p": self.step * 13 + 5}
        quire.partial.save(url, {"p": value(seeds["p"])})
        if finalize:
            quire.partial.finalize(url)
            self.ck.reload()
            self.model.committed[self.step] = Saved(seeds, None)
        else:
            self.partials[self.step] = seeds

    @rule()
    def gc_now(self) -> None:
        """gc with no grace period, nothing in flight: only garbage may go."""
        self.ck.gc(0)

    @rule(gap=st.integers(0, 2), change=st.integers(0, FROZEN))
    def gc_while_saving(self, gap: int, change: int) -> None:
        """Another Checkpointer's gc (default grace period) while this one's save is in
        flight: the save still commits whole."""
        self._advance(gap)
        want = self.model.should_save(self.step)
        tree = self._tree(change)
        assert self.ck.save(self.step, tree) is want
        other = quire.Checkpointer(self.root, gc_grace_period=None)
        try:
            other.gc()
        finally:
            other.close()
        self.ck.wait()
        event(f"gc while saving: {'saved' if want else 'not due'}")
        if want:
            self.model.started = self.step
            self.model.committed[self.step] = self._saved(None)
            self.model.retain()

    # -------------------------------------------------------------------------- invariants
    @invariant()
    def lists_exactly_what_the_policies_keep(self) -> None:
        if hasattr(self, "ck"):
            assert self.ck.steps() == sorted(self.model.committed), self.model

    @invariant()
    def every_committed_step_loads_bit_for_bit(self) -> None:
        if not hasattr(self, "ck"):
            return
        latest = self.ck.latest_step()
        assert latest == max(self.model.committed, default=None)
        for step, saved in self.model.committed.items():
            got = self.ck.load(step)
            for k, seed in saved.seeds.items():
                assert np.asarray(got[k]).tobytes() == value(seed).tobytes(), (step, k)
            if saved.metrics is not None and not math.isnan(saved.metrics["loss"]):
                assert self.ck.metrics(step) == saved.metrics, step
            report = quire.verify(str(self.root / f"step_{step:08d}"))
            assert not report.problems, (step, report.problems)

    @invariant()
    def partial_saves_stay(self) -> None:
        for step, seeds in getattr(self, "partials", {}).items():
            got = quire.partial.load(self.root / f"step_{step:08d}")
            assert np.asarray(got["p"]).tobytes() == value(seeds["p"]).tobytes(), step

    def teardown(self) -> None:
        if hasattr(self, "ck"):
            try:
                self.ck.close()
            finally:
                shutil.rmtree(self.dir, ignore_errors=True)


CheckpointerMachine.TestCase.settings = examples(ci=20, stateful_step_count=16)
TestCheckpointerMachine = CheckpointerMachine.TestCase


@pytest.fixture(autouse=True, scope="module")
def _machine_base(tmp_path_factory: pytest.TempPathFactory) -> None:
    CheckpointerMachine.base = tmp_path_factory.mktemp("ckpt-machine")
