"""Format v2: ``quire.partial.finalize`` rewrites packs less than half live (quire._engine.packrewrite).

Checked on memory and local disk here (S3 / GCS: tests/test_journal_object_stores.py):
mostly-overwritten versions shrink to fewer objects and bytes and load equal; a pack at
exactly half live, or just above, is kept byte for byte, just below is rewritten; verify,
cp and a plain fsspec+zarr reader accept the result; a SIGKILL at every backend call of a
rewriting finalize leaves the journal loadable (or the new checkpoint whole), and what it
left behind is removed by finalize + ``quire gc``.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import forkserver
import numpy as np
import pytest
from test_partial import assert_tidy, pack_report, stored

import quire
from quire import partial
from quire._cli.main import main
from quire._engine import packrewrite as _packrewrite
from quire._runtime import ioloop as _io
from quire._store.url import open_backend


def _verify(url: str) -> tuple[int, list[Any]]:
    from quire._engine.verify import verify

    return _io.submit(verify(url)).result()


# ----------------------------------------------------------------------------- behaviour
def test_overwritten_versions_shrink_and_load_equal(url: str) -> None:
    big = 4096
    for i in range(3):  # each version replaces a and b and adds its own small leaf
        partial.save(url, {"a": np.full(big, i, np.float64), "b": np.full(big, -i, np.float32),
                           f"x{i}": np.arange(5 + i, dtype=np.int16)})  # fmt: skip
    partial.delete(url, [("x0",)])
    partial.save(url, {"a": np.full(big, 7.0), "b": np.full(big, 8, np.float32)})
    want = partial.load(url)
    before = stored(url)
    partial.finalize(url)
    after = stored(url)
    got = quire.load(url)
    assert got.keys() == want.keys() == {"a", "b", "x1", "x2"}
    for k in want:
        assert np.array_equal(got[k], want[k]) and got[k].dtype == want[k].dtype
    # versions 1-3 were each mostly dead: x1 and x2 moved into one new pack
    assert len(after) < len(before) and sum(after.values()) < sum(before.values()) / 2
    assert len(after) == 4, after  # version 4's pack + index, the rewrite's pack + index
    assert _verify(url) == (8, [])  # 4 chunks + 4 zarr.json
    assert_tidy(url)
    moved = quire.metadata(url).tree["x1"].location
    assert moved.count("/") > quire.metadata(url).tree["a"].location.count("/")  # d/R/T/...


@pytest.mark.parametrize(("n_b", "rewritten"), [(999, True), (1000, False), (1001, False)])
def test_a_pack_at_or_above_half_live_is_kept(url: str, n_b: int, rewritten: bool) -> None:
    # One pack holds a (1000 float32) and b (n_b float32), 4-byte crc32c each; a is then
    # replaced, so b is the pack's live part: 4,000 of 8,004 bytes (less than half), 4,004 of
    # 8,008 (exactly half) or 4,008 of 8,012.
    partial.save(url, {"a": np.arange(1000, dtype=np.float32), "b": np.ones(n_b, np.float32)})
    first = set(stored(url))
    partial.save(url, {"a": np.zeros(1000, np.float32)})
    partial.finalize(url)
    kept_pack = [k for k in first if "-0" in k.rsplit("/", 1)[-1]]
    assert len(kept_pack) == 1
    assert (kept_pack[0] in stored(url)) is not rewritten
    got = quire.load(url)
    assert np.array_equal(got["b"], np.ones(n_b, np.float32)) and not got["a"].any()
    assert _verify(url)[1] == []
    if rewritten:
        assert_tidy(url)
    else:  # the record keeps version 1's index (its pack is half live), byte for byte
        liveness, _ = pack_report(url)
        assert liveness[kept_pack[0]] == (4 * n_b + 4, 4004 + 4 * n_b + 4)


def test_kept_pack_referenced_in_place_by_the_rewrite(tmp_path: Path) -> None:
    # Version 1 writes two packs (pack_bytes=5000): [a | b] and [c]. Version 2 replaces a:
    # pack 0 is half dead (kept), pack 1 is whole (kept)... and version 3 deletes c, so
    # pack 1 is dead: the index is superseded, b moves to the rewrite's index, which points
    # at pack 0 in place (not copied), and pack 1 is dropped.
    url = str(tmp_path / "c")
    with quire.Context(pack_bytes=5000):
        partial.save(url, {"a": np.ones(500, np.float32), "b": np.full(600, 2, np.float32),
                           "c": np.full(1000, 3, np.float32)})  # fmt: skip
    v1 = set(stored(url))
    packs = sorted(k for k in v1 if not k.endswith(".json"))
    assert len(packs) == 2
    partial.save(url, {"a": np.zeros(500, np.float32)})
    partial.delete(url, [("c",)])
    partial.finalize(url)
    now = stored(url)
    assert packs[0] in now and packs[1] not in now
    doc = json.loads(Path(url, "quire.json").read_text())
    old_txid = packs[0].split("/")[1]
    assert old_txid in doc["txids"]  # kept alive for its pack alone
    assert all(e["txid"] != old_txid for e in doc["indexes"])  # its index is superseded
    got = quire.load(url)
    assert np.array_equal(got["b"], np.full(600, 2, np.float32)) and set(got) == {"a", "b"}
    assert _verify(url)[1] == []
    assert_tidy(url)
    # cp copies the shared pack once and verifies it; the copy reads equal
    dst = str(tmp_path / "copy")
    assert main(["cp", url, dst]) == 0
    assert np.array_equal(quire.load(dst)["b"], got["b"])
    assert _verify(dst)[1] == []
    # plain fsspec + zarr, no quire code, open the moved array
    import zarr

    loc = quire.metadata(url).tree["b"].location
    arr = zarr.open_array(quire.zarr_store(url), path=loc, mode="r")
    assert np.array_equal(arr[:], got["b"])


def test_finalize_reads_only_the_indexes_of_versions_that_lost_a_leaf(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    partial.save(url, {"a": np.ones(100), "b": np.ones(10)})
    partial.save(url, {"c": np.ones(100)})  # wholly live: its index is not read
    partial.save(url, {"a": np.zeros(100)})
    v1, v2 = (v.txid for v in partial.versions(url)[:2])
    read: list[str] = []
    real = _packrewrite._read_indexes

    async def spy(backend: Any, u: str, entries: Any) -> Any:
        read.extend(e["txid"] for e in entries)
        return await real(backend, u, entries)

    monkeypatch.setattr(_packrewrite, "_read_indexes", spy)
    partial.finalize(url)
    assert read == [v1]
    doc = json.loads(_io.submit(open_backend(url).get("quire.json")).result())
    assert v2 in {e["txid"] for e in doc["indexes"]}
    assert_tidy(url)
    assert float(quire.load(url)["c"][0]) == 1.0


def test_a_damaged_chunk_stops_the_rewrite_and_nothing_is_committed(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    partial.save(url, {"a": np.ones(1000, np.float32), "b": np.arange(10, dtype=np.float32)})
    partial.save(url, {"a": np.zeros(1000, np.float32)})
    before = stored(url)
    v1 = partial.versions(url)[0].txid
    (entry,) = [e for e in _index_entries(url, v1)]
    refs = json.loads(Path(url, entry["object"]).read_text())["refs"]
    loc = f"d/{v1}/pytree/b/c/0"
    pack, off, _ = refs[loc]
    raw = bytearray(Path(url, pack).read_bytes())
    raw[off] ^= 0xFF  # b is the live part of version 1's mostly dead pack
    Path(url, pack).write_bytes(bytes(raw))
    with pytest.raises(quire.CorruptCheckpointError, match=loc):
        partial.finalize(url)
    assert not Path(url, "quire.json").exists() and stored(url) == before  # rewrite removed
    assert len(partial.versions(url)) == 2


def _index_entries(url: str, txid: str) -> list[dict[str, Any]]:
    out = []
    for p in sorted(Path(url, "journal").iterdir()):
        doc = json.loads(p.read_text())
        out += [e for e in doc.get("indexes", []) if e["txid"] == txid]
    return out


def test_nothing_dead_nothing_rewritten(url: str) -> None:
    partial.save(url, {"a": np.ones(10)})
    partial.save(url, {"b": np.ones(10)})
    before = set(stored(url))
    partial.finalize(url)
    assert set(stored(url)) == before
    doc = json.loads(_io.submit(open_backend(url).get("quire.json")).result())
    assert len(doc["indexes"]) == 2 and len(doc["txids"]) == 2


class Blob:
    def __init__(self, data: bytes) -> None:
        self.data = data


class BlobHandler:
    """A third-party-style leaf: one object ``<location>/blob``, no zarr array."""

    id = "test-blob"
    types = (Blob,)

    def handles(self, value: Any) -> bool:
        return isinstance(value, Blob)

    def handles_abstract(self, abstract: Any) -> bool:
        return abstract is Blob

    def snapshot(self, entries: Any) -> list[Any]:
        return list(entries)

    async def save(self, entries: Any, ctx: Any) -> list[dict[str, Any]]:
        for e in entries:
            await ctx.backend.put(f"{e.location}/blob", [e.value.data])
        return [{"location": e.location} for e in entries]

    def check(self, entry: Any) -> str | None:
        return None

    async def load(self, entries: Any, ctx: Any) -> list[Any]:
        return [Blob(await ctx.backend.get(f"{e.record['location']}/blob")) for e in entries]

    def metadata(self, records: Any) -> list[Any]:
        return [Blob for _ in records]


def test_a_pack_holding_a_leaf_that_is_not_a_zarr_array_is_kept(url: str) -> None:
    # The blob's pack is mostly dead after version 2, but quire cannot move a leaf it does
    # not know the objects of: the pack and its index are kept, the blob loads.
    quire.handlers.register_leaf_handler(BlobHandler())
    try:
        partial.save(url, {"blob": Blob(b"tape" * 10), "w": np.ones(2000, np.float32)})
        first = set(stored(url))
        partial.save(url, {"w": np.zeros(2000, np.float32)})
        partial.finalize(url)
        assert first <= set(stored(url))
        got = quire.load(url)
        assert got["blob"].data == b"tape" * 10 and not got["w"].any()
    finally:
        quire.handlers.unregister_leaf_handler("test-blob")


# ----------------------------------------------------------------------------- crashes
CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import quire
    from quire._store import local as L
    url, kill_at = sys.argv[1], int(sys.argv[2])
    calls = []
    def die(name):
        calls.append(name)
        if len(calls) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    def wrap(cls, attr, name):
        orig = getattr(cls, attr)
        if asyncio.iscoroutinefunction(orig):
            async def f(self, *a, **k):
                die(name)
                return await orig(self, *a, **k)
        else:
            def f(self, *a, **k):
                die(name)
                return orig(self, *a, **k)
        setattr(cls, attr, f)
    for n in ("put", "sync", "put_if_absent", "delete", "delete_prefix", "stream_writer"):
        wrap(L.LocalBackend, n, n)
    for n in ("write", "close"):
        wrap(L._StreamWriter, n, "pack_" + n)
    quire.partial.finalize(url)
    print("CALLS", ",".join(calls))
    """
)


