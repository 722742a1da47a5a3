"""Integrity tests: zarr/tensorstore interop, chunk corruption, malformed commit records,
and key-path escaping.

Every array leaf quire writes must be a plain zarr v3 array; every damaged chunk must
raise ``CorruptCheckpointError`` naming the leaf's key path (never return wrong data);
every malformed ``quire.json`` must be refused before anything is allocated or read
outside the checkpoint; and no key can make quire write outside the checkpoint directory.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json
import math
import time
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
import zarr
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import quire
from quire.errors import CorruptCheckpointError, QuireError
from quire.metadata import LeafMetadata


@pytest.fixture(autouse=True)
def _v1_layout() -> Any:
    """These tests damage and inspect format-v1 chunk objects (one object per chunk, the
    layout tensorstore reads); format v2 has its own in test_packed.py."""
    with quire.Context(layout="chunks"):
        yield


# ----------------------------------------------------------------------------- helpers

NUMPY_DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]
ML_DTYPES = ["bfloat16", "float8_e4m3fn", "float8_e5m2"]
ALL_DTYPES = NUMPY_DTYPES + ML_DTYPES


def _dtype(name: str) -> np.dtype[Any]:
    return np.dtype(getattr(ml_dtypes, name)) if name in ML_DTYPES else np.dtype(name)


def _data(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Deterministic values spanning the dtype's range (specials included for floats);
    always an ``ndarray`` (0-d included: numpy scalars are inline leaves, not arrays)."""
    return np.asarray(_values(name, shape, seed))


def _values(name: str, shape: tuple[int, ...], seed: int) -> Any:
    rng = np.random.default_rng(seed)
    dt = _dtype(name)
    if dt.kind == "b":
        return rng.random(shape) > 0.5
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    if dt.kind == "c":
        real = rng.standard_normal(shape) * 100
        imag = rng.standard_normal(shape) * 100
        return (real + 1j * imag).astype(dt)
    vals = rng.standard_normal(shape) * 10
    flat = vals.reshape(-1)
    specials = [np.nan, np.inf, -np.inf, -0.0, 0.0]
    flat[: min(len(specials), flat.size)] = specials[: flat.size]
    with np.errstate(over="ignore", invalid="ignore"):
        return vals.astype(dt)


def _same(got: Any, want: np.ndarray) -> None:
    """Bit-exact equality, dtype and shape included (NaNs compare by their bits)."""
    got = np.asarray(got)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def _mesh8() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]), ("x",))


def _mesh42() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))


def _leaves(tree: Any) -> dict[str, Any]:
    """``{"a/b": leaf}`` over a tree of dicts/lists whose leaves are not containers."""
    out: dict[str, Any] = {}

    def go(x: Any, path: tuple[Any, ...]) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                go(v, (*path, k))
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                go(v, (*path, i))
        else:
            out["/".join(map(str, path))] = x

    go(tree, ())
    return out


def _record(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "quire.json").read_bytes())


def _write_record(ckpt: Path, doc: Any) -> None:
    """Write an edited record as a (buggy) writer would: with a matching checksum, so the
    structural validation is what must catch it (a stale checksum is tested separately)."""
    if isinstance(doc, dict) and "checksum" in doc:
        from quire._format.record import record_checksum

        try:
            doc = {**doc, "checksum": record_checksum(doc)}
        except (TypeError, ValueError):
            doc = {k: v for k, v in doc.items() if k != "checksum"}
    (ckpt / "quire.json").write_text(json.dumps(doc))


def _chunk_files(ckpt: Path, location: str) -> list[Path]:
    root = ckpt / location
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != "zarr.json")


def _zarr_codec_names(ckpt: Path, location: str) -> list[str]:
    meta = json.loads((ckpt / location / "zarr.json").read_text())
    return [c["name"] for c in meta["codecs"]]


needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")


# ----------------------------------------------------------------------------- 1. zarr interop

STORAGES = {
    "default": quire.StorageOptions(),
    "zstd": quire.StorageOptions(codecs=["zstd"]),
    "gzip": quire.StorageOptions(codecs=["gzip"]),
    "blosc": quire.StorageOptions(codecs=["blosc"]),
    "sharded": quire.StorageOptions(chunk_bytes=64),
    "sharded+zstd": quire.StorageOptions(chunk_bytes=64, codecs=["zstd"]),
    "sharded+blosc": quire.StorageOptions(chunk_bytes=64, codecs=["blosc"]),
    "no-checksum": quire.StorageOptions(checksum=False),
    "no-checksum+sharded+gzip": quire.StorageOptions(
        checksum=False, chunk_bytes=64, codecs=["gzip"]
    ),
}


