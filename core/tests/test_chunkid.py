"""Format v2 chunk identity (``quire._format.chunkid``): a plain array chunk is bound to its key by
its own crc32c trailer (index format 3, ``quire.crc32c``), everything else by a CRC-32.

The trailer binding is only as good as the crc32c check of the readers, so every path
that reads a trailer-bound chunk through the index is run here on a **forged** chunk: a
byte of its body flipped, its trailer left as the index has it.  The index comparison
passes; only the crc32c check of the path itself can refuse it.  The swapped, moved and
foreign chunk tests of ``test_packed.py`` run on the new form; here they also run on the
old one (format 2, CRC-32 only), and a chunk moved to the wrong offset is added."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding as NS
from jax.sharding import PartitionSpec as P

import quire
from quire import partial
from quire._cli.main import main
from quire._engine import journal_cache
from quire._format import chunkid as _chunkid
from quire._format.crc import crc32c
from quire._format.record import record_checksum
from quire._store.memory import MemoryBackend
from quire.errors import CorruptCheckpointError

pytestmark = pytest.mark.quick  # the quick tier (CONTRIBUTING.md)

W = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)


def _mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))


def _record(url: str) -> dict[str, Any]:
    return json.loads(Path(url, "quire.json").read_text())


def _index(url: str, i: int = 0) -> tuple[Path, dict[str, Any]]:
    path = Path(url, _record(url)["indexes"][i]["object"])
    return path, json.loads(path.read_text())


def _records(url: str) -> list[Path]:
    """The commit record, or the journal's records."""
    root = Path(url)
    return (
        [root / "quire.json"]
        if (root / "quire.json").exists()
        else sorted((root / "journal").glob("*.json"))
    )


def _resign(url: str) -> None:
    """Give the records the size and crc32c of their (edited) index objects, and re-sign
    them: what a writer of a self-consistent but lying index would do."""
    for rp in _records(url):
        doc = json.loads(rp.read_text())
        for e in doc["indexes"]:
            data = Path(url, e["object"]).read_bytes()
            e["size"], e["crc32c"] = len(data), f"{crc32c(data):08x}"
        doc["checksum"] = record_checksum(doc)
        rp.write_text(json.dumps(doc))
    journal_cache.forget(url)  # records are immutable, so cached per process (edited here)


def _downgrade(url: str) -> None:
    """Rewrite every index in the old form (format 2: a CRC-32 for every key), as quire
    wrote it before the trailer binding."""
    objects = {e["object"] for rp in _records(url) for e in json.loads(rp.read_text())["indexes"]}
    for obj in objects:
        path = Path(url, obj)
        doc = json.loads(path.read_text())
        meta = doc["quire"]
        for key in meta.pop("crc32c", {}):
            pack, off, n = doc["refs"][key]
            raw = Path(url, pack).read_bytes()[off : off + n]
            meta["crc32"][key] = _chunkid.crc_hex(_chunkid.chunk_crc([memoryview(raw)]))
        meta["format"] = 2
        path.write_text(json.dumps(doc))
    _resign(url)


def _edit_pack(url: str, ref: list[Any], edit: Callable[[bytearray, int, int], None]) -> None:
    path = Path(url, ref[0])
    raw = bytearray(path.read_bytes())
    edit(raw, ref[1], ref[2])
    path.write_bytes(bytes(raw))


