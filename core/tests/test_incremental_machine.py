"""A randomized state machine over an incremental Checkpointer root: saves (frozen,
recomputed, changed and partly changed leaves, the last making saves compact mostly-dead
packs), retention deletes, gc, crashes at the N-th backend write
call, and a gc running while a save is in flight.  After every step every committed step
loads bit-identically and ``quire verify`` passes.

A crash: from the N-th call on, every write-side call of every ``LocalBackend`` raises
(a killed process writes nothing more; its clean-up cannot run either), the Checkpointer
is abandoned, and a new one (a restarted run, which knows no array objects) continues.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import quire
from quire._engine import garbage as _gc
from quire._format import root as _root
from quire._runtime import ioloop as _io
from quire._store.local import LocalBackend
from quire._store.url import open_backend
from quire.policies import LatestN

WRITES = (
    "put",
    "put_if_absent",
    "replace_if_match",
    "delete",
    "delete_prefix",
    "stream_writer",
    "sync",
)


class Crash(Exception):
    pass


class Faults:
    """Counts write-side backend calls; from the ``at``-th on, each raises ``Crash``."""

    def __init__(self) -> None:
        self.calls = 0
        self.at: int | None = None

    def install(self, mp: pytest.MonkeyPatch, cls: type = LocalBackend) -> None:
        for m in WRITES:
            orig = getattr(cls, m)
            mp.setattr(cls, m, self._wrap(orig))

    def _wrap(self, orig: Any) -> Any:
        faults = self

        async def call(self: Any, *a: Any, **k: Any) -> Any:
            faults.calls += 1
            if faults.at is not None and faults.calls >= faults.at:
                raise Crash(f"killed at write call {faults.calls}")
            return await orig(self, *a, **k)

        return call


def rand(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((16, 32)).astype(np.float32)


class IncrementalRoot(RuleBasedStateMachine):
    mp: pytest.MonkeyPatch
    faults: Faults
    # Where roots live: a fresh URL per sequence (None: a local temporary directory),
    # and the storage options to reach it.
    fresh_url: Any = None
    options: dict[str, Any] | None = None
    base: Path  # pytest's temporary directory of the running test; one folder per sequence
    sequences = itertools.count()

    @initialize()
    def start(self) -> None:
        self.dir = self.base / f"sequence{next(self.sequences)}"
        self.dir.mkdir()
        self.root = str(self.dir / "root") if self.fresh_url is None else self.fresh_url()
        self.backend = open_backend(self.root, self.options)
        self.trees: dict[int, dict[str, np.ndarray]] = {}
        self.step = 0
        self.frozen = {f"f{i}": jnp.asarray(rand(1000 + i)) for i in range(4)}
        self.faults.at = None
        self.ck = self._open()

    def _open(self) -> quire.Checkpointer:
        return quire.Checkpointer(
            self.root,
            incremental=True,
            keep=LatestN(2),
            gc_grace_period=None,
            storage_options=self.options,
        )

    def _committed(self, step: int) -> bool:
        key = f"{_root.DEFAULT_STEP_FORMAT.format(step)}/quire.json"
        return bool(_io.submit(self.backend.exists(key)).result())

    def _tree(self, kind: str) -> dict[str, Any]:
        self.step += 1
        s = self.step
        if kind == "recomputed":  # new objects, the bytes of the previous step
            prev = self.trees.get(max(self.trees)) if self.trees else None
            if prev is not None:
                return {
                    "frozen": {k: jnp.asarray(v) for k, v in prev["frozen"].items()},
                    "x": jnp.asarray(prev["x"]),
                }
        # "partly": all but one frozen leaf change, so the next save borrows a fifth of a
        # pack and compacts it (moves that chunk into a pack of its own)
        changed = kind in ("changed", "partly")
        frozen = (
            {
                k: jnp.asarray(rand(10 * s + i)) if kind == "changed" or i else v
                for i, (k, v) in enumerate(self.frozen.items())
            }
            if changed
            else self.frozen
        )
        if changed:
            self.frozen = frozen
        return {"frozen": frozen, "x": jnp.asarray(rand(s))}

    def _record(self, step: int, tree: dict[str, Any]) -> None:
        self.trees[step] = {
            "frozen": {k: np.asarray(v) for k, v in tree["frozen"].items()},
            "x": np.asarray(tree["x"]),
        }

    @rule(kind=st.sampled_from(["frozen", "recomputed", "changed", "partly"]))
    def save(self, kind: str) -> None:
        tree = self._tree(kind)
        self.ck.save(self.step, tree)
        self.ck.wait()
        self._record(self.step, tree)

    @rule(kind=st.sampled_from(["frozen", "changed", "partly"]), n=st.integers(1, 40))
    def crash_during_save(self, kind: str, n: int) -> None:
        tree = self._tree(kind)
        self.faults.at = self.faults.calls + n
        try:
            self.ck.save(self.step, tree)
            self.ck.wait()
        except Exception:
            pass
        if self._committed(self.step):
            self._record(self.step, tree)
        try:
            self.ck.close()
        except Exception:
            pass
        self.faults.at = None
        self.ck = self._open()  # the restarted run

    @rule()
    def gc(self) -> None:
        self.ck.gc(0)

    @rule(kind=st.sampled_from(["frozen", "changed"]))
    def gc_during_save(self, kind: str) -> None:
        tree = self._tree(kind)
        fmt = _root.StepFormat(_root.DEFAULT_STEP_FORMAT)
        self.ck.save(self.step, tree)  # in the background
        _io.submit(_gc.collect(self.backend, self.root, fmt, grace_period=3600)).result()
        self.ck.wait()
        self._record(self.step, tree)

    @invariant()
    def every_committed_step_loads(self) -> None:
        if not hasattr(self, "ck"):
            return
        self.ck.reload()
        steps = self.ck.steps()
        for s in steps:
            assert s in self.trees, (s, sorted(self.trees))
            got = self.ck.load(s)
            want = self.trees[s]
            assert np.array_equal(np.asarray(got["x"]), want["x"])
            for k, v in want["frozen"].items():
                assert np.array_equal(np.asarray(got["frozen"][k]), v), (s, k)
            url = f"{self.root}/{_root.DEFAULT_STEP_FORMAT.format(s)}"
            report = quire.verify(url, storage_options=self.options)
            assert not report.problems, report
        if self.trees:  # retention never deletes the latest committed step
            assert max(self.trees) in steps, (max(self.trees), steps)

    def teardown(self) -> None:
        if hasattr(self, "ck"):
            self.faults.at = None
            try:
                self.ck.close()
            except Exception:
                pass
            shutil.rmtree(self.dir, ignore_errors=True)


def run_machine(
    monkeypatch: pytest.MonkeyPatch,
    examples: int,
    base: Path,
    *,
    backend: type = LocalBackend,
    fresh_url: Any = None,
    options: dict[str, Any] | None = None,
) -> None:
    """Run the machine ``examples`` times on roots of ``backend`` (moto: tests/)."""
    faults = Faults()
    faults.install(monkeypatch, backend)
    IncrementalRoot.mp = monkeypatch
    IncrementalRoot.faults = faults
    IncrementalRoot.fresh_url = staticmethod(fresh_url) if fresh_url else None
    IncrementalRoot.options = options
    IncrementalRoot.base = base
    IncrementalRoot.TestCase.settings = settings(
        max_examples=examples,
        stateful_step_count=8,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    first = next(IncrementalRoot.sequences)
    IncrementalRoot.TestCase().runTest()
    ran = next(IncrementalRoot.sequences) - first - 1
    assert ran >= examples, f"{ran} sequences ran, not {examples}"


def test_incremental_state_machine_default_lane(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    run_machine(monkeypatch, 4, tmp_path)


@pytest.mark.slow
def test_incremental_state_machine_slow_lane(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    run_machine(monkeypatch, 200, tmp_path)