def _interop_tree() -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(tree to save, expected host values by key path)."""
    tree: dict[str, Any] = {"np": {}, "scalar": {}, "empty": {}, "jax": {}}
    for name in ALL_DTYPES:
        tree["np"][name] = _data(name, (8, 6))
        tree["scalar"][name] = _data(name, (), seed=1)
        tree["empty"][name] = _data(name, (0, 3))
    tree["empty"]["trailing0"] = np.zeros((4, 0), np.float32)
    tree["np"]["odd_3d"] = _data("float32", (5, 3, 7), seed=2)
    if jax.device_count() >= 8:
        m8, m42 = _mesh8(), _mesh42()
        tree["jax"] = {
            "x8": jax.device_put(_data("float32", (64, 16), 3), NamedSharding(m8, P("x"))),
            "x8_cols": jax.device_put(_data("int32", (4, 64), 4), NamedSharding(m8, P(None, "x"))),
            "bf16_x8": jax.device_put(_data("bfloat16", (32, 8), 5), NamedSharding(m8, P("x"))),
            "mesh42": jax.device_put(
                _data("float32", (64, 16), 6), NamedSharding(m42, P("x", "y"))
            ),
            "mesh42_yx": jax.device_put(
                _data("float64", (8, 12), 7), NamedSharding(m42, P("y", "x"))
            ),
            # replicated over 'y': only replica 0 of each shard writes
            "mesh42_partial_repl": jax.device_put(
                _data("uint16", (16, 6), 8), NamedSharding(m42, P("x", None))
            ),
            "replicated": jax.device_put(_data("complex64", (6, 5), 9), NamedSharding(m42, P())),
            "scalar": jax.device_put(np.float32(3.5)),
        }
    expected = {k: np.asarray(v) for k, v in _leaves(tree).items()}
    return tree, expected


@pytest.mark.parametrize("storage_name", list(STORAGES))
def test_every_array_opens_with_plain_zarr(tmp_path: Path, storage_name: str) -> None:
    storage = STORAGES[storage_name]
    tree, expected = _interop_tree()
    url = tmp_path / "ckpt"
    quire.save(url, tree, storage=storage)
    meta = _leaves(quire.metadata(url).tree)
    assert set(meta) == set(expected)
    saw_sharding_codec = False
    for key, want in expected.items():
        leaf = meta[key]
        assert isinstance(leaf, LeafMetadata), key
        assert leaf.shape == want.shape and leaf.dtype == want.dtype, key
        arr = zarr.open_array(str(url / leaf.location), mode="r")
        assert arr.shape == want.shape, key
        assert np.dtype(arr.dtype) == want.dtype, (key, arr.dtype)
        _same(arr[...], want)
        names = _zarr_codec_names(url, leaf.location)
        saw_sharding_codec |= names == ["sharding_indexed"]
        if storage.checksum and names != ["sharding_indexed"]:
            assert names[-1] == "crc32c", (key, names)
        if not storage.checksum:
            assert "crc32c" not in json.dumps(
                json.loads((url / leaf.location / "zarr.json").read_text())
            ), key
    if storage.chunk_bytes is not None:
        assert saw_sharding_codec, (
            "chunk_bytes never produced a zarr shard (sharding_indexed codec)"
        )
    # and quire itself reads back what it wrote
    got = _leaves(quire.load(url))
    for key, want in expected.items():
        _same(got[key], want)


@needs8
def test_chunk_grid_follows_device_shards(tmp_path: Path) -> None:
    m42 = _mesh42()
    x = jax.device_put(_data("float32", (64, 16)), NamedSharding(m42, P("x", "y")))
    url = tmp_path / "ckpt"
    quire.save(url, {"x": x})
    leaf = quire.metadata(url).tree["x"]
    zmeta = json.loads((url / leaf.location / "zarr.json").read_text())
    assert zmeta["chunk_grid"]["configuration"]["chunk_shape"] == [16, 8]
    files = _chunk_files(url, leaf.location)
    assert len(files) == 8
    arr = zarr.open_array(str(url / leaf.location), mode="r")
    _same(arr[16:32, 8:16], np.asarray(x)[16:32, 8:16])


@pytest.mark.parametrize("storage_name", ["default", "sharded+zstd", "no-checksum", "blosc"])
def test_tensorstore_opens_arrays(tmp_path: Path, storage_name: str) -> None:
    ts = pytest.importorskip("tensorstore", reason="tensorstore is not installed")
    tree, expected = _interop_tree()
    url = tmp_path / "ckpt"
    quire.save(url, tree, storage=STORAGES[storage_name])
    meta = _leaves(quire.metadata(url).tree)
    for key, want in expected.items():
        path = str(url / meta[key].location)
        store = ts.open(
            {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}, open=True
        ).result()
        got = store.read().result()
        assert tuple(store.shape) == want.shape, key
        _same(got, want)


# ----------------------------------------------------------------------------- 2. corruption


def _flip(pos: str):
    def f(p: Path) -> None:
        b = bytearray(p.read_bytes())
        assert b, p
        i = {"first": 0, "middle": len(b) // 2, "last": len(b) - 1}[pos]
        b[i] ^= 0x40
        p.write_bytes(bytes(b))

    return f


def _truncate(keep: str):
    def f(p: Path) -> None:
        b = p.read_bytes()
        n = {"half": len(b) // 2, "minus1": len(b) - 1, "zero": 0, "three": 3}[keep]
        p.write_bytes(b[:n])

    return f


def _append(p: Path) -> None:
    with open(p, "ab") as f:
        f.write(b"\x00garbage\xff" * 3)


def _delete(p: Path) -> None:
    p.unlink()


MUTATIONS = {
    "flip-first": _flip("first"),
    "flip-middle": _flip("middle"),
    "flip-last": _flip("last"),
    "truncate-half": _truncate("half"),
    "truncate-1": _truncate("minus1"),
    "truncate-3": _truncate("three"),
    "truncate-0": _truncate("zero"),
    "append": _append,
    "delete": _delete,
}
STRUCTURAL = ["truncate-half", "truncate-1", "truncate-0", "append", "delete"]

CORRUPT_STORAGES = {
    "raw": quire.StorageOptions(),
    "zstd": quire.StorageOptions(codecs=["zstd"]),
    "gzip": quire.StorageOptions(codecs=["gzip"]),
    "blosc": quire.StorageOptions(codecs=["blosc"]),
    "sharded": quire.StorageOptions(chunk_bytes=256),
    "sharded+zstd": quire.StorageOptions(chunk_bytes=256, codecs=["zstd"]),
}

CASES = [(s, m) for s in CORRUPT_STORAGES for m in MUTATIONS] + [
    # Without checksums, structural damage to raw chunks must still be caught (sizes are exact).
    ("raw-nocrc", m)
    for m in STRUCTURAL
]
CORRUPT_STORAGES["raw-nocrc"] = quire.StorageOptions(checksum=False)


def _assert_corrupt(
    url: Path, abstract: Any = None, key: str = "params/w", **kw: Any
) -> CorruptCheckpointError:
    with pytest.raises(CorruptCheckpointError) as ei:
        quire.load(url, abstract, **kw)
    msg = str(ei.value)
    assert key in msg, msg
    return ei.value


def _save_simple(tmp_path: Path, storage: quire.StorageOptions, w: Any = None) -> tuple[Path, str]:
    url = tmp_path / "ckpt"
    w = _data("float32", (32, 16)) if w is None else w
    tree = {"params": {"w": w, "b": np.arange(5, dtype=np.int32)}, "step": 7}
    quire.save(url, tree, storage=storage)
    return url, quire.metadata(url).tree["params"]["w"].location


@pytest.mark.parametrize(("storage_name", "mutation"), CASES)
def test_corrupt_chunk_raises(tmp_path: Path, storage_name: str, mutation: str) -> None:
    storage = CORRUPT_STORAGES[storage_name]
    url, loc = _save_simple(tmp_path, storage)
    if storage.chunk_bytes:
        assert _zarr_codec_names(url, loc) == ["sharding_indexed"]
    (chunk,) = _chunk_files(url, loc)
    MUTATIONS[mutation](chunk)
    _assert_corrupt(url)
    _assert_corrupt(
        url,
        {"params": {"w": np.zeros((32, 16), np.float32), "b": np.zeros(5, np.int32)}, "step": 0},
    )
    # The damage is confined to that leaf: the others still load.
    got = quire.load(url, {"params": {"b": np.zeros(5, np.int32)}, "step": 0}, partial=True)
    np.testing.assert_array_equal(got["params"]["b"], np.arange(5))


def _shard_parts(storage: quire.StorageOptions, shard: bytes, n_inner: int) -> tuple[int, int]:
    """(start of the index, length of the index incl. crc) of a zarr shard."""
    ilen = n_inner * 16 + (4 if storage.checksum else 0)
    return len(shard) - ilen, ilen


SHARD_STORAGES = {
    "sharded": quire.StorageOptions(chunk_bytes=256),
    "sharded+zstd": quire.StorageOptions(chunk_bytes=256, codecs=["zstd"]),
    "sharded-nocrc": quire.StorageOptions(chunk_bytes=256, checksum=False),
    "sharded+gzip-nocrc": quire.StorageOptions(chunk_bytes=256, codecs=["gzip"], checksum=False),
}
BYTE_FLIPS = ["inner-chunk-0", "inner-chunk-last", "index-entry", "index-crc"]
LYING_INDEX = ["index-offset-out", "index-missing"]  # self-consistent (crc recomputed)
SHARD_CASES = [
    (s, w)
    for s, opts in SHARD_STORAGES.items()
    # byte flips are undetectable without checksums; a lying index is not
    for w in (BYTE_FLIPS if opts.checksum else []) + LYING_INDEX
]


@pytest.mark.parametrize(("storage_name", "where"), SHARD_CASES)
def test_corrupt_zarr_shard(tmp_path: Path, storage_name: str, where: str) -> None:
    storage = SHARD_STORAGES[storage_name]
    url, loc = _save_simple(tmp_path, storage)
    zmeta = json.loads((url / loc / "zarr.json").read_text())
    inner = zmeta["codecs"][0]["configuration"]["chunk_shape"]
    n_inner = math.prod(
        c // i for c, i in zip(zmeta["chunk_grid"]["configuration"]["chunk_shape"], inner)
    )
    assert n_inner > 1
    (shard,) = _chunk_files(url, loc)
    b = bytearray(shard.read_bytes())
    istart, _ = _shard_parts(storage, bytes(b), n_inner)
    index = (
        np.frombuffer(bytes(b[istart : istart + n_inner * 16]), "<u8").reshape(n_inner, 2).copy()
    )
    if where == "inner-chunk-0":
        b[int(index[0, 0]) + 1] ^= 0x01
    elif where == "inner-chunk-last":
        off, nb = (int(v) for v in index[-1])
        b[off + nb - 1] ^= 0x80  # the inner chunk's crc32c
    elif where == "index-entry":
        b[istart + 8] ^= 0x01  # nbytes of inner chunk 0
    elif where == "index-crc":
        b[-1] ^= 0x01
    else:
        # A self-consistent index (crc recomputed) that lies: out-of-range offset, or a
        # chunk marked missing (2**64-1, 2**64-1).
        if where == "index-offset-out":
            index[1, 0] = len(b) * 4
        else:
            index[1] = (2**64 - 1, 2**64 - 1)
        raw = index.astype("<u8").tobytes()
        b[istart : istart + len(raw)] = raw
        if storage.checksum:
            b[istart + len(raw) : istart + len(raw) + 4] = _crc32c(raw).to_bytes(4, "little")
    shard.write_bytes(bytes(b))
    _assert_corrupt(url)


def _crc32c(data: bytes) -> int:
    try:
        from crc32c import crc32c
    except ImportError:  # pragma: no cover
        import google_crc32c

        return int(google_crc32c.value(data))
    return int(crc32c(data))


def test_crc32c_helper_matches_zarr() -> None:
    """Sanity: the crc used to forge index checksums above is zarr's crc32c."""
    from zarr.codecs import Crc32cCodec

    assert Crc32cCodec is not None
    assert _crc32c(b"123456789") == 0xE3069283
    assert zlib.crc32(b"123456789") != 0xE3069283  # not plain crc32


