"""Several named units in one checkpoint: pytrees, JSON configs, self-saving objects."""

from __future__ import annotations

import json
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
