"""Conformance suite for checkpointable handlers (entry-point group ``quire.checkpointables``).

Subclass :class:`CheckpointableHandlerSuite`, name the handler id and give a sample
object::

    from quire.testing import CheckpointableHandlerSuite

    class TestLoaderState(CheckpointableHandlerSuite):
        handler_id = "my-loader"

        @pytest.fixture
        def obj(self):
            return make_loader(position=17)

        def target(self, obj):
            return make_loader(position=0)   # what load_checkpointables gets as target

        def mutate(self, obj):
            next(obj)                         # what the training loop does after a save

Override :meth:`CheckpointableHandlerSuite.assert_restored` when ``==`` does not
compare your objects.  Never override a ``test_*`` method to make it pass.

A handler that declares ``per_process = True`` (one state per JAX process, e.g. a data
iterator) is checked here in one process: the record's form (its process count, one record
per process), its objects under ``p00000/``, and a load by another number of processes
refused with ``quire.TreeMismatchError`` naming the unit.  What one process cannot show -
several processes saving their own states and each restoring its own - needs real JAX
processes; quire's repository runs that for quire-grain in
``tests/test_perprocess_multihost.py``, a harness to copy.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from quire.testing._common import UrlFixture, flip_byte, json_roundtrips, record_of

__all__ = ["CheckpointableHandlerSuite"]


class _Gate:
    """A unit saved before the one under test whose background write waits for ``open``:
    an async save's later writes then surely run after the caller's next step."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def quire_snapshot(self) -> _Gate:
        snap = _Gate()
        snap.open = self.open
        return snap

    def quire_save(self, io: Any) -> Any:
        if not self.open.wait(60):
            raise TimeoutError("the test never opened the gate")
        return {"gate": 1}

    def quire_restore(self, io: Any, record: Any) -> _Gate:
        return self


