"""Every chunk accounted for before the commit (DESIGN.md, commit protocol step 5; issue 39).

Before a record is published, every chunk (and ``zarr.json``) of every array it names must be
in a chunk index the record names or stored as an object; otherwise the publish raises
``quire.errors.IncompleteCheckpointError`` and what was there before stays whole.  Before
this check such checkpoints committed, and every load of them failed with "missing chunk
object".

Each save path is run with a writer that loses one chunk (``dropchunk``: the array writer
skipping a chunk, an incremental writer losing a borrowed range, a finalize's pack rewrite
losing an index entry, or a source committed by a quire without the check), and must refuse;
the complete cases beside them (zero-size, 0-d, inline and fill-only leaves, inner chunks,
both layouts, borrowed ranges) must commit.  The multi-process paths are in
``tests/test_props_multihost.py`` (generated) and ``tests/test_tiers_multihost.py``.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from dropchunk import dropping, dropping_borrowed, unchecked
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import quire
from quire import partial
from quire._engine import commit as _commit
from quire._engine import completeness as _completeness
from quire._engine import packrewrite as _packrewrite
from quire._format.chunkindex import index_key
from quire._format.root import DEFAULT_STEP_FORMAT
from quire._handlers import select as _selection
from quire._handlers.base import LoadContext, LoadEntry
from quire._runtime import ioloop as _io
from quire._store.local import LocalBackend
from quire.errors import IncompleteCheckpointError, UnreadableRecordError
from quire.policies import EveryNSteps

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices")

LAYOUTS = ["packed", "chunks"]


def sharded(i: int, rows: int = 16) -> jax.Array:
    """``(rows, 4)`` float32 split over 8 devices along axis 0: a chunk grid of (8, 1)."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    host = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + 1000 * i
    return jax.device_put(host, NamedSharding(mesh, P("x")))


def tree(i: int) -> dict[str, Any]:
    return {"w": sharded(i), "b": np.full((3,), i, np.float32), "n": i}


def same(a: Any, b: Any) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def data_dirs(url: str | Path) -> set[str]:
    d = Path(url, "d")
    return set(os.listdir(d)) if d.is_dir() else set()


def refused(fn: Any, *a: Any, path: str = "w", **kw: Any) -> IncompleteCheckpointError:
    with pytest.raises(IncompleteCheckpointError) as ei:
        fn(*a, **kw)
    e = ei.value
    assert isinstance(e, UnreadableRecordError)  # the "write only what you can read" family
    msg = str(e)
    assert "refusing to publish" in msg and repr(path) in msg and repr(e.key) in msg, msg
    assert "Nothing was committed" in msg and "save again" in msg, msg
    assert e.path == path and e.missing >= 1
    return e


# ---------------------------------------------------------------- the code
def test_publish_checks_completeness_before_any_conditional_write() -> None:
    """In ``publish`` the completeness check runs before the first conditional write; the
    journal's ``create`` asks for it."""
    src = ast.parse(Path(_commit.__file__).read_text())
    publish = next(
        f for f in ast.walk(src) if isinstance(f, ast.AsyncFunctionDef) and f.name == "publish"
    )
    lines: dict[str, list[int]] = {}
    for n in ast.walk(publish):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute | ast.Name):
            name = n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id
            lines.setdefault(name, []).append(n.lineno)
    first_write = min(lines["put_if_absent"] + lines["replace_if_match"])
    assert lines["_refuse_incomplete"] and max(lines["_refuse_incomplete"]) < first_write
    from quire._engine import journal

    text = Path(journal.__file__).read_text()
    assert "complete=True" in text.split("async def _create_record", 1)[1]