@needs8
@pytest.mark.parametrize("storage_name", ["raw", "sharded+zstd"])
@pytest.mark.parametrize("target", ["saved", "mesh42", "cols", "single", "numpy", "cast"])
@pytest.mark.parametrize("mutation", ["flip-middle", "truncate-half", "delete"])
def test_corrupt_sharded_jax_array_any_target(
    tmp_path: Path, storage_name: str, target: str, mutation: str
) -> None:
    storage = CORRUPT_STORAGES[storage_name]
    w = jax.device_put(_data("float32", (64, 16)), NamedSharding(_mesh8(), P("x")))
    url, loc = _save_simple(tmp_path, storage, w)
    files = _chunk_files(url, loc)
    assert len(files) == 8
    MUTATIONS[mutation](files[5])
    m42 = _mesh42()
    w_target = {
        "saved": jax.ShapeDtypeStruct((64, 16), np.float32, sharding=w.sharding),
        "mesh42": jax.ShapeDtypeStruct(
            (64, 16), np.float32, sharding=NamedSharding(m42, P("y", "x"))
        ),
        "cols": jax.ShapeDtypeStruct(
            (64, 16), np.float32, sharding=NamedSharding(_mesh8(), P(None, "x"))
        ),
        "single": jax.ShapeDtypeStruct(
            (64, 16), np.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[3])
        ),
        "numpy": np.zeros((64, 16), np.float32),
        "cast": jax.ShapeDtypeStruct(
            (64, 16), jax.numpy.bfloat16, sharding=NamedSharding(m42, P("x", "y"))
        ),
    }[target]
    abstract = {"params": {"w": w_target, "b": np.zeros(5, np.int32)}, "step": 0}
    _assert_corrupt(url, abstract)
    if target == "saved":
        _assert_corrupt(url)


