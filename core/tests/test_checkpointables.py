"""Several named units in one checkpoint: pytrees, JSON configs, self-saving objects."""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import pytest

import quire
from quire.checkpointables import UnitIO


class Iterator:
    """A data iterator that saves its own position (the Checkpointable protocol)."""

    def __init__(self, seed: int) -> None:
        self.seed, self.pos = seed, 0

    def __next__(self) -> int:
        self.pos += 1
        return self.seed * 1000 + self.pos

    def quire_save(self, io: UnitIO) -> Any:
        io.write("state.bin", np.array([self.seed, self.pos], np.int64).tobytes())
        return {"version": 1}

    def quire_restore(self, io: UnitIO, record: Any) -> Iterator:
        assert record == {"version": 1}
        self.seed, self.pos = np.frombuffer(io.read("state.bin"), np.int64).tolist()
        return self


def test_units_round_trip(url: str) -> None:
    it = Iterator(7)
    for _ in range(5):
        next(it)
    config = {"lr": 0.1, "layers": [64, 64], "name": "run", "nested": {"x": None}}
    quire.save_checkpointables(
        url, {"state": {"w": np.arange(6.0)}, "data": it, "config": config}, metadata={"step": 5}
    )
    m = quire.metadata(url)
    assert m.units == {"state": "pytree", "data": "self", "config": "json"}
    assert m.tree is None  # no unit named "pytree"
    fresh = Iterator(0)
    out = quire.load_checkpointables(url, {"data": fresh, "config": None})
    assert list(out) == ["data", "config"]  # only the named units
    assert out["data"] is fresh and (fresh.seed, fresh.pos) == (7, 5)
    assert out["config"] == config
    all_units = quire.load_checkpointables(
        url, {"state": None, "config": None, "data": Iterator(1)}
    )
    assert np.array_equal(all_units["state"]["w"], np.arange(6.0))
    with pytest.raises(quire.CheckpointNotFoundError, match="load_checkpointables"):
        quire.load(url)
    with pytest.raises(quire.TreeMismatchError, match="nope"):
        quire.load_checkpointables(url, {"nope": None})


def test_save_is_the_single_unit_case(url: str) -> None:
    quire.save(url, {"a": np.ones(2)})
    assert quire.metadata(url).units == {"pytree": "pytree"}
    got = quire.load_checkpointables(url)
    assert list(got) == ["pytree"] and np.array_equal(got["pytree"]["a"], np.ones(2))


def test_unit_object_checksum(tmp_path: Any) -> None:
    url = str(tmp_path / "c")
    it = Iterator(3)
    quire.save_checkpointables(url, {"data": it})
    files = [p for p in (tmp_path / "c").rglob("state.bin")]
    assert len(files) == 1
    raw = bytearray(files[0].read_bytes())
    raw[0] ^= 1
    files[0].write_bytes(bytes(raw))
    with pytest.raises(quire.CorruptCheckpointError):
        quire.load_checkpointables(url, {"data": Iterator(0)})


def test_async_units_copy_before_returning(url: str) -> None:
    config = {"lr": 0.1}
    r = quire.save_checkpointables_async(url, {"config": config, "p": {"x": np.ones(3)}})
    config["lr"] = 99.0
    r.result(timeout=60)
    assert quire.load_checkpointables(url, {"config": None})["config"] == {"lr": 0.1}
    if "://" not in url:
        with open(url + "/quire.json") as f:
            raw = json.load(f)
        assert raw["units"]["config"] == {"kind": "json", "value": {"lr": 0.1}}