@pytest.mark.parametrize(
    "value",
    [
        np.zeros((0, 5), np.float32),  # zero-size: its zarr.json only
        np.array(3.5, np.float32),  # 0-d numpy: chunk key "c"
        sharded(0, rows=8),  # one row per device
        np.zeros((40, 4), np.float32),  # fill values only: still written and checked
    ],
    ids=["zero-size", "0-d", "sharded", "fill-only"],
)
def test_the_check_expects_what_the_handler_owns(value: Any, tmp_path: Path) -> None:
    """The check's chunk grid of an array leaf names exactly the objects its handler says
    it owns (``objects``, what verify and cp read)."""
    url = str(tmp_path / "c")
    quire.save(url, {"w": value}, layout="chunks")
    doc = json.loads(Path(url, "quire.json").read_bytes())
    leaf = doc["units"]["pytree"]["tree"]["children"][0]
    handler = _selection.get(leaf["handler"])
    ctx = LoadContext(url, LocalBackend(url))
    (owned,) = _io.submit(handler.objects([LoadEntry(("w",), leaf)], ctx)).result()
    needs = _io.submit(
        _completeness._needs(LocalBackend(url), url, [("pytree", doc["units"]["pytree"]["tree"])])
    ).result()
    (grid,) = needs.arrays.values()
    expected = {f"{grid.location}/zarr.json"} | {grid.chunk_key(i) for i in range(len(grid.seen))}
    assert expected == {o.key for o in owned}
    listed = {k for k in _io.submit(LocalBackend(url).list("d")).result()}
    assert expected <= listed


def test_only_the_key_a_load_asks_for_counts() -> None:
    """A chunk counts only under the key zarr's encoding gives it (what a load looks up):
    no other spelling of its coordinates, no coordinate outside the grid, no other rank."""
    needs = _completeness._Needs()
    needs.add_array("w", "d/t/pytree/w", (4, 1))
    needs.add_array("v", "d/t/pytree/v", (2, 2, 2))
    needs.add_array("s", "d/t/pytree/s", ())
    w = "d/t/pytree/w/c/"
    needs.mark([w + "03/0", w + "+1/0", w + " 2/0", w + "4/0", w + "0/0/0", w + "0", w + "٣/0"])
    assert not any(needs.arrays["d/t/pytree/w"].seen)
    needs.mark([w + "0/0", w + "3/0", "d/t/pytree/v/c/1/0/1", "d/t/pytree/v/c/1/01/1"])
    needs.mark(["d/t/pytree/s/c", "d/t/pytree/w/zarr.json"])
    assert list(needs.arrays["d/t/pytree/w"].seen) == [1, 0, 0, 1]
    assert [i for i, x in enumerate(needs.arrays["d/t/pytree/v"].seen) if x] == [5]
    assert needs.arrays["d/t/pytree/s"].seen == bytearray(b"\x01")
    got = needs.first()
    assert got is not None and got[:4] == (
        "w",
        "d/t/pytree/w/c/1/0",
        "chunk (1, 0) of its grid",
        (1, 0),
    )
    assert got[4] == 2 + (1 + 7) + 1  # w: 2 chunks; v: zarr.json, 7 chunks; s: zarr.json


@pytest.mark.parametrize("damage", ["missing", "other bytes"])
def test_an_index_the_record_names_must_be_readable(damage: str, tmp_path: Path) -> None:
    """Every chunk is in process 0's index, but the record also names process 1's, which is
    missing or not the object its entry describes: process 1's load reads its own index
    first and would fail, so the record is refused too."""
    url = str(tmp_path / "c")
    quire.save(url, tree(1))
    doc = json.loads(Path(url, "quire.json").read_bytes())
    (entry,) = doc["indexes"]
    other = index_key(entry["txid"], 1)
    if damage == "other bytes":
        Path(url, other).write_bytes(Path(url, entry["object"]).read_bytes() + b" ")
    indexes = [entry, {**entry, "process": 1, "object": other}]
    trees, _ = _completeness.record_parts(doc)
    with pytest.raises(IncompleteCheckpointError) as ei:
        _io.submit(
            _completeness.check(LocalBackend(url), url, "quire.json", trees, indexes)
        ).result()
    assert ei.value.path is None and ei.value.missing == 1
    assert other in str(ei.value) and "refusing to publish quire.json" in str(ei.value)
    _io.submit(_completeness.check(LocalBackend(url), url, "quire.json", trees, [entry])).result()


# ---------------------------------------------------------------- complete saves commit
@pytest.mark.parametrize("layout", LAYOUTS)
def test_complete_saves_of_every_kind_of_leaf_commit(layout: str, tmp_path: Path) -> None:
    t = {
        "w": sharded(1),
        "empty": np.zeros((0, 3), np.int8),
        "scalar": np.array(7, np.int32),
        "zeros": np.zeros((5, 5), np.float64),
        "inline": 3.0,
        "s": "text",
        "inner": sharded(2, rows=64),
    }

    def storage(path: Any, leaf: Any) -> quire.StorageOptions | None:
        return quire.StorageOptions(chunk_bytes=32) if path[-1] == "inner" else None

    url = tmp_path / "c"
    quire.save(url, t, layout=layout, storage=storage)
    saved = json.loads((url / "quire.json").read_bytes())["units"]["pytree"]["tree"]
    kids = dict(zip(saved["keys"], saved["children"]))
    assert "inner_shape" in kids["inner"]  # zarr shards with inner chunks
    same(quire.load(url), t)