class CheckpointableHandlerSuite(UrlFixture):
    """Tests every checkpointable handler passes.

    Attributes
    ----------
    handler_id : str
        The handler's ``quire.checkpointables`` entry-point name (or run-time
        registration); the plugin coverage check counts the handler as covered by it.

    Fixtures to provide
    -------------------
    obj
        A sample object the handler saves.
    """

    group: ClassVar[str] = "quire.checkpointables"
    handler_id: ClassVar[str]

    @pytest.fixture
    def obj(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__}: provide an `obj` fixture returning a sample object"
        )

    def target(self, obj: Any) -> Any:
        """The target passed to ``load_checkpointables`` for the unit (default None).

        Parameters
        ----------
        obj : Any
            The object that was saved (from the ``obj`` fixture).
        """
        return None

    def mutate(self, obj: Any) -> None:
        """Change ``obj`` in place, as the caller's next step would after an async save
        (advance an iterator, draw from a generator, edit a config).

        Parameters
        ----------
        obj : Any
            The object from the ``obj`` fixture.
        """
        raise NotImplementedError(
            f"{type(self).__name__}: provide mutate(obj) changing obj in place; the suite "
            "checks that an async save holds the state at the call, not the object later"
        )

    def assert_restored(self, original: Any, restored: Any) -> None:
        """Assert ``restored`` equals ``original`` (override when ``==`` does not compare).

        Parameters
        ----------
        original : Any
            The saved object.
        restored : Any
            What ``load_checkpointables`` returned for it.
        """
        assert restored == original

    def _get(self) -> Any:
        from quire._handlers import unit_ops as _checkpointables

        return _checkpointables.get(self.handler_id)

    # -- the contract -----------------------------------------------------------------
    def test_found_by_id(self) -> None:
        h = self._get()
        assert h is not None and h.id == self.handler_id
        for m in ("handles", "save", "load"):
            assert callable(getattr(h, m, None)), f"handler {self.handler_id!r} lacks {m}"

    def test_chosen_for_its_object(self, obj: Any) -> None:
        from quire._handlers import unit_ops as _checkpointables

        assert self._get().handles(obj)
        assert _checkpointables.handler_for(obj) == self.handler_id

    def test_round_trip(self, url: str, obj: Any) -> None:
        """Saved next to a pytree unit; loading the unit alone restores it."""
        import quire

        quire.save_checkpointables(url, {"unit": obj, "state": {"w": np.arange(4.0)}})
        m = quire.metadata(url)
        assert m.units["unit"] == self.handler_id
        out = quire.load_checkpointables(url, {"unit": self.target(obj)})
        assert list(out) == ["unit"]
        self.assert_restored(obj, out["unit"])

    def test_other_units_load_without_it(self, url: str, obj: Any) -> None:
        import quire

        quire.save_checkpointables(url, {"unit": obj, "state": {"w": np.arange(4.0)}})
        out = quire.load_checkpointables(url, {"state": None})
        assert list(out) == ["state"]
        np.testing.assert_array_equal(out["state"]["w"], np.arange(4.0))

    def test_record_is_plain_json(self, url: str, obj: Any) -> None:
        import quire

        quire.save_checkpointables(url, {"unit": obj})
        unit = record_of(url)["units"]["unit"]
        assert json_roundtrips(unit), f"unit record {unit!r} is not plain JSON"

    def test_async_save(self, url: str, obj: Any) -> None:
        import quire

        quire.save_checkpointables_async(url, {"unit": obj}).result(timeout=120)
        out = quire.load_checkpointables(url, {"unit": self.target(obj)})
        self.assert_restored(obj, out["unit"])

    def test_async_save_holds_the_state_at_the_call(self, tmp_path: Path, obj: Any) -> None:
        """The caller changes the object right after ``save_checkpointables_async`` returns,
        before the background write; the checkpoint holds the state at the call."""
        import quire

        at_call, after, url = (str(tmp_path / n) for n in ("at_call", "after", "async"))
        quire.save_checkpointables(at_call, {"unit": obj})
        gate = _Gate()
        r = quire.save_checkpointables_async(url, {"gate": gate, "unit": obj})
        self.mutate(obj)
        gate.open.set()
        r.result(timeout=120)
        quire.save_checkpointables(after, {"unit": obj})
        expected = quire.load_checkpointables(at_call, {"unit": self.target(obj)})["unit"]
        got = quire.load_checkpointables(url, {"unit": self.target(obj)})["unit"]
        moved = quire.load_checkpointables(after, {"unit": self.target(obj)})["unit"]
        with pytest.raises(AssertionError):  # mutate() must change what is saved
            self.assert_restored(expected, moved)
        self.assert_restored(expected, got)

    def test_overwrite(self, url: str, obj: Any) -> None:
        import quire

        quire.save_checkpointables(url, {"unit": obj, "n": {"v": np.zeros(1)}})
        quire.save_checkpointables(url, {"unit": obj, "n": {"v": np.ones(1)}}, overwrite=True)
        out = quire.load_checkpointables(url, {"unit": self.target(obj), "n": None})
        self.assert_restored(obj, out["unit"])
        np.testing.assert_array_equal(out["n"]["v"], np.ones(1))

    def test_writes_only_under_its_sub_prefix(self, tmp_path: Path, obj: Any) -> None:
        """Objects the handler writes lie under ``d/<txid>/<unit name>/``."""
        import quire

        url = str(tmp_path / "ckpt")
        quire.save_checkpointables(url, {"my unit": obj})
        rec = record_of(url)
        files = [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()]
        rel = sorted(str(p.relative_to(tmp_path / "ckpt")) for p in files)
        allowed = [f"d/{t}/my%20unit/" for t in rec["txids"]]
        stray = [r for r in rel if r != "quire.json" and not any(r.startswith(a) for a in allowed)]
        assert not stray, f"written outside the unit's sub-prefix: {stray}"

    def test_process_layout(
        self, tmp_path: Path, obj: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A whole unit has one ``record``; a per-process one (the handler's ``per_process =
        True``) names its process count and holds one record per process, its objects lie
        under ``p00000/``, and a load by another number of processes is refused naming the
        unit (the saving process count is faked; real processes are not started here)."""
        import jax

        import quire

        root = tmp_path / "ckpt"
        quire.save_checkpointables(str(root), {"it": obj})
        rec = record_of(str(root))
        unit = rec["units"]["it"]
        per_process = getattr(self._get(), "per_process", False) is True
        if unit["kind"] == "json" or not per_process:
            assert "processes" not in unit and "records" not in unit, unit
            assert unit["kind"] == "json" or "record" in unit, unit
        else:
            assert unit["processes"] == rec["process_count"] == 1, unit
            assert len(unit["records"]) == 1 and "record" not in unit, unit
            files = [p.relative_to(root / unit["location"]) for p in root.rglob("*")
                     if p.is_file() and p.is_relative_to(root / unit["location"])]  # fmt: skip
            stray = [str(f) for f in files if f.parts[0] != "p00000"]
            assert not stray, f"a per-process unit's objects outside p00000/: {stray}"
            monkeypatch.setattr(jax, "process_count", lambda: 2)
            with pytest.raises(quire.TreeMismatchError, match=r"unit 'it'.* saved by 1 process"):
                quire.load_checkpointables(str(root), {"it": self.target(obj)})

    def test_damaged_object_is_detected(self, tmp_path: Path, obj: Any) -> None:
        """Every byte the handler wrote is checked: a flipped byte fails the load."""
        import quire

        url = str(tmp_path / "ckpt")
        quire.save_checkpointables(url, {"unit": obj})
        files = [p for p in (tmp_path / "ckpt" / "d").rglob("*") if p.is_file()]
        if not files:
            # An inline handler: its unit lives in quire.json, guarded by the record's crc32c.
            import json

            rec_path = tmp_path / "ckpt" / "quire.json"
            doc = json.loads(rec_path.read_text())
            doc["units"]["unit"]["value"] = {"tampered": [doc["units"]["unit"].get("value")]}
            rec_path.write_text(json.dumps(doc))
        for p in files:
            flip_byte(p)
        with pytest.raises(quire.CorruptCheckpointError):
            quire.load_checkpointables(url, {"unit": self.target(obj)})
