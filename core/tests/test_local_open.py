"""The local backend never follows a symbolic link below the root, whether it opens a key
with one ``openat2(RESOLVE_NO_SYMLINKS)`` call or by walking the directories."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import quire
from quire._store import nofollow
from quire._store.local import LocalBackend


@pytest.fixture(params=["openat2", "walk"])
def open_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "walk":
        monkeypatch.setattr(nofollow, "_openat2_ok", False)
    elif not sys.platform.startswith("linux"):
        pytest.skip("openat2 is Linux-only")
    return str(request.param)


def _tree(tmp_path: Path) -> LocalBackend:
    root = tmp_path / "root"
    (root / "d" / "t" / "a").mkdir(parents=True)
    (root / "d" / "t" / "a" / "0").write_bytes(b"data")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "0").write_bytes(b"SECR")
    os.symlink(outside, root / "d" / "t" / "linkdir")
    os.symlink(outside / "0", root / "d" / "t" / "a" / "link")
    return LocalBackend(str(root))


def test_reads_and_writes_inside_the_root(tmp_path: Path, open_path: str) -> None:
    b = _tree(tmp_path)
    assert asyncio.run(b.get("d/t/a/0")) == b"data"
    buf = bytearray(4)
    assert asyncio.run(b.get_into("d/t/a/0", [memoryview(buf)])) == 4 and buf == b"data"
    asyncio.run(b.put("d/t/b/1", [b"new"]))
    assert (tmp_path / "root" / "d" / "t" / "b" / "1").read_bytes() == b"new"
    with pytest.raises(FileNotFoundError):
        asyncio.run(b.get("d/t/a/missing"))
    if open_path == "openat2":
        assert nofollow._openat2_ok is True  # the fast path was taken, not the walk


@pytest.mark.parametrize("key", ["d/t/a/link", "d/t/linkdir/0"])
def test_symbolic_links_are_refused(tmp_path: Path, open_path: str, key: str) -> None:
    b = _tree(tmp_path)
    with pytest.raises(OSError) as ei:
        asyncio.run(b.get(key))
    assert not isinstance(ei.value, FileNotFoundError)
    with pytest.raises(OSError):
        asyncio.run(b.put(key if key.endswith("link") else "d/t/linkdir/new", [b"x"]))
    assert (tmp_path / "outside" / "0").read_bytes() == b"SECR"
    assert not (tmp_path / "outside" / "new").exists()


def test_round_trip_on_either_path(tmp_path: Path, open_path: str) -> None:
    url = str(tmp_path / "ckpt")
    tree: Any = {"a": np.arange(10, dtype=np.float32), "b": {"c": np.ones((3, 4), np.int16)}}
    for layout in ("packed", "chunks"):
        quire.save(url, tree, layout=layout, overwrite=True)
        got: Any = quire.load(url)
        np.testing.assert_array_equal(got["a"], tree["a"])
        np.testing.assert_array_equal(got["b"]["c"], tree["b"]["c"])


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_a_load_opens_each_pack_once_and_closes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[str] = []
    real_open = LocalBackend._open

    def spy(self: LocalBackend, key: str, flags: int, mode: int = 0o644) -> int:
        opened.append(key)
        return real_open(self, key, flags, mode)

    monkeypatch.setattr(LocalBackend, "_open", spy)
    tree = {f"a{i}": np.arange(100 * (i + 1), dtype=np.float32) for i in range(40)}
    url = str(tmp_path / "ckpt")
    with quire.Context(pack_bytes=64 << 10):  # several packs
        quire.save(url, tree)
    packs = sorted(p.name for p in (tmp_path / "ckpt").rglob("p*-*"))
    assert len(packs) > 1
    before = _fds()
    opened.clear()
    got = quire.load(url)
    assert all(np.array_equal(got[k], v) for k, v in tree.items())
    data = sorted(k.rsplit("/", 1)[-1] for k in opened if "-" in k.rsplit("/", 1)[-1])
    assert data == packs  # each pack once, though the load read 40 ranges of them
    assert _fds() == before
    # A damaged chunk fails the load; its descriptors are closed all the same.
    big = max((tmp_path / "ckpt").rglob("p*-*"), key=lambda p: p.stat().st_size)
    raw = bytearray(big.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    big.write_bytes(bytes(raw))
    with pytest.raises(quire.CorruptCheckpointError):
        quire.load(url)
    assert _fds() == before


def test_kept_descriptors_are_bounded_and_outlive_no_read(tmp_path: Path) -> None:
    from quire._store import openfiles as _openfiles

    (tmp_path / "f").write_bytes(b"x")
    files = _openfiles.OpenFiles()

    def opener() -> int:
        return os.open(tmp_path / "f", os.O_RDONLY)

    held = [files.acquire(f"d/t/%packs/p{i}", opener) for i in range(_openfiles.MAX_OPEN + 3)]
    assert [shared for _, shared in held].count(False) == 3  # beyond the bound: not kept
    for fd, _ in held[_openfiles.MAX_OPEN :]:
        os.close(fd)
    fd0, _ = files.acquire("d/t/%packs/p0", opener)
    assert fd0 == held[0][0]  # the same key shares its descriptor
    for i in range(1, _openfiles.MAX_OPEN):
        files.release(f"d/t/%packs/p{i}")
    files.close()  # p0 is still read by two: it stays open until they are done
    assert os.read(fd0, 1) == b"x"
    files.release("d/t/%packs/p0")
    files.release("d/t/%packs/p0")
    with pytest.raises(OSError):
        os.fstat(fd0)
    assert _openfiles.keepable("d/abc/%packs/p00000-00001")
    assert not _openfiles.keepable("d/abc/%packs/p00000.index.json")
    assert not _openfiles.keepable("quire.json")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_a_failed_load_has_finished_its_reads_when_it_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read cannot be stopped once its thread runs it: a load that fails on one damaged
    pack while another pack's read is still running raises only after that read has ended
    (its descriptor closed, nothing of the load still writing into memory)."""
    tree = {f"a{i}": np.arange(2000, dtype=np.float32) + i for i in range(8)}
    url = str(tmp_path / "ckpt")
    with quire.Context(pack_bytes=8 << 10):  # one array per pack
        quire.save(url, tree)
    packs = sorted((tmp_path / "ckpt").rglob("p*-*"), key=lambda p: p.stat().st_size)
    assert len(packs) >= 2
    slow_name, bad = packs[-1].name, packs[-2]
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    bad.write_bytes(bytes(raw))
    real = LocalBackend._get_into
    running: list[str] = []

    def slow(self: LocalBackend, key: str, buffers: Any, offset: int) -> int:
        if key.endswith(slow_name):
            running.append("start")
            time.sleep(0.5)  # still reading when the damaged pack fails the load
            n = real(self, key, buffers, offset)
            running.append("end")
            return n
        return real(self, key, buffers, offset)

    monkeypatch.setattr(LocalBackend, "_get_into", slow)
    before = _fds()
    with pytest.raises(quire.CorruptCheckpointError):
        quire.load(url)
    assert running and running[-1] == "end", running
    assert _fds() == before