def _journal(url: str) -> dict[str, np.ndarray]:
    with quire.Context(pack_bytes=6000):
        partial.save(url, {"a": np.full(1000, 1.0, np.float32), "b": np.arange(400, dtype=np.int32),
                           "c": np.full(900, 5, np.float32)})  # fmt: skip
    partial.save(url, {"a": np.full(1000, 2.0, np.float32), "d": np.ones(3)})
    return partial.load(url)


def _child(url: str, kill_at: int) -> subprocess.CompletedProcess[str]:
    return forkserver.run(["-c", CHILD, url, str(kill_at)], timeout=120)


def test_sigkill_at_every_call_of_a_rewriting_finalize(tmp_path: Path) -> None:
    probe = str(tmp_path / "probe")
    want = _journal(probe)
    r = _child(probe, 0)
    assert r.returncode == 0, r.stderr
    calls = r.stdout.split("CALLS")[1].strip().split(",")
    assert "stream_writer" in calls and "pack_write" in calls, calls  # it did rewrite
    commit = calls.index("put_if_absent")
    # Every call up to the commit and the deletions of what it superseded; after that only
    # the first of a run of like calls (the journal's and dead txids' removal).
    points = [k for k in range(1, len(calls) + 1)
              if k <= commit + 3 or calls[k - 1] != calls[k - 2]]  # fmt: skip
    for k in points:
        url = str(tmp_path / f"k{k}")
        _journal(url)
        r = _child(url, k)
        assert r.returncode == -9, (k, r.stderr)
        committed = os.path.exists(os.path.join(url, "quire.json"))
        assert committed == (k > commit + 1), (k, calls)  # killed before / after the commit
        if committed:
            got = quire.load(url)
            assert _verify(url)[1] == []
        else:  # the previous journal version loads whole, and finalize runs again
            got = partial.load(url)
            partial.finalize(url)
            assert quire.load(url).keys() == want.keys()
        assert got.keys() == want.keys()
        for key in want:
            assert np.array_equal(got[key], want[key]), (k, calls[k - 1], key)
        # What the kill left behind: a kill after the commit may leave the journal and the
        # superseded packs inside a live txid; discard finishes that clean-up. The rest
        # (the rewrite of a kill before the commit, dead txids) is gc's.
        journal = Path(url, "journal")
        if committed and journal.exists() and any(journal.iterdir()) and k % 2:
            partial.discard(url)  # (on the other points, gc below finishes it)
            assert quire.load(url).keys() == want.keys()
        assert main(["gc", url, "--yes", "--grace", "0"]) == 0
        assert_tidy(url)
        assert not journal.exists() or not any(journal.iterdir())
        assert quire.load(url).keys() == want.keys()


