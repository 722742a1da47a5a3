"""Write only what you can read (DESIGN.md, commit protocol step 5; issue 29).

Before any record is published - ``quire.json`` (save, overwrite, save_async, finalize, cp,
promotion to a persistent tier, incremental or not), a partial-save journal version, a
Checkpointer's root record - the publishing path runs on its bytes the very function a load
runs on them.  A record that fails is not published: ``UnreadableRecordError`` (a
``CorruptCheckpointError``), and what was there before stays whole and loadable.

Three views of it:

* the code: the conditional writes live only in ``commit.publish`` / ``commit.create``, and
  each runs the check first (ast);
* every publish site, run for real: each conditional write a run of every path makes was
  checked, with the same bytes, just before (a spy on the check and on the backend);
* a writer producing a record the loader refuses, on each path: the loader's own rule
  tables (``quire._format.schema``) are given a rule refusing ``"poison"`` metadata, which
  only the loader's function can know about; every path then refuses to publish, and the
  previous checkpoint (journal version, step) is intact.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import quire
from quire import partial
from quire._engine import commit as _commit
from quire._engine import copying as _copying
from quire._engine import journal as _journal
from quire._format import root as _root
from quire._format import schema as _schema
from quire._format.schema_values import Invalid, _dict
from quire._runtime import ioloop as _io
from quire._store.local import LocalBackend
from quire._tiers import promotion as _promotion
from quire.policies import EveryNSteps

COMMIT = Path(_commit.__file__)
CONDITIONAL = {"put_if_absent", "replace_if_match"}


def _tree(i: int) -> dict[str, Any]:
    return {"w": np.full((16, 4), i, np.float32), "n": i}


def _same(a: Any, b: Any) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))


def _data_dirs(url: str | Path) -> set[str]:
    d = Path(url, "d")
    return set(os.listdir(d)) if d.is_dir() else set()


# ---------------------------------------------------------------- the code
def test_conditional_writes_only_after_the_readers_check() -> None:
    """Every conditional write of a record is in a function of the commit module that
    runs ``_refuse_unreadable`` on the same bytes first, and ``create`` cannot be called
    without the reader to check with."""
    tree = ast.parse(COMMIT.read_text())
    writers = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        calls = [
            n
            for n in ast.walk(fn)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute | ast.Name)
        ]
        names = [
            (c.func.attr if isinstance(c.func, ast.Attribute) else c.func.id, c) for c in calls
        ]
        puts = [c.lineno for name, c in names if name in CONDITIONAL]
        if not puts:
            continue
        checks = [c.lineno for name, c in names if name == "_refuse_unreadable"]
        writers[fn.name] = (min(puts), checks)
    assert set(writers) == {"publish", "create"}, writers
    for name, (first_put, checks) in writers.items():
        assert checks and min(checks) < first_put, name
    create = next(
        f for f in ast.walk(tree) if isinstance(f, ast.AsyncFunctionDef) and f.name == "create"
    )
    arg = create.args.args[-1]
    assert arg.arg == "check" and len(create.args.defaults) == 0  # required


# ---------------------------------------------------------------- every site, run
@contextlib.contextmanager
def _spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, Any, Any]]]:
    """Events in order: ("check", key, bytes) when a record is checked before publishing,
    ("write", key, bytes) for each conditional write to a local backend."""
    events: list[tuple[str, Any, Any]] = []
    real = _commit._refuse_unreadable

    def checked(check: Any, data: bytes, url: str, key: str) -> Any:
        got = real(check, data, url, key)
        events.append(("check", key, data))
        return got

    def wrap(name: str) -> None:
        orig = getattr(LocalBackend, name)

        async def put(self: Any, key: str, data: bytes, *a: Any) -> Any:
            events.append(("write", key, data))
            return await orig(self, key, data, *a)

        monkeypatch.setattr(LocalBackend, name, put)

    monkeypatch.setattr(_commit, "_refuse_unreadable", checked)
    for name in CONDITIONAL:
        wrap(name)
    yield events


def test_every_publish_site_checks_what_it_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = set()
    with _spy(monkeypatch) as events:
        url = str(tmp_path / "a")
        quire.save(url, _tree(1))
        quire.save(url, _tree(2), overwrite=True)
        quire.save_async(str(tmp_path / "async"), _tree(3)).result()
        p = str(tmp_path / "p")
        partial.save(p, _tree(4))
        partial.save(p, {"w": np.zeros((16, 4), np.float32)})
        partial.finalize(p)
        quire.copy(url, str(tmp_path / "copy"))
        with quire.Checkpointer(
            tmp_path / "persistent",
            save_policy=EveryNSteps(2),
            local=quire.LocalTier(tmp_path / "local", save_policy=EveryNSteps(1)),
        ) as c:
            for s in (1, 2):
                c.save(s, _tree(s))
            c.wait()
        with quire.Checkpointer(
            tmp_path / "inc",
            incremental=True,
            save_policy=EveryNSteps(2),
            local=quire.LocalTier(tmp_path / "inclocal", save_policy=EveryNSteps(1)),
        ) as c:
            for s in (1, 2, 4):
                c.save(s, _tree(1))
            c.wait()
        quire.copy(str(tmp_path / "inc" / "step_00000004"), str(tmp_path / "unborrowed"))
    writes = [(k, d) for kind, k, d in events if kind == "write"]
    for i, (kind, key, data) in enumerate(events):
        if kind == "write":
            keys.add(key.rsplit("/", 1)[-1] if "journal" not in key else "journal")
            assert ("check", key, data) in events[:i], key  # the same bytes, before
    assert keys == {"quire.json", "journal", "checkpointer.json"}, keys
    # saves, overwrite, async, finalize, copy, 2 local + 1 persistent, 3 local + 2
    # incremental promotions (steps 2, 4), the unborrowing copy: 14 quire.json at least
    assert sum(k.endswith("quire.json") for k, _ in writes) >= 14
    assert len(writes) == sum(kind == "write" for kind, _, _ in events)


# ---------------------------------------------------------------- refused, old intact
@pytest.fixture
def poison(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """The loader's own rule tables refuse metadata with a "poison" key while armed:
    ``commit`` for quire.json, ``journal`` for journal versions."""
    armed = {"commit": True, "journal": True}

    def rule(which: str) -> Any:
        def check(v: Any, where: str) -> Any:
            d = _dict(v, where)
            if armed[which] and "poison" in d:
                raise Invalid(where + "/poison", "refused by this test's rule")
            return d

        return check

    monkeypatch.setitem(_schema.COMMIT_FIELDS, "metadata", (True, rule("commit")))
    monkeypatch.setitem(_schema.JOURNAL_FIELDS, "metadata", (True, rule("journal")))
    return armed


POISON = {"poison": 1}


def _refused(fn: Any, *a: Any, **kw: Any) -> str:
    with pytest.raises(quire.errors.UnreadableRecordError) as ei:
        fn(*a, **kw)
    msg = str(ei.value)
    assert "refusing to publish" in msg and "metadata/poison" in msg, msg
    assert isinstance(ei.value, quire.CorruptCheckpointError)
    return msg


def test_save_and_overwrite_refuse_and_keep_the_old_checkpoint(
    tmp_path: Path, poison: dict[str, bool]
) -> None:
    url = str(tmp_path / "c")
    msg = _refused(quire.save, url, _tree(1), metadata=POISON)
    assert url in msg
    assert not os.path.exists(os.path.join(url, "quire.json")) and not _data_dirs(url)
    quire.save(url, _tree(1))
    before = (Path(url, "quire.json").read_bytes(), _data_dirs(url))
    _refused(quire.save, url, _tree(2), metadata=POISON, overwrite=True)
    _refused(lambda: quire.save_async(url, _tree(3), metadata=POISON, overwrite=True).result())
    assert (Path(url, "quire.json").read_bytes(), _data_dirs(url)) == before
    _same(quire.load(url), _tree(1))
    assert quire.verify(url).problems == ()


def test_partial_save_and_finalize_refuse_and_keep_the_journal(
    tmp_path: Path, poison: dict[str, bool]
) -> None:
    url = str(tmp_path / "p")
    partial.save(url, _tree(1))
    _refused(partial.save, url, _tree(2), metadata=POISON)
    assert [v.version for v in partial.versions(url)] == [1]
    _same(partial.load(url), _tree(1))
    # a version the journal rule lets through, then a finalize the commit rule refuses
    poison["journal"] = False
    partial.save(url, {"w": np.zeros((16, 4), np.float32)}, metadata=POISON)
    _refused(partial.finalize, url)
    assert not os.path.exists(os.path.join(url, "quire.json"))
    assert [v.version for v in partial.versions(url)] == [1, 2]
    assert partial.load(url)["n"] == 1
    poison["commit"] = False
    partial.finalize(url)
    assert quire.load(url)["n"] == 1


def test_copy_refuses_and_keeps_the_destination(
    tmp_path: Path, poison: dict[str, bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    poison["commit"] = False
    quire.save(src, _tree(2), metadata=POISON)
    quire.save(dst, _tree(1))
    before = (Path(dst, "quire.json").read_bytes(), _data_dirs(dst))
    real = _copying._copy_objects

    async def arm_then_copy(*a: Any, **kw: Any) -> Any:  # after the source was read
        poison["commit"] = True
        return await real(*a, **kw)

    monkeypatch.setattr(_copying, "_copy_objects", arm_then_copy)
    _refused(quire.copy, src, dst, overwrite=True)
    assert (Path(dst, "quire.json").read_bytes(), _data_dirs(dst)) == before
    poison["commit"] = False
    _same(quire.load(dst), _tree(1))


@pytest.mark.parametrize("incremental", [False, True])
def test_a_refused_promotion_keeps_the_persistent_tier(
    tmp_path: Path,
    poison: dict[str, bool],
    monkeypatch: pytest.MonkeyPatch,
    incremental: bool,
) -> None:
    module, name = (_promotion, "_rewrite") if incremental else (_copying, "_copy_objects")
    real = getattr(module, name)

    async def arm_then(*a: Any, **kw: Any) -> Any:  # after the local step was read
        poison["commit"] = True
        return await real(*a, **kw)

    poison["commit"] = False
    c = quire.Checkpointer(
        tmp_path / "persistent",
        incremental=incremental,
        save_policy=EveryNSteps(2),
        local=quire.LocalTier(tmp_path / "local", save_policy=EveryNSteps(1)),
    )
    try:
        c.save(2, _tree(2))
        c.wait()
        monkeypatch.setattr(module, name, arm_then)
        c.save(4, _tree(4), metadata=POISON)
        with pytest.raises(quire.errors.UnreadableRecordError):
            c.wait()
        assert c.tiers_of(4) == ("local",) and c.tiers_of(2) == ("local", "persistent")
        assert not (tmp_path / "persistent" / "step_00000004" / "quire.json").exists()
        poison["commit"] = False
        _same(quire.load(str(tmp_path / "persistent" / "step_00000002")), _tree(2))
    finally:
        poison["commit"] = False
        c.close()


def test_the_root_record_is_checked_by_its_readers_parser(tmp_path: Path) -> None:
    b = LocalBackend(str(tmp_path))
    bad = json.dumps({"format": "quire-checkpointer", "version": 99, "step_format": "s{}"})

    async def create(data: bytes) -> bool:
        return await _commit.create(
            b, _root.ROOT_RECORD, data, str(tmp_path), lambda raw: _root.parse_root_record(raw, "")
        )

    with pytest.raises(quire.errors.UnreadableRecordError, match="has version 99"):
        _io.submit(create(bad.encode())).result()
    assert not (tmp_path / _root.ROOT_RECORD).exists()
    good = _root.root_record_bytes("s{}", {})
    assert _io.submit(create(good)).result()
    assert _io.submit(_root.read_root_record(b, str(tmp_path))).result()["step_format"] == "s{}"


def test_the_journal_checks_with_its_readers_parser(tmp_path: Path) -> None:
    """``_reader_of`` is the parser ``read_records`` uses: a record numbered for another
    version is refused by both."""
    url = str(tmp_path / "j")
    partial.save(url, _tree(1))
    raw = Path(url, _journal.record_key(1)).read_bytes()
    assert _journal._reader_of(url, 1)(raw)["journal_version"] == 1
    with pytest.raises(quire.CorruptCheckpointError, match="claims version 1"):
        _journal._reader_of(url, 2)(raw)