@pytest.mark.parametrize("mutation", ["flip-first", "truncate-1", "append", "delete"])
def test_corrupt_scalar_array_chunk(tmp_path: Path, mutation: str) -> None:
    url, loc = _save_simple(tmp_path, quire.StorageOptions(), np.array(2.5, np.float64))
    (chunk,) = _chunk_files(url, loc)
    assert chunk.name == "c"
    MUTATIONS[mutation](chunk)
    _assert_corrupt(url)
    _assert_corrupt(url, {"params": {"w": float, "b": np.ndarray}, "step": int})


def test_corrupt_chunk_load_async(tmp_path: Path) -> None:
    url, loc = _save_simple(tmp_path, quire.StorageOptions())
    MUTATIONS["flip-middle"](_chunk_files(url, loc)[0])
    with pytest.raises(CorruptCheckpointError, match="params/w"):
        quire.load_async(url).result(timeout=30)


# ----------------------------------------------------------------------------- 3. malformed quire.json


@pytest.fixture
def good_ckpt(tmp_path: Path) -> Path:
    url = tmp_path / "outer" / "ckpt"
    quire.save(
        url, {"params": {"w": _data("float32", (4, 3)), "n": 3}, "name": "x"}, metadata={"k": 1}
    )
    return url


def _tree_holder(doc: dict[str, Any]) -> dict[str, Any]:
    """The object holding the pytree's ``"tree"`` (top level, or the ``pytree`` unit)."""
    if "tree" in doc:
        return doc
    units = doc["units"]
    return units.get("pytree") or next(u for u in units.values() if u.get("kind") == "pytree")