# ---------------------------------------------------------------- save, overwrite, async
@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_with_a_lost_chunk_is_refused(layout: str, tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    with dropping(("w",), 1) as lost:
        e = refused(quire.save, url, tree(1), layout=layout)
    assert len(lost) == 1 and lost[0][1] == (1, 0)
    assert e.chunk == (1, 0) and e.key.endswith("/w/c/1/0") and e.missing == 1
    assert url in str(e) and "chunk (1, 0) of its grid" in str(e)
    assert not Path(url, "quire.json").exists() and not data_dirs(url)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_overwrite_with_a_lost_chunk_keeps_the_old_checkpoint(layout: str, tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    quire.save(url, tree(1), layout=layout)
    before = (Path(url, "quire.json").read_bytes(), data_dirs(url))
    with dropping(("w",), 7):
        e = refused(quire.save, url, tree(2), layout=layout, overwrite=True)
        assert e.chunk == (7, 0)
        refused(lambda: quire.save_async(url, tree(3), layout=layout, overwrite=True).result())
    assert (Path(url, "quire.json").read_bytes(), data_dirs(url)) == before
    same(quire.load(url), tree(1))
    assert quire.verify(url).problems == ()


def test_a_lost_zarr_json_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from quire._format.pack import PackWriter

    real = PackWriter.put_bound

    async def put_bound(self: Any, key: str, *a: Any, **kw: Any) -> None:
        if not key.endswith("/b/zarr.json"):
            await real(self, key, *a, **kw)

    monkeypatch.setattr(PackWriter, "put_bound", put_bound)
    e = refused(quire.save, str(tmp_path / "c"), tree(1), path="b")
    assert e.chunk is None and e.key.endswith("/b/zarr.json") and "its zarr.json" in str(e)


# ---------------------------------------------------------------- partial saves, finalize
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_partial_save_with_a_lost_chunk_is_refused(layout: str, tmp_path: Path) -> None:
    url = str(tmp_path / "p")
    with quire.Context(layout=layout):
        partial.save(url, tree(1))
        with dropping(("w",), 3):
            refused(partial.save, url, {"w": sharded(2)})
    assert [v.version for v in partial.versions(url)] == [1]
    same(partial.load(url), tree(1))
    partial.finalize(url)
    same(quire.load(url), tree(1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_finalize_of_an_incomplete_journal_is_refused(layout: str, tmp_path: Path) -> None:
    """A journal version an older quire committed without a chunk: finalize refuses it and
    the journal stays as it was."""
    url = str(tmp_path / "p")
    with quire.Context(layout=layout):
        partial.save(url, tree(1))
        with unchecked(), dropping(("w",), 2):
            partial.save(url, {"w": sharded(2)})
        refused(partial.finalize, url)
    assert not Path(url, "quire.json").exists()
    assert [v.version for v in partial.versions(url)] == [1, 2]
    same(partial.load(url, version=1), tree(1))


def test_a_pack_rewrite_that_loses_a_chunk_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """finalize rewrites packs less than half live; a rewrite that loses an index entry is
    refused and the journal is kept."""
    url = str(tmp_path / "p")
    big = {"w": sharded(1, rows=1024), "x": sharded(3, rows=64)}
    partial.save(url, big)
    partial.save(url, {"w": sharded(2, rows=1024)})  # version 1's pack is mostly dead now
    real = _packrewrite.index_bytes
    dropped: list[str] = []

    def index_bytes(txid: str, p: int, refs: dict[str, Any], *a: Any) -> bytes:
        lose = sorted(k for k in refs if k.endswith("/x/c/5/0"))
        dropped.extend(lose)
        return real(txid, p, {k: v for k, v in refs.items() if k not in lose}, *a)

    monkeypatch.setattr(_packrewrite, "index_bytes", index_bytes)
    e = refused(partial.finalize, url, path="x")
    assert dropped and e.key == dropped[0] and e.chunk == (5, 0)
    assert not Path(url, "quire.json").exists()
    monkeypatch.setattr(_packrewrite, "index_bytes", real)
    partial.finalize(url)
    same(quire.load(url), {"w": sharded(2, rows=1024), "x": sharded(3, rows=64)})


# ---------------------------------------------------------------- cp
@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_of_an_incomplete_checkpoint_is_refused(layout: str, tmp_path: Path) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    with unchecked(src), dropping(("w",), 4):
        quire.save(src, tree(2), layout=layout)  # as a quire without the check committed it
    quire.save(dst, tree(1))
    before = (Path(dst, "quire.json").read_bytes(), data_dirs(dst))
    if layout == "chunks":  # the copy reads every chunk object: the source is damaged
        # One object at a time: the chunks before the missing one are copied first, and the
        # failed copy removes them (it left d/<txid>/ behind when a race made it so).
        with (
            pytest.raises(quire.CorruptCheckpointError, match="is missing"),
            quire.Context(max_concurrency=1),
        ):
            quire.copy(src, dst, overwrite=True)
    else:  # the packs and indexes are copied as they are: the commit refuses
        e = refused(quire.copy, src, dst, overwrite=True)
        assert e.chunk == (4, 0) and dst in str(e)
    assert (Path(dst, "quire.json").read_bytes(), data_dirs(dst)) == before
    same(quire.load(dst), tree(1))


# ---------------------------------------------------------------- the Checkpointer
def step(root: Path, s: int) -> Path:
    return root / DEFAULT_STEP_FORMAT.format(s)


@pytest.mark.parametrize("incremental", [False, True])
def test_checkpointer_save_with_a_lost_chunk_keeps_its_steps(
    incremental: bool, tmp_path: Path
) -> None:
    with quire.Checkpointer(tmp_path, incremental=incremental) as c:
        c.save(1, tree(1))
        c.wait()
        with dropping(("w",), 6), pytest.raises(IncompleteCheckpointError):
            c.save(2, tree(2))
            c.wait()
        assert c.steps() == [1]
    assert not (step(tmp_path, 2) / "quire.json").exists()
    same(quire.load(str(step(tmp_path, 1))), tree(1))


def test_an_incremental_step_that_loses_a_borrowed_range_is_refused(tmp_path: Path) -> None:
    """Unchanged chunks are borrowed from the step before (refs into its packs): they count
    as present; one whose reference is lost does not.  Both ways of borrowing: a changed
    leaf's equal chunks (hashed), and a leaf that is the very same array (carried)."""
    t1 = tree(1)
    with quire.Checkpointer(tmp_path, incremental=True) as c:
        c.save(1, t1)
        c.wait()
        c.save(2, {**t1, "w": sharded(1) + 0})  # new array, equal chunks: all borrowed
        c.wait()
        doc = json.loads((step(tmp_path, 2) / "quire.json").read_bytes())
        assert any(e.get("borrowed") for e in doc["indexes"])
        for s, w in ((3, sharded(1) + 0), (4, t1["w"])):  # hashed, then carried
            with (
                dropping_borrowed("/w/c/3/0") as lost,
                pytest.raises(IncompleteCheckpointError) as ei,
            ):
                c.save(s, {**t1, "w": w})
                c.wait()
            assert lost and ei.value.chunk == (3, 0), s
        assert c.steps() == [1, 2]
    same(quire.load(str(step(tmp_path, 2))), t1)


@pytest.mark.parametrize("incremental", [False, True])
def test_promotion_of_an_incomplete_local_step_is_refused(
    incremental: bool, tmp_path: Path
) -> None:
    """A local-tier step committed without a chunk (by a quire without the check): its
    promotion to the persistent tier (copied whole, or re-packed incrementally) refuses,
    and the persistent tier keeps its steps."""
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    c = quire.Checkpointer(
        persistent,
        incremental=incremental,
        save_policy=EveryNSteps(2),
        local=quire.LocalTier(local, save_policy=EveryNSteps(1)),
    )
    try:
        c.save(2, tree(2))
        c.wait()
        with (
            unchecked(str(local)),
            dropping(("w",), 5),
            pytest.raises(IncompleteCheckpointError) as ei,
        ):
            c.save(4, tree(4))
            c.wait()
        assert ei.value.chunk == (5, 0) and str(persistent) in str(ei.value)
        assert c.tiers_of(2) == ("local", "persistent")
        assert not (step(persistent, 4) / "quire.json").exists()
        same(quire.load(str(step(persistent, 2))), tree(2))
    finally:
        c.close()
