"""Model-based test of the commit protocol: save / overwrite / delete / crashed save / gc.

A Hypothesis state machine drives a few step checkpoints under one root against a dict
model and checks, after every step, that each committed checkpoint loads exactly its last
saved value, that nothing else is a checkpoint, and that the data under each step is
exactly what its ``quire.json`` references plus the garbage of crashed saves (which GC
then removes without touching anything referenced).  The same machine runs on memory and
local disk here, and on S3 (moto) and GCS (fake-gcs-server) in
``tests/test_commit_object_stores.py``.
"""

from __future__ import annotations

import os
import secrets
import uuid
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import quire
from quire._engine import garbage as _gc
from quire._format import root as _root
from quire._runtime import ioloop as _io
from quire._store.memory import forget
from quire._store.url import open_backend

STEPS = [1, 2, 3]
FMT = _root.StepFormat(_root.DEFAULT_STEP_FORMAT)


def _run(coro: Any) -> Any:
    return _io.submit(coro).result()


class CommitMachine(RuleBasedStateMachine):
    """Single writer; the model maps step -> saved value."""

    def make_root(self) -> str:
        return f"memory://commit-model/{uuid.uuid4().hex}"

    @initialize()
    def setup(self) -> None:
        self.root = self.make_root()
        self.backend = open_backend(self.root)
        self.model: dict[int, int] = {}
        self.garbage: dict[int, set[str]] = {}  # step -> txids of crashed saves

    def url(self, step: int) -> str:
        return f"{self.root}/{FMT.name(step)}"

    @rule(step=st.sampled_from(STEPS), value=st.integers(0, 1000), overwrite=st.booleans())
    def save(self, step: int, value: int, overwrite: bool) -> None:
        tree = {"w": np.full(2, value, np.float32), "n": value}
        if step in self.model and not overwrite:
            with pytest.raises(quire.CheckpointExistsError, match="overwrite=True"):
                quire.save(self.url(step), tree)
            return
        quire.save(self.url(step), tree, overwrite=overwrite)
        self.model[step] = value

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(self.model)))
        _run(_gc.delete_step(self.backend, FMT.name(step)))
        del self.model[step]
        self.garbage.pop(step, None)  # delete_step removes the whole step directory

    @rule(step=st.sampled_from(STEPS))
    def crashed_save(self, step: int) -> None:
        """A save that wrote data and died before its commit point."""
        txid = secrets.token_hex(8)
        _run(self.backend.put(f"{FMT.name(step)}/d/{txid}/pytree/w/zarr.json", [b"{}"]))
        self.garbage.setdefault(step, set()).add(txid)

    @rule()
    def gc(self) -> None:
        report = _run(_gc.collect(self.backend, self.root, FMT, grace_period=0))
        assert not report.kept
        self.garbage = {}

    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "root"):
            return
        assert _run(_root.committed_steps(self.backend, FMT)) == sorted(self.model)
        for step in STEPS:
            keys = _run(self.backend.list(f"{FMT.name(step)}/d"))
            on_disk = {k.split("/")[2] for k in keys}
            if step not in self.model:
                with pytest.raises(quire.CheckpointNotFoundError):
                    quire.load(self.url(step))
                assert on_disk == self.garbage.get(step, set())
                continue
            got = quire.load(self.url(step))
            want = self.model[step]
            assert got["n"] == want and np.array_equal(got["w"], np.full(2, want, np.float32))
            live = set(quire.metadata(self.url(step)).txids)
            assert len(live) == 1
            # Superseded data is gone once the overwrite returned; only crashes leave any.
            assert on_disk == live | self.garbage.get(step, set()), (step, on_disk, live)

    def teardown(self) -> None:
        if hasattr(self, "root") and self.root.startswith("memory://"):
            forget(self.root)


class LocalCommitMachine(CommitMachine):
    tmp_base = ""  # set per session from pytest's tmp_path_factory (no stray temp dirs)

    def make_root(self) -> str:
        return os.path.join(self.tmp_base, uuid.uuid4().hex)

    def teardown(self) -> None:
        import shutil

        if hasattr(self, "root"):
            shutil.rmtree(self.root, ignore_errors=True)


_settings = settings(
    max_examples=12,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCommitModelMemory = CommitMachine.TestCase
TestCommitModelMemory.settings = _settings
TestCommitModelLocal = LocalCommitMachine.TestCase


@pytest.fixture(autouse=True, scope="module")
def _commit_tmp_base(tmp_path_factory: pytest.TempPathFactory) -> None:
    LocalCommitMachine.tmp_base = str(tmp_path_factory.mktemp("commit-model"))


TestCommitModelLocal.settings = _settings