def test_no_write_goes_through_a_link(tmp_path: Path, open_path: str) -> None:
    """Every way the backend writes (a streamed pack, a put, the create-if-absent and
    replace-if-unchanged of records) refuses a directory that is a link, and creates
    nothing (not even a directory) where it points."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    os.symlink(outside, root / "d")
    (outside / "rec").write_bytes(b"old")
    b = LocalBackend(str(root))

    async def stream() -> None:
        w = await b.stream_writer("d/x/%packs/p0")
        await w.write([b"pack"], 0)
        await w.close()

    attempts = [
        stream(),
        b.put("d/y/k", [b"put"]),
        b.put_if_absent("d/z/quire.json", b"new"),
        b.replace_if_match("d/rec", b"new", "any"),
    ]
    for coro in attempts:
        with pytest.raises(OSError):
            asyncio.run(coro)
    assert sorted(p.name for p in outside.rglob("*")) == ["rec"]
    assert (outside / "rec").read_bytes() == b"old"
    # The same writes below the root itself succeed.
    asyncio.run(b.put("e/y/k", [b"put"]))
    v = asyncio.run(b.put_if_absent("e/z/quire.json", b"new"))
    asyncio.run(b.replace_if_match("e/z/quire.json", b"newer", v))
    assert (root / "e" / "z" / "quire.json").read_bytes() == b"newer"
    assert sorted(p.name for p in (root / "e" / "z").iterdir()) == ["quire.json"]  # no tmp


def test_no_listing_or_delete_goes_through_a_link(tmp_path: Path, open_path: str) -> None:
    """Listing and deleting (a garbage collection's ``delete_prefix``, ``delete``) refuse a
    directory of the checkpoint that is a link: nothing where it points is listed or
    removed, not even an empty directory."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "d" / "t").mkdir(parents=True)
    (outside / "sub" / "empty").mkdir(parents=True)
    (outside / "victim").write_bytes(b"keep")
    (outside / "sub" / "v2").write_bytes(b"keep")
    os.symlink(outside, root / "d" / "abc")
    os.symlink(outside / "sub", root / "d" / "t" / "s")
    b = LocalBackend(str(root))
    for prefix in ("d/abc", "d/abc/sub", "d/t/s"):
        with pytest.raises(OSError):
            asyncio.run(b.list(prefix))
        with pytest.raises(OSError):
            asyncio.run(b.delete_prefix(prefix))
    for key in ("d/abc/victim", "d/t/s/v2", "d/abc/sub/empty/x"):
        with pytest.raises(OSError):
            asyncio.run(b.delete([key]))
    assert sorted(str(p.relative_to(outside)) for p in outside.rglob("*")) == [
        "sub", "sub/empty", "sub/v2", "victim"
    ]
    # Inside the root the same calls work, and a listing never descends into a link.
    (root / "d" / "t" / "k").write_bytes(b"x")
    assert asyncio.run(b.list("d/t")) == ["d/t/k", "d/t/s"]
    asyncio.run(b.delete(["d/t/k", "d/t/s"]))
    assert not (root / "d" / "t").exists() and (outside / "sub" / "v2").exists()