def _tree(doc: dict[str, Any]) -> dict[str, Any]:
    return _tree_holder(doc)["tree"]


def _w_leaf(doc: dict[str, Any]) -> dict[str, Any]:
    params = _tree(doc)["children"][_tree(doc)["keys"].index("params")]
    return params["children"][params["keys"].index("w")]


def _edit(fn):
    def apply(doc: dict[str, Any]) -> Any:
        fn(doc)
        return doc

    return apply


def _set_w(field: str, value: Any):
    return _edit(lambda d: _w_leaf(d).__setitem__(field, value))


def _deep_tree(node: dict[str, Any], depth: int) -> dict[str, Any]:
    for _ in range(depth):
        node = {"kind": "list", "children": [node]}
    return node


RAW_DEFECTS = {
    "empty": lambda raw: b"",
    "truncated": lambda raw: raw[: len(raw) // 2],
    "truncated-1": lambda raw: raw[:-1],
    "not-json": lambda raw: b"this is not json",
    "binary": lambda raw: b"\xff\xfe\x00\x01" * 10,
    "nul-padded": lambda raw: b"\x00" * len(raw),
    "nested-deep": lambda raw: b"[" * 100_000 + b"]" * 100_000,
}

DOC_DEFECTS = {
    "list-doc": lambda d: [d],
    "string-doc": lambda d: "quire",
    "null-doc": lambda d: None,
    "no-format": _edit(lambda d: d.pop("format")),
    "wrong-format": _edit(lambda d: d.__setitem__("format", "orbax")),
    "version-str": _edit(lambda d: d.__setitem__("version", "1")),
    "version-float": _edit(lambda d: d.__setitem__("version", 1.0)),
    "version-bool": _edit(lambda d: d.__setitem__("version", True)),
    "version-0": _edit(lambda d: d.__setitem__("version", 0)),
    "no-version": _edit(lambda d: d.pop("version")),
    "tree-list": _edit(lambda d: _tree_holder(d).__setitem__("tree", [])),
    "tree-str": _edit(lambda d: _tree_holder(d).__setitem__("tree", "dict")),
    "tree-missing": _edit(lambda d: _tree_holder(d).pop("tree")),
    "tree-too-deep": _edit(
        lambda d: _tree_holder(d).__setitem__("tree", _deep_tree(_tree(d), 300))
    ),
    "tree-bad-kind": _edit(lambda d: _tree(d).__setitem__("kind", "set")),
    "keys-not-strings": _edit(lambda d: _tree(d).__setitem__("keys", [1.5, "x"])),
    "keys-not-list": _edit(lambda d: _tree(d).__setitem__("keys", "params")),
    "keys-too-few": _edit(lambda d: _tree(d).__setitem__("keys", ["params"])),
    "keys-duplicate": _edit(lambda d: _tree(d).__setitem__("keys", ["params", "params"])),
    "children-not-list": _edit(lambda d: _tree(d).__setitem__("children", {"a": 1})),
    "leaf-no-handler": _edit(lambda d: _w_leaf(d).pop("handler")),
    "txids-str": _edit(lambda d: d.__setitem__("txids", d["txids"][0])),
    "txids-dict": _edit(lambda d: d.__setitem__("txids", {"a": 1})),
    "txids-ints": _edit(lambda d: d.__setitem__("txids", [1])),
    "txids-path": _edit(lambda d: d.__setitem__("txids", ["../../x"])),
    "metadata-list": _edit(lambda d: d.__setitem__("metadata", [])),
    "created-bad": _edit(lambda d: d.__setitem__("created", "yesterday")),
    "process-count-str": _edit(lambda d: d.__setitem__("process_count", "1")),
    # leaf records
    "shape-strings": _set_w("shape", ["4", "3"]),
    "shape-floats": _set_w("shape", [4.0, 3.0]),
    "shape-bools": _set_w("shape", [True, True]),
    "shape-not-list": _set_w("shape", "4,3"),
    "shape-null": _set_w("shape", None),
    "shape-negative": _set_w("shape", [-4, 3]),
    "shape-negative-both": _set_w("shape", [-4, -3]),
    "shape-rank-mismatch": _set_w("shape", [4, 3, 1]),
    "chunk-shape-zero": _set_w("chunk_shape", [0, 3]),
    "chunk-shape-strings": _set_w("chunk_shape", ["4", "3"]),
    "dtype-unknown": _set_w("dtype", "object"),
    "dtype-pickle": _set_w("dtype", "O"),
    "dtype-not-str": _set_w("dtype", 5),
    "codecs-not-list": _set_w("codecs", "zstd"),
    "codec-no-name": _set_w("codecs", [{"configuration": {}}]),
    "checksum-str": _set_w("checksum", "yes"),
    "inner-shape-bad": _set_w("inner_shape", [3, 3]),
    "location-missing": _edit(lambda d: _w_leaf(d).pop("location")),
    "location-int": _set_w("location", 5),
    # claims that disagree with the stored chunk
    "shape-larger-than-data": _set_w("shape", [8, 3]),
    "dtype-wider-than-data": _set_w("dtype", "float64"),
}

ESCAPING_LOCATIONS = [
    "d/../../etc/passwd",
    "d/../../outside",
    "../outside",
    "/etc/passwd",
    "d/x/../../../outside",
    "d//etc/passwd",
    "d/./x",
    "d\\..\\..\\outside",
    "d/x\x00/y",
    "quire.json",
    "",
]


def _assert_refused(url: Path, *, expect_upgrade: bool = False) -> CorruptCheckpointError:
    t0 = time.monotonic()
    with pytest.raises(CorruptCheckpointError) as ei:
        quire.load(url)
    assert time.monotonic() - t0 < 5
    msg = str(ei.value)
    assert str(url) in msg, msg
    if expect_upgrade:
        assert "upgrade" in msg.lower(), msg
    return ei.value


@pytest.mark.parametrize("defect", list(RAW_DEFECTS))
def test_malformed_record_bytes(good_ckpt: Path, defect: str) -> None:
    raw = (good_ckpt / "quire.json").read_bytes()
    bad = RAW_DEFECTS[defect](raw)
    (good_ckpt / "quire.json").write_bytes(bad)
    _assert_refused(good_ckpt)
    with pytest.raises(CorruptCheckpointError):
        quire.metadata(good_ckpt)


@pytest.mark.parametrize("defect", list(DOC_DEFECTS))
def test_malformed_record_doc(good_ckpt: Path, defect: str) -> None:
    _write_record(good_ckpt, DOC_DEFECTS[defect](_record(good_ckpt)))
    _assert_refused(good_ckpt)


@pytest.mark.parametrize("version", [3, 99, 2**70])
def test_unknown_version_says_upgrade(good_ckpt: Path, version: int) -> None:
    doc = _record(good_ckpt)
    doc["version"] = version
    _write_record(good_ckpt, doc)
    err = _assert_refused(good_ckpt, expect_upgrade=True)
    assert str(version) in str(err)
    with pytest.raises(CorruptCheckpointError, match=r"(?i)upgrade"):
        quire.metadata(good_ckpt)


@pytest.mark.parametrize(
    "defect",
    [
        "no-format",
        "wrong-format",
        "version-str",
        "tree-list",
        "tree-bad-kind",
        "keys-not-strings",
        "keys-duplicate",
        "txids-str",
        "txids-path",
        "metadata-list",
        "created-bad",
    ],
)
def test_malformed_record_refused_by_metadata(good_ckpt: Path, defect: str) -> None:
    _write_record(good_ckpt, DOC_DEFECTS[defect](_record(good_ckpt)))
    with pytest.raises(CorruptCheckpointError):
        quire.metadata(good_ckpt)


@pytest.mark.parametrize(
    "defect",
    [
        "shape-strings",
        "shape-floats",
        "shape-not-list",
        "shape-negative",
        "dtype-unknown",
        "dtype-not-str",
    ],
)
def test_malformed_leaf_record_refused_by_metadata(good_ckpt: Path, defect: str) -> None:
    """``quire.metadata`` must not hand back nonsense (string shapes, negative sizes)."""
    _write_record(good_ckpt, DOC_DEFECTS[defect](_record(good_ckpt)))
    with pytest.raises(CorruptCheckpointError):
        quire.metadata(good_ckpt)


@pytest.mark.parametrize("location", ESCAPING_LOCATIONS)
def test_location_escaping_checkpoint_is_refused(good_ckpt: Path, location: str) -> None:
    # Plant a perfectly valid array outside the checkpoint where the location points, so
    # that a reader that follows the location would succeed (and must not).
    outside = good_ckpt.parent / "outside"
    real = good_ckpt / _w_leaf(_record(good_ckpt))["location"]
    outside.mkdir()
    for f in real.rglob("*"):
        if f.is_file():
            dst = outside / f.relative_to(real)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(f.read_bytes())
    doc = _record(good_ckpt)
    _w_leaf(doc)["location"] = location
    _write_record(good_ckpt, doc)
    err = _assert_refused(good_ckpt)
    assert "params/w" in str(err)
    with pytest.raises(CorruptCheckpointError):
        quire.load(good_ckpt, {"params": {"w": np.zeros((4, 3), np.float32), "n": 0}, "name": ""})


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ([2**40, 2**40], "float32"),
        ([2**62, 2**62, 2**62], "complex128"),
        ([2**22, 2**22], "float32"),  # 64 TiB: below the format's hard cap, above any RAM
        ([2**50], "uint8"),
    ],
)
@pytest.mark.parametrize("target", ["none", "numpy", "jax"])
def test_absurd_claimed_shape_raises_before_allocating(
    good_ckpt: Path, shape: list[int], dtype: str, target: str
) -> None:
    doc = _record(good_ckpt)
    leaf = _w_leaf(doc)
    leaf["shape"] = shape
    leaf["chunk_shape"] = shape
    leaf["dtype"] = dtype
    _write_record(good_ckpt, doc)
    dt = _dtype(dtype)
    w = {
        "none": None,
        "numpy": np.ndarray,
        "jax": jax.ShapeDtypeStruct(
            tuple(shape), dt, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
        ),
    }[target]
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(CorruptCheckpointError) as ei:
            if w is None:
                quire.load(good_ckpt)
            else:
                quire.load(good_ckpt, {"params": {"w": w, "n": 0}, "name": ""})
        elapsed = time.monotonic() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 2, "refusing an absurd shape must not try to allocate or read"
    assert peak < 64 << 20, f"allocated {peak} bytes before refusing"
    assert "params/w" in str(ei.value) or str(good_ckpt) in str(ei.value)