@pytest.mark.parametrize("under_root", [False, True])
def test_gc_finishes_a_finalize_killed_after_its_commit(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    under_root: bool,
) -> None:
    """A finalize killed between its commit and its clean-up leaves the journal and the
    packs its rewrite superseded (inside a live txid, so not gc's per-txid garbage):
    ``quire gc`` reports it as unfinished and finishes the clean-up, on a plain URL and on
    a Checkpointer step."""
    from quire._engine import journal as journal_module

    root = str(tmp_path / "run")
    url = f"{root}/step_00000007" if under_root else root
    if under_root:
        quire.Checkpointer(root, step_format="step_{:08d}").close()
    want = _journal(url)

    async def skip(*args: Any, **kwargs: Any) -> None:
        return None

    with monkeypatch.context() as m:  # "killed": nothing after the commit point runs
        m.setattr(_packrewrite, "_drop", skip)
        m.setattr(journal_module, "_cleanup", skip)
        partial.finalize(url)
    assert Path(url, "journal").is_dir() and Path(url, "quire.json").exists()
    assert main(["gc", root, "--grace", "0"]) == 0  # dry run: names it, removes nothing
    assert "killed after its commit" in capsys.readouterr().out
    assert Path(url, "journal").is_dir()
    assert main(["gc", root, "--yes", "--grace", "0"]) == 0
    assert not Path(url, "journal").exists() or not any(Path(url, "journal").iterdir())
    assert_tidy(url)
    got = quire.load(url)
    for key in want:
        assert np.array_equal(got[key], want[key])
