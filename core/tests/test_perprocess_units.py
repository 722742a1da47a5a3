"""Per-process checkpointable units in one process: the record's form, the folder of each
process's objects, a load by another process count refused, verify / cp / a Checkpointer's
retention and gc over them, hostile records.  Several real processes, each restoring its own
state: ``tests/test_perprocess_multihost.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import quire
from quire._cli.main import main
from quire._format.record import record_checksum
from quire.checkpointables import UnitIO
from quire.policies import EveryNSteps, LatestN


class Position:
    """A data iterator's position, one per JAX process (``quire_per_process``)."""

    quire_per_process = True

    def __init__(self, pos: int) -> None:
        self.pos = pos
        self.seen: list[tuple[str, int | None]] = []  # (io.prefix, io.process) of each call

    def quire_save(self, io: UnitIO) -> Any:
        self.seen.append((io.prefix, io.process))
        io.write("pos.bin", self.pos.to_bytes(8, "little"))
        return {"pos": self.pos}

    def quire_restore(self, io: UnitIO, record: Any) -> Position:
        self.seen.append((io.prefix, io.process))
        self.pos = int.from_bytes(io.read("pos.bin"), "little")
        assert record == {"pos": self.pos}
        return self


class Snapshotted(Position):
    """The same, with a snapshot step for async saves."""

    def quire_snapshot(self) -> Position:
        return Position(self.pos)


def files_under(root: Path, loc: str) -> list[str]:
    base = root / loc
    return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())


@pytest.mark.parametrize("how", ["blocking", "async", "async-snapshot"])
def test_round_trip_and_layout(tmp_path: Path, how: str) -> None:
    """One record per process in ``records``, the objects under ``p00000/``, ``io.process``
    set on both sides; a whole unit beside it keeps its one ``record``."""
    url = tmp_path / "c"
    unit = (Snapshotted if how == "async-snapshot" else Position)(41)
    units = {"it": unit, "whole": WholePosition(5), "w": {"a": np.arange(3.0)}}
    if how == "blocking":
        quire.save_checkpointables(str(url), units)
    else:
        quire.save_checkpointables_async(str(url), units).result(timeout=60)
        unit.pos = 99  # after the call: not what was saved
    rec = quire.metadata(str(url)).record
    it = rec["units"]["it"]
    assert {k: it[k] for k in ("kind", "handler", "processes", "records")} == {
        "kind": "handler",
        "handler": "self",
        "processes": 1,
        "records": [{"pos": 41}],
    }
    assert "record" not in it and rec["process_count"] == 1
    assert files_under(url, it["location"]) == ["p00000/pos.bin"]
    whole = rec["units"]["whole"]
    assert whole["record"] == {"pos": 5} and "processes" not in whole
    assert files_under(url, whole["location"]) == ["pos.bin"]
    if how == "blocking":
        assert unit.seen == [(f"{it['location']}/p00000", 0)]
    back = quire.load_checkpointables(str(url), {"it": Position(0), "whole": WholePosition(0)})
    assert back["it"].pos == 41 and back["whole"].pos == 5
    assert back["it"].seen == [(f"{it['location']}/p00000", 0)]
    assert back["whole"].seen == [(whole["location"], None)]


class WholePosition(Position):
    quire_per_process = False


def test_a_load_by_another_process_count_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "c")
    quire.save_checkpointables(url, {"it": Position(3), "w": {"a": np.arange(3.0)}})
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(quire.TreeMismatchError) as e:
        quire.load_checkpointables(url, {"it": Position(0)})
    msg = str(e.value)
    assert url in msg and "unit 'it'" in msg and "saved by 1 process" in msg
    assert "this run has 2" in msg and "leave 'it' out of the load" in msg
    assert e.value.mismatched == ["it"]
    got = quire.load_checkpointables(url, {"w": None})  # the fix: the other units load
    assert np.array_equal(got["w"]["a"], np.arange(3.0))


class PerProcessJson:
    """A handler claiming both an inline record and a state per process."""

    id = "test-inline-per-process"
    inline = True
    per_process = True

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, tuple) and obj[:1] == ("ipp",)

    def save(self, obj: Any, io: UnitIO) -> Any:
        return list(obj)

    def load(self, io: UnitIO, record: Any, target: Any) -> Any:
        return tuple(record)