def test_metadata_of_absurd_shape_does_not_allocate(good_ckpt: Path) -> None:
    doc = _record(good_ckpt)
    _w_leaf(doc)["shape"] = [2**40, 2**40]
    _w_leaf(doc)["chunk_shape"] = [2**40, 2**40]
    _write_record(good_ckpt, doc)
    t0 = time.monotonic()
    try:
        quire.metadata(good_ckpt)  # describing a record may succeed or refuse it ...
    except CorruptCheckpointError:
        pass
    assert time.monotonic() - t0 < 2  # ... but never allocates


def test_valid_record_still_loads(good_ckpt: Path) -> None:
    """Control for the tests above: the untouched checkpoint loads (and re-serialised
    JSON with the same content too)."""
    _write_record(good_ckpt, _record(good_ckpt))
    got = quire.load(good_ckpt)
    _same(got["params"]["w"], _data("float32", (4, 3)))
    assert got["params"]["n"] == 3 and got["name"] == "x"


# ----------------------------------------------------------------------------- 4. key-path escaping

WEIRD_KEYS = [
    "..",
    ".",
    "/",
    "//",
    "a/b",
    "a/../b",
    "../../x",
    "../../../../../../tmp/quire-escape",
    "/abs",
    "/etc/passwd",
    "\\",
    "..\\..\\x",
    "with\x00nul",
    "\x00",
    "",
    " ",
    "~",
    "~2",
    "%",
    "%2E%2E",
    "%root",
    "c",
    "zarr.json",
    "quire.json",
    "d",
    "k" * 1000,
    "k" * 999 + "j",
    "ü" * 300,
    "日本語のキー",
    "emoji-🦀",
    "tab\tnew\nline",
    "A",
    "a",
    "Straße",
    "STRASSE",
    "a~2",
    "A~2",
]


