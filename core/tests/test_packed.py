"""Format version 2 (packed data): plain-zarr interop through fsspec's reference file
system, chunk identity binding (swapped, moved and foreign chunks), zarr.json checks,
object counts, pack sizes, the layout switch and the partial-save journal."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json
import shutil
from pathlib import Path
from typing import Any

import fsspec
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import zarr
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from jax.sharding import NamedSharding as NS
from jax.sharding import PartitionSpec as P
from zarr.storage import FsspecStore

import quire
from quire._cli.main import main
from quire.errors import CorruptCheckpointError


def mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    n = int(np.prod(shape))
    return jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def _tree() -> dict[str, Any]:
    x = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32)
    return {
        "f32": np.arange(24, dtype=np.float32).reshape(4, 6),
        "bf16": np.arange(24, dtype=np.float32).reshape(4, 6).astype(ml_dtypes.bfloat16),
        "i8": np.arange(-5, 5, dtype=np.int8),
        "c64": np.array([1 + 2j, 3 - 4j], np.complex64),
        "b": np.array([True, False, True]),
        "f8": np.arange(8, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn),
        "empty": np.zeros((0, 3), np.float64),
        "scalar0d": np.float64(2.5) * np.ones(()),
        "rows": jax.device_put(x, NS(mesh((8,), ("d",)), P("d"))),
        "grid": jax.device_put(x, NS(mesh((4, 2), ("a", "b")), P("a", "b"))),
        "key": jax.random.key(3),
        "step": 7,
        "name": "run",
    }


def _indexes(url: str) -> list[dict[str, Any]]:
    return json.loads(Path(url, "quire.json").read_text())["indexes"]


def _plain_zarr_open(root: str, index: dict[str, Any], location: str) -> zarr.Array:
    """What a reader with fsspec and zarr only does (no quire code)."""
    remote = DirFileSystem(
        path=root,
        fs=AsyncFileSystemWrapper(LocalFileSystem(), asynchronous=True),
        asynchronous=True,
    )
    fs = fsspec.filesystem("reference", fo=index, fs={None: remote}, asynchronous=True)
    return zarr.open_array(FsspecStore(fs, path=location, read_only=True), mode="r")


def _verify(url: str) -> tuple[int, list[Any]]:
    from quire._engine import verify as _verify_engine
    from quire._runtime import ioloop as _io

    return _io.submit(_verify_engine.verify(url)).result()


def test_plain_zarr_reads_every_leaf_kind_through_the_reference_filesystem(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    tree = _tree()
    tree["zstd"] = np.arange(1000, dtype=np.float32)
    tree["sharded"] = jax.device_put(
        jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32), NS(mesh((2,), ("d",)), P("d"))
    )

    def storage(path: Any, leaf: Any) -> quire.StorageOptions | None:
        if path[-1] == "zstd":
            return quire.StorageOptions(codecs=["zstd"])
        if path[-1] == "sharded":  # 4 KiB shards split into 1 KiB inner chunks
            return quire.StorageOptions(chunk_bytes=1024)
        return None

    quire.save(url, tree, storage=storage)
    meta = quire.metadata(url)
    assert meta.format_version == 2
    assert "inner_shape" in json.dumps(meta.record, default=str)  # a zarr sharded array
    (entry,) = _indexes(url)
    index = json.loads(Path(url, entry["object"]).read_text())
    opened = 0
    for name, leaf in meta.tree.items():
        if not getattr(leaf, "location", None):
            continue
        arr = _plain_zarr_open(url, index, leaf.location)
        want = tree[name]
        if name == "key":
            want = jax.random.key_data(want)
        got = arr[...]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        opened += 1
    assert opened == 12  # every array leaf (the 0-d array is stored inline)
    # quire.zarr_store gives the same for either layout.
    quire.save(str(tmp_path / "v1"), tree, storage=storage, layout="chunks")
    for u in (url, str(tmp_path / "v1")):
        store = quire.zarr_store(u)
        loc = quire.metadata(u).tree["grid"].location
        got = zarr.open_array(store, path=loc, mode="r")[...]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(tree["grid"]))


def test_objects_per_checkpoint_and_pack_size(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    tree = {f"w{i}": np.full((64, 64), i, np.float32) for i in range(100)}  # 100 x 16 KiB
    quire.save(url, tree)
    files = [p for p in Path(url).rglob("*") if p.is_file()]
    assert len(files) == 3  # quire.json, one pack, one index
    url2 = str(tmp_path / "small")
    with quire.Context(pack_bytes=200_000):
        quire.save(url2, tree)
    packs = sorted(p for p in Path(url2).rglob("p00000-*"))
    assert len(packs) == 9 and all(p.stat().st_size <= 200_000 for p in packs)
    got = quire.load(url2)
    assert all(np.array_equal(got[k], v) for k, v in tree.items())
    assert _verify(url2) == (200, [])  # every chunk and every array's zarr.json
    quire.save(str(tmp_path / "v1"), tree, layout="chunks")
    assert quire.metadata(str(tmp_path / "v1")).format_version == 1
    assert len([p for p in Path(tmp_path / "v1").rglob("*") if p.is_file()]) == 201


def _refs(url: str) -> tuple[Path, dict[str, Any]]:
    (entry,) = _indexes(url)
    return Path(url), json.loads(Path(url, entry["object"]).read_text())["refs"]


def _swap(root: Path, a: list[Any], b: list[Any]) -> None:
    assert a[2] == b[2]
    pa, pb = root / a[0], root / b[0]
    da, db = pa.read_bytes(), pb.read_bytes()
    xa, xb = da[a[1] : a[1] + a[2]], db[b[1] : b[1] + b[2]]
    if pa == pb:
        buf = bytearray(da)
        buf[a[1] : a[1] + a[2]], buf[b[1] : b[1] + b[2]] = xb, xa
        pa.write_bytes(bytes(buf))
    else:  # pragma: no cover - one pack in these tests
        raise AssertionError


def _assert_refused(url: str, key: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=key):
        quire.load(url)
    _, problems = _verify(url)
    assert problems and any(key.strip("'") == p.path for p in problems), problems
    assert main(["verify", url]) != 0


def test_swapped_chunks_of_one_array_are_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)
    quire.save(url, {"x": jax.device_put(x, NS(mesh((8,), ("d",)), P("d")))})
    root, refs = _refs(url)
    loc = quire.metadata(url).tree["x"].location
    _swap(root, refs[f"{loc}/c/0/0"], refs[f"{loc}/c/3/0"])  # each chunk's own crc still valid
    _assert_refused(url, "'x'")


def test_chunks_swapped_between_arrays_are_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    a = np.arange(32, dtype=np.float32)
    b = np.arange(64, dtype=np.float32).astype(ml_dtypes.bfloat16)  # the same byte size
    quire.save(url, {"a": a, "b": b})
    root, refs = _refs(url)
    tree = quire.metadata(url).tree
    _swap(root, refs[f"{tree['a'].location}/c/0"], refs[f"{tree['b'].location}/c/0"])
    with pytest.raises(CorruptCheckpointError):
        quire.load(url)
    _, problems = _verify(url)
    assert {p.path for p in problems} == {"a", "b"}


def test_foreign_pack_from_another_checkpoint_of_the_same_tree_is_refused(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    quire.save(a, {"w": np.zeros((16, 16), np.float32), "v": np.ones(8, np.int32)})
    quire.save(b, {"w": np.ones((16, 16), np.float32), "v": np.zeros(8, np.int32)})
    ra, refa = _refs(a)
    rb, refb = _refs(b)
    pa = ra / next(v[0] for v in refa.values() if isinstance(v, list))
    pb = rb / next(v[0] for v in refb.values() if isinstance(v, list))
    assert pa.stat().st_size == pb.stat().st_size
    shutil.copyfile(pb, pa)  # every chunk has a valid crc32c, at the right offsets
    with pytest.raises(CorruptCheckpointError):
        quire.load(a)
    _, problems = _verify(a)
    assert {p.path for p in problems} == {"w", "v"}
    # A whole foreign index + packs: the record's crc32c of the index refuses it.
    ia, ib = _indexes(a)[0]["object"], _indexes(b)[0]["object"]
    Path(a, ia).write_bytes(Path(b, ib).read_bytes())
    with pytest.raises(CorruptCheckpointError, match="chunk index"):
        quire.load(a)


@pytest.mark.parametrize("layout", ["packed", "chunks"])
def test_corrupt_zarr_json_fails_verify(tmp_path: Path, layout: str) -> None:
    url = str(tmp_path / "c")
    quire.save(url, {"w": np.arange(10, dtype=np.float32)}, layout=layout)
    loc = quire.metadata(url).tree["w"].location
    assert _verify(url) == (2, [])  # the chunk and the zarr.json
    if layout == "chunks":
        p = Path(url, loc, "zarr.json")
        doc = json.loads(p.read_text())
        doc["shape"] = [11]  # valid JSON, a different array for zarr readers
        p.write_text(json.dumps(doc))
    else:
        root, _ = _refs(url)
        entry = _indexes(url)[0]
        ip = root / entry["object"]
        index = json.loads(ip.read_text())
        index["refs"][f"{loc}/zarr.json"] = index["refs"][f"{loc}/zarr.json"].replace(
            '"shape": [10]', '"shape": [11]'
        )
        ip.write_text(json.dumps(index))
    _, problems = _verify(url)
    assert problems and all(p.path == "w" for p in problems)
    assert any("zarr" in p.object for p in problems), problems


def test_partial_save_journal_on_packs(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    quire.partial.save(url, {"a": np.arange(4.0), "b": np.ones(3)})
    quire.partial.save(url, {"b": np.zeros(3), "c": jnp.arange(8)})
    got = quire.partial.load(url)
    assert np.array_equal(got["b"], np.zeros(3)) and np.array_equal(got["c"], np.arange(8))
    quire.partial.finalize(url)
    assert quire.metadata(url).format_version == 2
    got = quire.load(url)
    assert np.array_equal(got["a"], np.arange(4.0)) and np.array_equal(got["b"], np.zeros(3))
    assert _verify(url)[1] == []


def test_load_reads_only_its_own_index(tmp_path: Path) -> None:
    """An index naming a second process's (absent) index object is never read when the
    loader finds every chunk in its own."""
    from quire._engine import load as _load
    from quire._format import chunkindex as _chunkindex
    from quire._runtime import ioloop as _io
    from quire._store.url import open_backend

    url = str(tmp_path / "c")
    quire.save(url, {"w": np.arange(10.0)})
    entry = _indexes(url)[0]
    other = {**entry, "process": 1, "object": _chunkindex.index_key(entry["txid"], 1)}
    backend = open_backend(url)
    idx = _chunkindex.ChunkIndex(backend, url, [entry, other], 0)
    loc = quire.metadata(url).tree["w"].location

    found = _io.submit(idx.lookup(f"{loc}/c/0")).result()
    assert found is not None and found.length == 84  # 80 bytes + the chunk's crc32c
    assert idx.loaded == [entry["object"]]
    # A key its own index lacks sends it to the others' (here: absent -> corrupt).
    with pytest.raises(_chunkindex.ChunkError, match="missing"):
        _io.submit(idx.lookup(f"{loc}/c/9")).result()
    assert _load.packed_view(backend, url, {}) is backend


def test_adjacent_chunk_reads_are_coalesced(tmp_path: Path) -> None:
    """A load of an array whose 8 chunks lie back to back in one pack sends few range
    requests (the concurrent reads of adjacent ranges are merged), not one per chunk."""
    from quire._format import packedreader as _packedreader

    url = str(tmp_path / "c")
    x = jnp.arange(8 * 1024, dtype=jnp.float32).reshape(8, 1024)
    quire.save(url, {"x": jax.device_put(x, NS(mesh((8,), ("d",)), P("d")))})
    made: list[Any] = []
    orig = _packedreader.reader

    def spy(*a: Any, **k: Any) -> Any:
        made.append(orig(*a, **k))
        return made[-1]

    _packedreader.reader = spy  # type: ignore[assignment]
    try:
        got = quire.load(url, {"x": jax.ShapeDtypeStruct(x.shape, x.dtype)})
    finally:
        _packedreader.reader = orig  # type: ignore[assignment]
    assert np.array_equal(np.asarray(got["x"]), np.asarray(x))
    assert 1 <= made[0].requests < 8