def test_inline_and_per_process_together_are_refused(tmp_path: Path) -> None:
    quire.checkpointables.register_checkpointable_handler(PerProcessJson())
    try:
        with pytest.raises(quire.errors.PluginError, match="both inline and per_process"):
            quire.save_checkpointables(str(tmp_path / "c"), {"x": ("ipp", 1)})
    finally:
        quire.checkpointables.unregister_checkpointable_handler(PerProcessJson.id)
    assert not (tmp_path / "c").exists()


def test_verify_and_cp_cover_every_process_folder(tmp_path: Path, capsys: Any) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    quire.save_checkpointables(src, {"it": Position(8), "w": {"a": np.arange(3.0)}})
    assert main(["info", src]) == 0
    assert "units: it (self, per process: 1), w (pytree)\n" in capsys.readouterr().out
    res = quire.copy(src, dst)
    assert res.objects >= 2  # the pack's objects, the unit's
    assert quire.load_checkpointables(dst, {"it": Position(0)})["it"].pos == 8
    assert quire.verify(dst).ok
    (obj,) = (tmp_path / "dst").rglob("pos.bin")
    raw = bytearray(obj.read_bytes())
    raw[0] ^= 0x5A
    obj.write_bytes(bytes(raw))
    report = quire.verify(dst)
    (p,) = report.problems
    assert (p.unit, p.path, p.error) == ("it", "it", "crc32c checksum mismatch")
    assert p.object.endswith("/it/p00000/pos.bin")
    assert main(["verify", dst]) == 1
    with pytest.raises(quire.CorruptCheckpointError):
        quire.copy(dst, str(tmp_path / "again"))
    with pytest.raises(quire.CorruptCheckpointError):
        quire.load_checkpointables(dst, {"it": Position(0)})


def test_checkpointer_retention_and_gc_keep_each_kept_steps_objects(tmp_path: Path) -> None:
    """Async steps through a local tier (every step; promoted every 2nd), LatestN(2) on
    both: the kept steps load and verify whole after retention and a gc."""
    root, local = tmp_path / "run", tmp_path / "local"
    pos = Position(0)
    with quire.Checkpointer(
        str(root),
        keep=LatestN(2),
        save_policy=EveryNSteps(2),
        local=quire.LocalTier(str(local), save_policy=EveryNSteps(1), keep=LatestN(2)),
    ) as ck:
        for step in range(1, 7):
            pos.pos = step * 10
            ck.save_checkpointables(step, {"it": pos, "step": {"n": np.int64(step)}})
        ck.wait()
        assert ck.steps() == [4, 5, 6]  # persistent 4, 6; local 5, 6
        ck.gc(grace_period=0)
        for step in (4, 5, 6):
            assert ck.load_checkpointables(step, {"it": Position(0)})["it"].pos == step * 10
    kept = {
        tier: sorted(p.parent for p in base.rglob("step_*/quire.json"))
        for tier, base in (("persistent", root), ("local", local))
    }
    assert [p.name for p in kept["persistent"]] == ["step_00000004", "step_00000006"]
    assert [p.name for p in kept["local"]] == ["step_00000005", "step_00000006"]
    for step_dir in kept["persistent"] + kept["local"]:
        step = int(step_dir.name.removeprefix("step_"))
        assert quire.verify(str(step_dir)).ok
        back = quire.load_checkpointables(str(step_dir), {"it": Position(0)})["it"]
        assert back.pos == step * 10
        (obj,) = step_dir.rglob("pos.bin")
        assert obj.parent.name == "p00000"