def _forge(url: str, key: str) -> None:
    """Flip a byte of the body of chunk ``key``, keeping its trailer (= the index's value)."""
    _, doc = _index(url)
    assert key in doc["quire"]["crc32c"], "not a trailer-bound chunk"

    def flip(raw: bytearray, off: int, n: int) -> None:
        raw[off + (n - 4) // 2] ^= 0x10

    _edit_pack(url, doc["refs"][key], flip)


def _chunk(url: str, leaf: str, coords: str) -> str:
    return f"{quire.metadata(url).tree[leaf].location}/c/{coords}"


# ----------------------------------------------------------------------------- the form
def test_index_binds_plain_chunks_by_their_trailer_and_the_rest_by_crc32(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    tree = {
        "plain": W,
        "zstd": W + 1,
        "sharded": W + 2,
        "nocrc": W + 3,
        "rows": jax.device_put(W, NS(_mesh(), P("d"))),
        "zero_d": np.ones((), np.float64),  # its one chunk's key is <location>/c
    }
    quire.save(url, {k: v for k, v in tree.items() if k in ("plain", "rows", "zero_d")})
    quire.save(url + "z", {"zstd": tree["zstd"]}, storage=quire.StorageOptions(codecs=["zstd"]))
    quire.save(
        url + "s", {"sharded": tree["sharded"]}, storage=quire.StorageOptions(chunk_bytes=64)
    )
    quire.save(url + "n", {"nocrc": tree["nocrc"]}, storage=quire.StorageOptions(checksum=False))
    for u, leaves in ((url, ["plain", "rows", "zero_d"]), (url + "z", ["zstd"])):
        _, doc = _index(u)
        meta = doc["quire"]
        assert meta["format"] == 3
        chunks = {k for k in doc["refs"] if not k.endswith("/zarr.json")}
        assert set(meta["crc32c"]) == chunks and set(meta["crc32"]) == set(doc["refs"]) - chunks
        for key in chunks:
            pack, off, n = doc["refs"][key]
            raw = Path(u, pack).read_bytes()[off : off + n]
            assert meta["crc32c"][key] == f"{crc32c(raw[:-4]):08x}" == raw[-4:][::-1].hex()
        assert len(chunks) == (10 if u == url else 1)
        for leaf in leaves:  # the new form loads and verifies
            np.testing.assert_array_equal(np.asarray(quire.load(u)[leaf]), np.asarray(tree[leaf]))
        assert quire.verify(u).ok
    for u in (url + "s", url + "n"):  # zarr shards, no crc32c: CRC-32, and the old format
        _, doc = _index(u)
        assert doc["quire"]["format"] == 2 and "crc32c" not in doc["quire"]
        assert set(doc["quire"]["crc32"]) == set(doc["refs"])
        assert quire.verify(u).ok


# ----------------------------------------------------------------------------- readers
def _save_plain(url: str) -> str:
    quire.save(url, {"w": W, "v": np.arange(5, dtype=np.int64)})
    return _chunk(url, "w", "0/0")


def _save_rows(url: str) -> str:
    quire.save(url, {"w": jax.device_put(W, NS(_mesh(), P("d")))})
    return _chunk(url, "w", "3/0")


def _refused_by_load(url: str, **kw: Any) -> None:
    with pytest.raises(CorruptCheckpointError, match="crc32c checksum mismatch"):
        quire.load(url, **kw)


def _path_numpy(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    _forge(url, _save_plain(url))
    _refused_by_load(url)  # raw chunks read straight into the array (_read_raw_into)


def _path_compressed(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    quire.save(url, {"w": W}, storage=quire.StorageOptions(codecs=["zstd"]))
    _forge(url, _chunk(url, "w", "0/0"))
    _refused_by_load(url)  # read whole, then decoded (_decode_one)


def _path_jax_same_sharding(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    _forge(url, _save_rows(url))
    target = {"w": jax.ShapeDtypeStruct(W.shape, W.dtype, sharding=NS(_mesh(), P("d")))}
    _refused_by_load(url, abstract=target)


def _path_jax_resharded(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    _forge(url, _save_rows(url))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    target = {"w": jax.ShapeDtypeStruct(W.shape, W.dtype, sharding=NS(mesh, P("a", "b")))}
    _refused_by_load(url, abstract=target)


def _path_partial_region(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    _forge(url, _save_rows(url))
    src = quire.open(url)
    np.testing.assert_array_equal(src.tree["w"][0:2, 3:9].read(), W[0:2, 3:9])  # other chunks
    with pytest.raises(CorruptCheckpointError, match="crc32c checksum mismatch"):
        src.tree["w"][3:4, 5:9].read()  # part of the forged chunk: read whole, decoded


def _path_open_and_load(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    _forge(url, _save_plain(url))
    with pytest.raises(CorruptCheckpointError, match="crc32c checksum mismatch"):
        quire.load(quire.open(url))


def _path_verify(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    key = _save_plain(url)
    _forge(url, key)
    report = quire.verify(url)
    assert not report.ok and [(p.path, p.object) for p in report.problems] == [("w", key)]
    assert "crc32c" in report.problems[0].error
    assert main(["verify", url]) == 1


def _path_copy(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    key = _save_plain(url)
    _forge(url, key)
    with pytest.raises(CorruptCheckpointError, match="crc32c checksum mismatch"):
        quire.copy(url, str(tmp_path / "dst"))
    assert not (tmp_path / "dst" / "quire.json").exists()
    assert main(["cp", url, str(tmp_path / "dst2")]) != 0


def _path_finalize_rewrite(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    partial.save(url, {"a": np.ones(1000, np.float32), "b": W})
    partial.save(url, {"a": np.zeros(1000, np.float32)})  # version 1's pack: mostly dead
    v1 = partial.versions(url)[0].txid
    doc = json.loads(Path(url, "journal", "0000000001.json").read_text())
    (entry,) = doc["indexes"]
    index = json.loads(Path(url, entry["object"]).read_text())
    key = f"d/{v1}/pytree/b/c/0/0"
    assert key in index["quire"]["crc32c"]

    def flip(raw: bytearray, off: int, n: int) -> None:
        raw[off + 7] ^= 0x10

    _edit_pack(url, index["refs"][key], flip)
    with pytest.raises(CorruptCheckpointError, match="crc32c checksum mismatch"):
        partial.finalize(url)
    assert not Path(url, "quire.json").exists() and len(partial.versions(url)) == 2


def _path_object_store_windows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads on object stores read chunks out of planned windows (quire._format.packread)."""
    monkeypatch.setattr(MemoryBackend, "read_part_size", 1 << 20, raising=False)
    url = f"memory://quire-tests/{uuid.uuid4().hex}"
    quire.save(url, {"w": W, "v": np.arange(5, dtype=np.int64)})
    be = MemoryBackend(url)
    rec = json.loads(be.fs.cat_file(f"{be.fs._strip_protocol(url)}/quire.json"))
    (e,) = rec["indexes"]
    doc = json.loads(be.fs.cat_file(f"{be.fs._strip_protocol(url)}/{e['object']}"))
    key = next(k for k in doc["quire"]["crc32c"] if "/w/c/" in k)
    pack, off, _ = doc["refs"][key]
    path = f"{be.fs._strip_protocol(url)}/{pack}"
    raw = bytearray(be.fs.cat_file(path))
    raw[off + 9] ^= 0x10
    be.fs.pipe_file(path, bytes(raw))
    _refused_by_load(url)
    assert not quire.verify(url).ok


PATHS: dict[str, Callable[..., None]] = {
    "numpy": _path_numpy,
    "compressed": _path_compressed,
    "jax-same-sharding": _path_jax_same_sharding,
    "jax-resharded": _path_jax_resharded,
    "partial-region": _path_partial_region,
    "open-and-load": _path_open_and_load,
    "verify": _path_verify,
    "copy": _path_copy,
    "finalize-rewrite": _path_finalize_rewrite,
    "object-store-windows": _path_object_store_windows,
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_reader_of_a_trailer_bound_chunk_checks_its_crc32c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    fn = PATHS[path]
    if path == "object-store-windows":
        fn(tmp_path, monkeypatch)
    else:
        fn(tmp_path)


# ----------------------------------------------------------------------------- identity
@pytest.mark.parametrize("form", ["trailer", "crc32"])
def test_swapped_moved_and_foreign_chunks_in_either_form(tmp_path: Path, form: str) -> None:
    """Each chunk's own crc32c stays valid: only the index binding can refuse these."""

    def fresh(name: str, scale: float = 1.0) -> str:
        url = str(tmp_path / name)
        quire.save(url, {"w": jax.device_put(W * scale, NS(_mesh(), P("d")))})
        if form == "crc32":
            _downgrade(url)
        return url

    ok = fresh("ok")
    np.testing.assert_array_equal(np.asarray(quire.load(ok)["w"]), W)  # the form loads
    assert quire.verify(ok).ok and main(["verify", ok]) == 0
    assert _index(ok)[1]["quire"]["format"] == (3 if form == "trailer" else 2)

    swapped = fresh("swapped")
    _, doc = _index(swapped)
    a, b = doc["refs"][_chunk(swapped, "w", "1/0")], doc["refs"][_chunk(swapped, "w", "6/0")]
    raw = bytearray(Path(swapped, a[0]).read_bytes())
    raw[a[1] : a[1] + a[2]], raw[b[1] : b[1] + b[2]] = (
        raw[b[1] : b[1] + b[2]],
        raw[a[1] : a[1] + a[2]],
    )
    Path(swapped, a[0]).write_bytes(bytes(raw))

    moved = fresh("moved")  # every chunk 4 bytes later than the index says
    _, doc = _index(moved)
    pack = Path(moved, doc["refs"][_chunk(moved, "w", "0/0")][0])
    pack.write_bytes(b"\0\0\0\0" + pack.read_bytes())

    foreign = fresh("foreign")
    other = fresh("other", 2.0)  # the same tree and sizes, other values
    pf, po = _index(foreign)[1], _index(other)[1]
    pack_f = Path(foreign, pf["refs"][_chunk(foreign, "w", "0/0")][0])
    pack_o = Path(other, po["refs"][_chunk(other, "w", "0/0")][0])
    assert pack_f.stat().st_size == pack_o.stat().st_size
    pack_f.write_bytes(pack_o.read_bytes())

    for url in (swapped, moved, foreign):
        with pytest.raises(CorruptCheckpointError, match="do not match the chunk index"):
            quire.load(url)
        report = quire.verify(url)
        assert not report.ok and {p.path for p in report.problems} == {"w"}
        assert main(["verify", url]) == 1
        with pytest.raises(CorruptCheckpointError, match="do not match the chunk index"):
            quire.copy(url, url + "-copy")
    # A whole foreign index: the record's crc32c of it refuses it.
    Path(ok, _record(ok)["indexes"][0]["object"]).write_bytes(
        Path(other, _record(other)["indexes"][0]["object"]).read_bytes()
    )
    with pytest.raises(CorruptCheckpointError, match="chunk index"):
        quire.load(ok)


def test_a_lying_trailer_in_a_resigned_index_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    key = _save_plain(url)
    path, doc = _index(url)
    doc["quire"]["crc32c"][key] = f"{int(doc['quire']['crc32c'][key], 16) ^ 1:08x}"
    path.write_text(json.dumps(doc))
    _resign(url)
    with pytest.raises(CorruptCheckpointError, match="do not match the chunk index"):
        quire.load(url)
    assert [p.object for p in quire.verify(url).problems] == [key]


@pytest.mark.parametrize(
    "defect",
    ["both-maps", "neither-map", "trailer-for-zarr-json", "crc32c-in-format-2", "format-4"],
)
def test_malformed_binding_is_refused(tmp_path: Path, defect: str) -> None:
    url = str(tmp_path / "c")
    key = _save_plain(url)
    path, doc = _index(url)
    meta = doc["quire"]
    meta_key = key.rsplit("/c/", 1)[0] + "/zarr.json"
    if defect == "both-maps":
        meta["crc32"][key] = "00000000"
    elif defect == "neither-map":
        del meta["crc32c"][key]
    elif defect == "trailer-for-zarr-json":
        meta["crc32c"][meta_key] = meta["crc32"].pop(meta_key)
    elif defect == "crc32c-in-format-2":
        meta["format"] = 2
    else:
        meta["format"] = 4
    path.write_text(json.dumps(doc))
    _resign(url)
    match = "upgrade quire" if defect == "format-4" else "chunk index"
    with pytest.raises(CorruptCheckpointError, match=match):
        quire.load(url)
    assert not quire.verify(url).ok


@pytest.mark.parametrize("form", ["trailer", "crc32"])
def test_finalize_rewrite_keeps_each_binding(tmp_path: Path, form: str) -> None:
    """A rewrite binds each copied chunk the way its old index did: trailer-bound chunks
    stay trailer-bound (taken from their trailer, no pass of their own beyond the check),
    CRC-32 keys keep their CRC-32; a journal written in the old form rewrites too."""
    url = str(tmp_path / "c")
    partial.save(url, {"a": np.ones(1000, np.float32), "b": W})
    partial.save(url, {"s": W + 1}, storage=quire.StorageOptions(chunk_bytes=64))
    partial.save(url, {"a": np.zeros(1000, np.float32)})
    if form == "crc32":
        _downgrade(url)
    partial.finalize(url)
    got = quire.load(url)
    np.testing.assert_array_equal(got["b"], W)
    np.testing.assert_array_equal(got["s"], W + 1)
    assert quire.verify(url).ok
    moved = quire.metadata(url).tree["b"].location
    assert moved.count("/") == 4  # d/R/T/pytree/b: b was copied by the rewrite
    (index,) = [
        doc
        for e in _record(url)["indexes"]
        if f"{moved}/zarr.json" in (doc := json.loads(Path(url, e["object"]).read_text()))["refs"]
    ]
    b_chunks = {k for k in index["refs"] if k.startswith(f"{moved}/c/")}
    meta = index["quire"]
    if form == "trailer":
        assert meta["format"] == 3 and b_chunks and set(meta["crc32c"]) == b_chunks
    else:
        assert meta["format"] == 2 and "crc32c" not in meta and b_chunks <= set(meta["crc32"])
    assert quire.copy(url, str(tmp_path / "copy")).verified > 0


def test_trailer_hex_over_split_buffers() -> None:
    data = bytes(range(40))
    want = data[-4:][::-1].hex()
    for cut in range(len(data) + 1):
        views = [memoryview(data[:cut]), memoryview(data[cut:])]
        assert _chunkid.trailer_hex(views) == want
        assert _chunkid.trailer_hex([*views, memoryview(b"xyz")], len(data)) == want
    assert _chunkid.trailer_hex([memoryview(b"abc")]) is None