def _files_under(root: Path) -> set[str]:
    out = set()
    for dirpath, dirs, files in os.walk(root):
        for name in files + dirs:
            out.add(os.path.join(dirpath, name))
    return out


def _weird_tree() -> dict[str, Any]:
    tree: dict[str, Any] = {k: np.full((2,), i, np.int32) for i, k in enumerate(WEIRD_KEYS)}
    tree["nest"] = {"..": {"..": {"..": np.arange(3)}}, "/": [np.arange(4), {"../x": np.arange(5)}]}
    tree["deep"] = {}
    node = tree["deep"]
    for i in range(12):  # a key path longer than any file-name limit
        node = node.setdefault(f"{i:02d}-" + "x" * 100, {})
    node["leaf"] = np.arange(6)
    tree["case"] = {"a": np.zeros(1), "A": {"zarr.json": np.ones(1), "c": np.ones(2)}}
    return tree


def _map_tree(fn: Any, tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _map_tree(fn, v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_map_tree(fn, v) for v in tree)
    return fn(tree)


def _assert_tree_equal(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict), path
        assert list(got) == list(want), path
        for k in want:
            _assert_tree_equal(got[k], want[k], f"{path}/{k!r}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_tree_equal(g, w, f"{path}/{i}")
    else:
        _same(got, np.asarray(want))


def test_weird_keys_round_trip_and_stay_inside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)  # a relative escape would land here, inside tmp_path
    ckpt = tmp_path / "a" / "b" / "ckpt"
    before = _files_under(tmp_path)
    tree = _weird_tree()
    quire.save(ckpt, tree)
    after = _files_under(tmp_path)
    new = after - before
    root = str(ckpt)
    outside = sorted(
        p
        for p in new
        if p != root and not p.startswith(root + os.sep) and not root.startswith(p + os.sep)
    )
    assert not outside, f"files created outside the checkpoint: {outside}"
    assert not os.path.exists("/tmp/quire-escape")
    for p in _files_under(ckpt):
        assert not os.path.islink(p), p
        real = os.path.realpath(p)
        assert real.startswith(os.path.realpath(ckpt) + os.sep), p
        assert len(os.path.basename(p).encode()) <= 255, p
    # every array location is a distinct directory under d/<txid>/
    meta = quire.metadata(ckpt)
    locs = [
        leaf.location
        for leaf in jax.tree_util.tree_leaves(
            meta.tree, is_leaf=lambda x: isinstance(x, LeafMetadata)
        )
    ]
    assert len(locs) == len(_leaves(tree))
    assert len(set(locs)) == len(locs)
    for loc in locs:
        assert loc.startswith(f"d/{meta.txids[0]}/"), loc
        assert ".." not in loc.split("/") and "." not in loc.split("/") and "" not in loc.split("/")
        assert (ckpt / loc / "zarr.json").is_file()
        zarr.open_array(str(ckpt / loc), mode="r")
    got = quire.load(ckpt)
    _assert_tree_equal(got, tree)
    # the metadata tree has exactly the saved keys too
    assert list(meta.tree) == list(tree)
    # strict load against the original structure
    # (built by hand: jax.tree_util.tree_map would sort the dict keys)
    got2 = quire.load(ckpt, _map_tree(np.zeros_like, tree))
    _assert_tree_equal(got2, tree)


def test_keys_differing_only_in_case_are_separate_arrays(tmp_path: Path) -> None:
    tree = {
        "A": np.array([1]),
        "a": np.array([2]),
        "aB": np.array([3]),
        "Ab": np.array([4]),
        "AB": np.array([5]),
    }
    quire.save(tmp_path / "ckpt", tree)
    meta = quire.metadata(tmp_path / "ckpt").tree
    locs = [meta[k].location for k in tree]
    # distinct even on case-insensitive file systems
    assert len({loc.lower() for loc in locs}) == len(locs), locs
    _assert_tree_equal(quire.load(tmp_path / "ckpt"), tree)


def test_array_locations_never_nest_case_insensitively(tmp_path: Path) -> None:
    """On a case-insensitive file system (macOS, Windows) no array's objects may land
    inside another array's directory: ``a`` (an array) and ``A/zarr.json`` (a leaf under
    a dict ``A``) would collide on ``a/zarr.json``."""
    tree = {"a": np.zeros(3), "A": {"zarr.json": np.ones(2), "c": {"0": np.ones(1)}}}
    quire.save(tmp_path / "ckpt", tree)
    meta = _leaves(quire.metadata(tmp_path / "ckpt").tree)
    locs = [m.location.lower() for m in meta.values()]
    for x in locs:
        for y in locs:
            assert x == y or not y.startswith(x + "/"), (x, y)
    _assert_tree_equal(quire.load(tmp_path / "ckpt"), tree)


@pytest.mark.parametrize("key", ["\udcff", "bad\ud800surrogate"])
def test_lone_surrogate_keys(tmp_path: Path, key: str) -> None:
    """Keys with lone surrogates (e.g. from undecodable file names) round-trip, or are
    refused up front with a QuireError; they never write outside or crash obscurely."""
    tree = {key: np.arange(3)}
    try:
        quire.save(tmp_path / "ckpt", tree)
    except QuireError:
        assert not (tmp_path / "ckpt" / "quire.json").exists()
        return
    _assert_tree_equal(quire.load(tmp_path / "ckpt"), tree)


def test_root_leaf_and_list_paths(tmp_path: Path) -> None:
    for i, tree in enumerate([np.arange(4), [np.arange(2), [np.arange(3)]], (np.arange(1),)]):
        url = tmp_path / f"ckpt{i}"
        quire.save(url, tree)
        got = quire.load(url)
        if isinstance(tree, np.ndarray):
            _same(got, tree)
        else:
            for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(tree)):
                _same(g, w)
        for p in _files_under(url):
            assert os.path.realpath(p).startswith(os.path.realpath(url) + os.sep)


def test_tampered_inline_value_fails_the_record_checksum(tmp_path: Path) -> None:
    """Inline leaves live in quire.json: a changed value is caught by the record's crc32c."""
    url = str(tmp_path / "ckpt")
    quire.save(url, {"step": 100, "lr": 0.5, "name": "run"})
    raw = (tmp_path / "ckpt" / "quire.json").read_text()
    assert '"value":100' in raw
    (tmp_path / "ckpt" / "quire.json").write_text(raw.replace('"value":100', '"value":900'))
    with pytest.raises(quire.CorruptCheckpointError, match="checksum"):
        quire.load(url)
    with pytest.raises(quire.CorruptCheckpointError, match="checksum"):
        quire.metadata(url)