def _per_process_record(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    url = str(tmp_path / "c")
    quire.save_checkpointables(url, {"it": Position(3)})
    return url, json.loads(Path(url, "quire.json").read_text())


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda u: u.update(processes=2), "units/it/processes: 2 processes, but the record was"),
        (lambda u: u.update(processes=0), "units/it/processes: 0 is not an integer >= 1"),
        (lambda u: u.update(processes="1"), "units/it/processes: '1' is not an integer"),
        (lambda u: u.update(records=[]), "units/it/records: 0 records for 1 processes"),
        (lambda u: u.update(records={"0": {}}), "units/it/records: {'0': {}} is not a list"),
        (lambda u: u.update(record={"pos": 3}), "units/it/record: a per-process unit has one"),
        (lambda u: u.pop("processes"), "units/it: required field 'processes' is missing"),
        (lambda u: u.pop("records"), "units/it: required field 'records' is missing"),
    ],
)
def test_hostile_per_process_records_are_refused(tmp_path: Path, edit: Any, says: str) -> None:
    """Re-signed records (a valid checksum) with a per-process unit that no writer makes."""
    url, doc = _per_process_record(tmp_path)
    edit(doc["units"]["it"])
    doc["checksum"] = record_checksum(doc)
    Path(url, "quire.json").write_text(json.dumps(doc))
    with pytest.raises(quire.CorruptCheckpointError, match=f"at {says}"):
        quire.load_checkpointables(url, {"it": Position(0)})


# ----------------------------------------------------------------- a local tier's owners
def _two_process_doc() -> dict[str, Any]:
    """The record of a step two processes saved (primary 0): per-process unit ``it``,
    whole unit ``w``, no chunks."""
    return {
        "txids": ["ab12"],
        "units": {
            "it": {"kind": "handler", "handler": "self", "location": "d/ab12/it",
                   "processes": 2, "records": [{"pos": 1}, {"pos": 2}]},
            "w": {"kind": "handler", "handler": "self", "location": "d/ab12/w", "record": {}},
        },
    }  # fmt: skip


def _unit_object(data: bytes) -> bytes:
    from quire._format.crc import crc_bytes

    return data + crc_bytes(data)


def test_each_process_owns_its_folder_of_a_per_process_unit(tmp_path: Path, caplog: Any) -> None:
    """What a multi-process local tier asks (``quire._tiers.ownership``): ``p00001/`` of a
    per-process unit is process 1's, whole units are the primary's; a copy of process 1's
    objects holds exactly its folder, checked, and is then held."""
    import asyncio

    from quire._store.url import open_backend
    from quire._tiers import ownership as tp

    doc = _two_process_doc()
    assert tp.owner_of("d/ab12/it/p00001/pos.bin", 0, doc) == 1
    assert tp.owner_of("d/ab12/it/p00000/pos.bin", 1, doc) == 0
    for other in ("d/ab12/w/pos.bin", "d/ab12/it/p00002/x", "d/ab12/it/p1/x", "d/ab12/it/p00001"):
        assert tp.owner_of(other, 0, doc) == 0, other
    assert tp.owner_of("d/ab12/it/p00001/pos.bin", 0) == 0  # without the record: the primary
    assert tp.owners(doc, 0) == [0, 1] and tp.owners(doc, 1) == [0, 1]
    assert tp.owned_unit_locations(doc, 0, 0) == ["d/ab12/it/p00000", "d/ab12/w"]
    assert tp.owned_unit_locations(doc, 1, 0) == ["d/ab12/it/p00001"]

    root = tmp_path / "root"  # process 0's root, holding a copy of process 1's objects
    b = open_backend(str(root))
    mine = {"d/ab12/it/p00000/pos.bin": _unit_object(b"0"), "d/ab12/w/pos.bin": _unit_object(b"w")}
    theirs = {"d/ab12/it/p00001/pos.bin": _unit_object(b"1")}
    for k, v in mine.items():
        asyncio.run(b.put(k, [v]))
    asyncio.run(tp.receive(b, str(root), doc, 1, 0, theirs, "process 1"))
    assert asyncio.run(tp.holds(b, doc, 1))
    assert asyncio.run(tp._own_keys(b, str(root), doc, 0, 0)) == sorted(mine)
    assert asyncio.run(tp._own_keys(b, str(root), doc, 1, 0)) == sorted(theirs)
    for wrong in (mine, {**theirs, "d/ab12/w/x": _unit_object(b"x")}):
        with pytest.raises(quire.CorruptCheckpointError, match="is not an object of its part"):
            tp.check_objects(doc, str(root), 1, 0, wrong, "process 3")
    bad = {"d/ab12/it/p00001/pos.bin": b"1" + _unit_object(b"1")[1:] + b"x"}
    with pytest.raises(quire.CorruptCheckpointError, match="fails its check"):
        tp.check_objects(doc, str(root), 1, 0, bad, "process 3")
