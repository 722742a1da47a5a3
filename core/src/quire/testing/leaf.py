"""Conformance suite for leaf handlers (entry-point group ``quire.leaf_handlers``).

Subclass :class:`LeafHandlerSuite` in a test module, name the handler id and give sample
leaves::

    from quire.testing import LeafHandlerSuite

    class TestMyHandler(LeafHandlerSuite):
        handler_id = "my-handler"

        @pytest.fixture
        def values(self):
            return [MyThing(1), MyThing(2, big=True)]

Override :meth:`LeafHandlerSuite.assert_leaf_equal` when ``==`` does not compare your
leaves.  Never override a ``test_*`` method to make it pass.

The suite also checks what ``quire verify`` and ``quire cp`` rely on: the objects a
handler's ``objects`` names (or, without one, everything under the records'
locations) are exactly what its save wrote, and its ``verify`` (or the default,
``quire.handlers.check_objects``) passes a fresh save and reports each owned object
that goes missing or is cut short - by key.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import pytest

from quire.testing._common import UrlFixture, json_roundtrips, record_of

__all__ = ["LeafHandlerSuite"]

_METHODS = ("handles", "handles_abstract", "snapshot", "save", "check", "load", "metadata")


class LeafHandlerSuite(UrlFixture):
    """Tests every leaf handler passes.

    Attributes
    ----------
    handler_id : str
        The id of the handler under test: its ``quire.leaf_handlers`` entry-point name
        (or run-time registration), recorded in every leaf record it writes.  The plugin
        coverage check counts the handler as covered by this attribute.

    Fixtures to provide
    -------------------
    values
        A list of sample leaves (at least one) the handler must save and restore.
    """

    group: ClassVar[str] = "quire.leaf_handlers"
    handler_id: ClassVar[str]

    # -- what a subclass provides -----------------------------------------------------
    @pytest.fixture
    def values(self) -> list[Any]:
        raise NotImplementedError(
            f"{type(self).__name__}: provide a `values` fixture returning sample leaves"
        )

    def assert_leaf_equal(self, expected: Any, actual: Any) -> None:
        """Assert a restored leaf equals the saved one (same type, same content).

        Parameters
        ----------
        expected : Any
            The saved leaf.
        actual : Any
            The loaded one.
        """
        assert type(actual) is type(expected), (type(expected), type(actual))
        if hasattr(expected, "shape") and hasattr(expected, "dtype"):
            assert actual.dtype == expected.dtype, (expected.dtype, actual.dtype)
            assert tuple(actual.shape) == tuple(expected.shape)
            np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected))
        else:
            np.testing.assert_equal(actual, expected)

    # -- helpers ----------------------------------------------------------------------
    @pytest.fixture
    def handler(self) -> Any:
        from quire._handlers import select as _selection

        return _selection.get(self.handler_id)

    def _backend(self) -> Any:
        from quire._store.memory import MemoryBackend

        return MemoryBackend(f"memory://quire-leaf-suite/{uuid.uuid4().hex}")

    def _entries(self, values: Sequence[Any]) -> list[Any]:
        from quire.handlers import SaveEntry

        return [SaveEntry(("leaves", i), v, location=f"d/t/leaf{i}") for i, v in enumerate(values)]

    async def _save_direct(self, handler: Any, entries: list[Any], backend: Any) -> list[Any]:
        from quire._runtime.budget import ByteBudget
        from quire.handlers import SaveContext

        ctx = SaveContext(backend.url, backend, "t", budget=ByteBudget(64 << 20))
        return list(await handler.save(entries, ctx))

    async def _load_direct(
        self, handler: Any, records: list[Any], targets: Sequence[Any], backend: Any
    ) -> list[Any]:
        from quire.handlers import LoadContext, LoadEntry

        entries = [
            LoadEntry(("leaves", i), {**r, "handler": self.handler_id}, t)
            for i, (r, t) in enumerate(zip(records, targets))
        ]
        return list(await handler.load(entries, LoadContext(backend.url, backend)))

    def _run(self, coro: Any) -> Any:
        from quire._runtime import ioloop as _io

        return _io.submit(coro).result(timeout=120)

    # -- the contract -----------------------------------------------------------------
    def test_found_by_id(self, handler: Any) -> None:
        """The id resolves (entry point or run-time registration) to a handler with that id."""
        assert handler.id == self.handler_id
        missing = [m for m in _METHODS if not callable(getattr(handler, m, None))]
        assert not missing, f"handler {self.handler_id!r} lacks {missing}"
        import inspect

        for m in ("save", "load"):
            assert inspect.iscoroutinefunction(getattr(handler, m)), f"{m} must be async"

    def test_chosen_for_its_values(self, handler: Any, values: list[Any]) -> None:
        """Handler choice picks this handler for each sample (no other handler wins)."""
        from quire._handlers import select as _selection

        assert values, "the values fixture must give at least one leaf"
        for v in values:
            assert handler.handles(v), f"handles({v!r}) is false"
            chosen = _selection.for_value(v)
            assert chosen is handler, f"{v!r} goes to {getattr(chosen, 'id', None)!r}"

    def test_batch_round_trip(self, handler: Any, values: list[Any]) -> None:
        """One batched save and one batched load restore every leaf, in order."""
        backend = self._backend()
        entries = self._entries(values)
        records = self._run(self._save_direct(handler, entries, backend))
        assert len(records) == len(values)
        got = self._run(self._load_direct(handler, records, [None] * len(values), backend))
        assert len(got) == len(values)
        for v, g in zip(values, got):
            self.assert_leaf_equal(v, g)

    def test_records_are_plain_json(self, handler: Any, values: list[Any]) -> None:
        """Records are JSON objects (no pickles, no NaN), without the reserved key ``kind``."""
        backend = self._backend()
        records = self._run(self._save_direct(handler, self._entries(values), backend))
        for r in records:
            assert isinstance(r, dict)
            assert "kind" not in r, "'kind' is reserved for the tree structure"
            assert json_roundtrips(r), f"record {r!r} is not plain JSON"

    def test_writes_only_under_its_locations(self, handler: Any, values: list[Any]) -> None:
        """Every object a save writes lies under one of the entries' locations."""
        backend = self._backend()
        entries = self._entries(values)
        self._run(self._save_direct(handler, entries, backend))
        keys = self._run(backend.list(""))
        locs = [e.location for e in entries]
        stray = [k for k in keys if not any(k == loc or k.startswith(loc + "/") for loc in locs)]
        assert not stray, f"objects outside the entries' locations: {stray}"

    def test_snapshot_then_save(self, handler: Any, values: list[Any]) -> None:
        """``snapshot`` (what save_async blocks on) keeps paths and locations; its entries save."""
        backend = self._backend()
        entries = self._entries(values)
        snap = handler.snapshot(entries)
        assert [(e.path, e.location) for e in snap] == [(e.path, e.location) for e in entries]
        records = self._run(self._save_direct(handler, list(snap), backend))
        got = self._run(self._load_direct(handler, records, [None] * len(values), backend))
        for v, g in zip(values, got):
            self.assert_leaf_equal(v, g)

    def test_check_accepts_its_own_leaves(self, handler: Any, values: list[Any]) -> None:
        """``check`` finds no mismatch between a record and the value it was saved from."""
        from quire.handlers import LoadEntry

        backend = self._backend()
        records = self._run(self._save_direct(handler, self._entries(values), backend))
        for i, (r, v) in enumerate(zip(records, values)):
            assert handler.check(LoadEntry(("leaves", i), r, None)) is None
            assert handler.check(LoadEntry(("leaves", i), r, v)) is None
            assert handler.handles_abstract(v)

    def test_metadata_one_per_record(self, handler: Any, values: list[Any]) -> None:
        backend = self._backend()
        records = self._run(self._save_direct(handler, self._entries(values), backend))
        records = [{**r, "handler": self.handler_id} for r in records]
        assert len(handler.metadata(records)) == len(records)

    def test_save_and_load(self, url: str, values: list[Any]) -> None:
        """Through ``quire.save`` / ``quire.load``: as saved, and into the values as target."""
        import quire

        tree = {"leaves": list(values), "one": values[0]}
        quire.save(url, tree)
        leaves = record_of(url)["units"]["pytree"]["tree"]
        assert json.dumps(leaves)  # the whole record is JSON
        for got, v in zip(quire.load(url)["leaves"], values):
            self.assert_leaf_equal(v, got)
        restored = quire.load(url, tree)
        for got, v in zip(restored["leaves"], values):
            self.assert_leaf_equal(v, got)
        self.assert_leaf_equal(values[0], restored["one"])
        m = quire.metadata(url)
        assert m.tree is not None and len(m.tree["leaves"]) == len(values)

    def test_save_async(self, url: str, values: list[Any]) -> None:
        import quire

        quire.save_async(url, {"leaves": list(values)}).result(timeout=120)
        for got, v in zip(quire.load(url)["leaves"], values):
            self.assert_leaf_equal(v, got)

    def test_records_name_the_handler(self, url: str, values: list[Any]) -> None:
        """``quire.json`` names this handler for every sample leaf."""
        import quire

        quire.save(url, {"leaves": list(values)})
        tree = record_of(url)["units"]["pytree"]["tree"]
        kids = tree["children"][0]["children"]
        assert [k["handler"] for k in kids] == [self.handler_id] * len(values)

    # -- what verify and cp rely on -------------------------------------------------------
    def _load_entries(self, records: Sequence[Any]) -> list[Any]:
        from quire.handlers import LoadEntry

        return [
            LoadEntry(("leaves", i), {**r, "handler": self.handler_id})
            for i, r in enumerate(records)
        ]

    async def _objects(self, handler: Any, records: Sequence[Any], backend: Any) -> list[Any]:
        from quire.handlers import LoadContext, default_objects

        entries = self._load_entries(records)
        ctx = LoadContext(backend.url, backend)
        fn = getattr(handler, "objects", None)
        return list(await (fn(entries, ctx) if fn is not None else default_objects(entries, ctx)))

    async def _problems(self, handler: Any, records: Sequence[Any], backend: Any) -> list[Any]:
        from quire.handlers import LoadContext, check_objects

        entries = self._load_entries(records)
        ctx = LoadContext(backend.url, backend)
        fn = getattr(handler, "verify", None)
        if fn is None:
            found = check_objects(entries, await self._objects(handler, records, backend), ctx)
        else:
            found = fn(entries, ctx)
        return [p async for p in found]

    def test_owns_exactly_what_it_wrote(self, handler: Any, values: list[Any]) -> None:
        """``objects`` names one list per leaf; together they cover every object the save
        wrote (so ``cp`` copies it all), each under its leaf's location, ranges in bounds."""
        for m in ("objects", "verify"):
            fn = getattr(handler, m, None)
            assert fn is None or callable(fn), f"{m} must be a method"
        backend = self._backend()
        entries = self._entries(values)
        records = self._run(self._save_direct(handler, entries, backend))
        owned = self._run(self._objects(handler, records, backend))
        assert len(owned) == len(values), "one list of objects per entry"
        written = set(self._run(backend.list("")))
        named: set[str] = set()
        for e, objs in zip(entries, owned):
            for o in objs:
                assert o.key == e.location or o.key.startswith(e.location + "/"), (o, e.location)
                assert o.key in written, f"{o.key} is named but was not written"
                size = self._run(backend.size(o.key))
                end = o.offset + (o.length if o.length is not None else 0)
                assert 0 <= o.offset <= size and end <= size, (o, size)
                named.add(o.key)
        assert written == named, f"written but owned by no leaf: {sorted(written - named)}"

    def test_verify_passes_a_fresh_save(self, handler: Any, values: list[Any]) -> None:
        backend = self._backend()
        records = self._run(self._save_direct(handler, self._entries(values), backend))
        assert self._run(self._problems(handler, records, backend)) == []

    def test_verify_reports_missing_and_cut_objects(self, handler: Any, values: list[Any]) -> None:
        """Each owned object, deleted, is reported by key; each one with a check, cut short
        (its range's bytes halved), is reported by key too."""
        backend = self._backend()
        records = self._run(self._save_direct(handler, self._entries(values), backend))
        owned = self._run(self._objects(handler, records, backend))
        for objs in owned:
            for o in objs:
                data = self._run(backend.get(o.key))
                self._run(backend.delete([o.key]))
                problems = self._run(self._problems(handler, records, backend))
                assert o.key in {p.key for p in problems}, f"deleted {o.key} not reported"
                if o.check is not None or o.length is not None:
                    end = len(data) if o.length is None else o.offset + o.length
                    cut = data[: o.offset + (end - o.offset) // 2] + data[end:]
                    self._run(backend.put(o.key, [cut]))
                    problems = self._run(self._problems(handler, records, backend))
                    assert o.key in {p.key for p in problems}, f"cut {o.key} not reported"
                self._run(backend.put(o.key, [data]))
        assert self._run(self._problems(handler, records, backend)) == []