class LockedLoader:
    """A loader that cannot be deep-copied (it holds a ``_thread.lock``, as a Grain
    iterator does) and whose position moves on after every batch.

    ``quire_save`` stands still until the test says so when it runs outside the thread that
    made the loader: that is a save writing the live object in the background, after the
    loop moved on (a save that writes at the call never waits)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pos = 0
        self.owner = threading.get_ident()
        self.loop_moved_on = threading.Event()

    def __next__(self) -> int:
        with self.lock:
            self.pos += 1
            return self.pos

    def quire_save(self, io: UnitIO) -> Any:
        if threading.get_ident() != self.owner:
            self.loop_moved_on.wait(10)
        with self.lock:
            io.write_json("pos.json", self.pos)
        return {"version": 1}

    def quire_restore(self, io: UnitIO, record: Any) -> LockedLoader:
        self.pos = io.read_json("pos.json")
        return self


def _run_on(loader: LockedLoader, steps: int) -> None:
    for _ in range(steps):
        next(loader)
    loader.loop_moved_on.set()


def test_async_save_holds_the_position_at_the_call(url: str) -> None:
    """Issue 29: the live object was written in the background, after the loop moved on."""
    loader = LockedLoader()
    _run_on(loader, 3)
    loader.loop_moved_on.clear()
    r = quire.save_checkpointables_async(url, {"data": loader, "p": {"x": np.ones(2)}})
    _run_on(loader, 50)
    r.result(timeout=60)
    back = quire.load_checkpointables(url, {"data": LockedLoader()})["data"]
    assert back.pos == 3


def test_checkpointer_save_holds_the_position_at_the_call(tmp_path: Any) -> None:
    loader = LockedLoader()
    with quire.Checkpointer(str(tmp_path / "run"), local=quire.LocalTier(str(tmp_path / "local"))) as ckpt:
        for step in range(1, 4):
            _run_on(loader, 10)
            loader.loop_moved_on.clear()
            ckpt.save_checkpointables(step, {"data": loader, "p": {"x": np.ones(2)}}, force=True)
        _run_on(loader, 25)
        ckpt.wait()
        back = ckpt.load_checkpointables(3, {"data": LockedLoader()})["data"]
    assert back.pos == 30


class Position:
    """A Checkpointable with an explicit snapshot step: ``quire_snapshot`` returns the
    state ``quire_save`` writes later; the live object is never written by an async save."""

    def __init__(self, pos: int = 0) -> None:
        self.pos = pos
        self.saved_live = 0

    def quire_snapshot(self) -> Position:
        return Position(self.pos)

    def quire_save(self, io: UnitIO) -> Any:
        self.saved_live += 1
        io.write_json("pos.json", self.pos)
        return {"version": 1}

    def quire_restore(self, io: UnitIO, record: Any) -> Position:
        self.pos = io.read_json("pos.json")
        return self


def test_async_save_uses_the_snapshot_step(url: str) -> None:
    p = Position(4)
    r = quire.save_checkpointables_async(url, {"data": p})
    p.pos = 99
    r.result(timeout=60)
    assert p.saved_live == 0  # only the snapshot was written
    assert quire.load_checkpointables(url, {"data": Position()})["data"].pos == 4
    quire.save_checkpointables(url, {"data": p}, overwrite=True)  # blocking: the object
    assert p.saved_live == 1


class Broken(Position):
    def __init__(self, how: str) -> None:
        super().__init__(1)
        self.how = how

    def quire_snapshot(self) -> Any:
        if self.how == "raises":
            raise RuntimeError("socket closed")
        return self if self.how == "itself" else object()


class Unwritable(LockedLoader):
    def quire_save(self, io: UnitIO) -> Any:
        raise OSError("the loader's worker died")


@pytest.mark.parametrize(
    "unit, says",
    [
        (Broken("raises"), r"snapshot step quire_snapshot\(\) failed .*socket closed"),
        (Broken("itself"), "returned the object itself"),
        (Broken("no-save"), "which has no quire_save"),
        (Unwritable(), r"no snapshot step, and writing it at the async save's call failed"),
    ],
)
def test_a_unit_that_cannot_be_captured_fails_the_call(url: str, unit: Any, says: str) -> None:
    """Neither snapshotted nor written at the call: a typed error before the call returns,
    naming the URL and the unit; nothing is saved."""
    with pytest.raises(quire.errors.SnapshotError, match=says) as e:
        quire.save_checkpointables_async(url, {"p": {"x": np.ones(2)}, "data": unit})
    assert url in str(e.value) and "'data'" in str(e.value)
    with pytest.raises(quire.CheckpointNotFoundError):
        quire.metadata(url)


class Counter:
    """A type this test does not own, saved through a checkpointable handler."""

    def __init__(self) -> None:
        self.n = 0
        self.lock = threading.Lock()


class CounterHandler:
    id = "test-counter"

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, Counter)

    def save(self, obj: Counter, io: UnitIO) -> Any:
        io.write("n", str(obj.n).encode())
        return {"n": obj.n}

    def load(self, io: UnitIO, record: Any, target: Any) -> Any:
        assert int(io.read("n")) == record["n"]
        return record["n"]


def test_a_handler_without_snapshot_is_written_at_the_call(tmp_path: Any) -> None:
    """A third-party handler with no snapshot step: its save runs at the call, its bytes
    are written later (the Counter holds a lock, so a deep copy is impossible)."""
    quire.checkpointables.register_checkpointable_handler(CounterHandler())
    try:
        c = Counter()
        c.n = 7
        with quire.Checkpointer(str(tmp_path / "run")) as ckpt:
            ckpt.save_checkpointables(1, {"c": c})
            c.n = 8
            ckpt.wait()
            assert ckpt.load_checkpointables(1, {"c": None})["c"] == 7
    finally:
        quire.checkpointables.unregister_checkpointable_handler("test-counter")
