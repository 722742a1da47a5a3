"""Format v2 identity of zarr shards (``quire._format.chunkid``, ``quire.shards``).

A zarr-sharded array's stored object (one shard: inner chunks + shard index) is read by
byte ranges on load, so the whole-object CRC-32 of ``quire.crc32`` is never computed
there.  The shard index's own crc32c trailer binds nothing on its own: the index holds
only offsets and lengths, the same for every raw shard of an array (and of every array
with the same layout).  So the index also binds each inner chunk's crc32c trailer; these
tests swap, move and import shards whose own checksums all stay valid, and check that
every load path (numpy, jax, resharded, a region) refuses them naming the key, that
``verify`` still does, and that a load makes no pass over the shards of its own."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json
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
from quire._format import chunkid as _chunkid
from quire._format import packedreader as _packedreader
from quire._format import record as _records
from quire._format import shardid as _shardid
from quire._format.crc import crc32c
from quire.errors import CorruptCheckpointError

W = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
SHARDED = quire.StorageOptions(chunk_bytes=64)  # each 1 x 64 device shard: 4 inner chunks


def _mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))


def _record(url: str) -> dict[str, Any]:
    return json.loads(Path(url, "quire.json").read_text())


def _index(url: str) -> tuple[Path, dict[str, Any]]:
    path = Path(url, _record(url)["indexes"][0]["object"])
    return path, json.loads(path.read_text())


def _resign(url: str) -> None:
    doc = _record(url)
    for e in doc["indexes"]:
        data = Path(url, e["object"]).read_bytes()
        e["size"], e["crc32c"] = len(data), f"{crc32c(data):08x}"
    doc["checksum"] = _records.record_checksum(doc)
    Path(url, "quire.json").write_text(json.dumps(doc))


def _key(url: str, leaf: str, coords: str) -> str:
    return f"{quire.metadata(url).tree[leaf].location}/c/{coords}"


def _save(url: str, scale: float = 1.0) -> None:
    s = NS(_mesh(), P("d"))
    tree = {"a": jax.device_put(W * scale, s), "b": jax.device_put(W * scale + 1000, s)}
    quire.save(url, tree, storage=SHARDED)


def _swap(url: str, k1: str, k2: str) -> None:
    _, doc = _index(url)
    a, b = doc["refs"][k1], doc["refs"][k2]
    assert a[0] == b[0] and a[2] == b[2]
    raw = bytearray(Path(url, a[0]).read_bytes())
    raw[a[1] : a[1] + a[2]], raw[b[1] : b[1] + b[2]] = (
        raw[b[1] : b[1] + b[2]],
        raw[a[1] : a[1] + a[2]],
    )
    Path(url, a[0]).write_bytes(bytes(raw))


def _targets() -> dict[str, Any]:
    s8 = NS(_mesh(), P("d"))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    s4 = NS(mesh, P("x", "y"))  # each target shard reads part of several stored shards
    return {
        "numpy": None,
        "jax": {k: jax.ShapeDtypeStruct(W.shape, W.dtype, sharding=s8) for k in "ab"},
        "resharded": {k: jax.ShapeDtypeStruct(W.shape, W.dtype, sharding=s4) for k in "ab"},
    }


def _load(url: str, target: str) -> dict[str, np.ndarray]:
    out = quire.load(url, _targets()[target])
    return {k: np.asarray(v) for k, v in out.items()}


# ----------------------------------------------------------------------------- the form
def test_shards_are_bound_by_their_index_and_inner_trailers(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    _save(url)
    _, doc = _index(url)
    meta = doc["quire"]
    assert meta["format"] == 2  # only shards: the old form, plus the map older quire ignores
    assert set(meta["shards"]) == set(meta["crc32"]) - {
        k for k in meta["crc32"] if k.endswith("zarr.json")
    }
    heads = set()
    for key, value in meta["shards"].items():
        pack, off, n = doc["refs"][key]
        raw = Path(url, pack).read_bytes()[off : off + n]
        assert len(value) == 8 * (1 + 4)  # the shard index's trailer, then 4 inner chunks'
        assert value[:8] == f"{int.from_bytes(raw[-4:], 'little'):08x}"
        rows = np.frombuffer(raw[-68:-4], "<u8").reshape(-1, 2)
        for i, (o, nb) in enumerate(rows.tolist()):
            assert value[8 + 8 * i : 16 + 8 * i] == raw[o + nb - 4 : o + nb][::-1].hex()
        heads.add(value[:8])
    # Why the shard index alone cannot bind: raw shards' indexes are all alike.
    assert len(heads) == 1


@pytest.mark.parametrize("target", ["numpy", "jax", "resharded"])
def test_round_trip_and_no_pass_of_its_own(
    tmp_path: Path, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "c")
    _save(url)
    crc32_passes: list[int] = []
    real_crc = _chunkid.chunk_crc
    monkeypatch.setattr(
        _chunkid, "chunk_crc", lambda v, n=None: crc32_passes.append(1) or real_crc(v, n)
    )
    index_reads: list[str] = []
    real_index = _shardid.ShardChecks._index

    async def index(self: Any, key: str, ref: Any) -> Any:
        index_reads.append(key)
        return await real_index(self, key, ref)

    monkeypatch.setattr(_shardid.ShardChecks, "_index", index)
    out = _load(url, target)
    np.testing.assert_array_equal(out["a"], W)
    np.testing.assert_array_equal(out["b"], W + 1000)
    # No CRC-32 over any shard, and the binding reads no shard index of its own: the
    # shard readers read each index first, and its checked rows serve the inner chunks.
    assert crc32_passes == [] and index_reads == []
    region = quire.open(url).tree["a"][3:4, 16:40].read()  # a region inside one shard
    np.testing.assert_array_equal(region, W[3:4, 16:40])


# ----------------------------------------------------------------------------- identity
def _damaged(tmp_path: Path, how: str) -> tuple[str, list[str]]:
    """A checkpoint with shards replaced by other valid shard bytes; their keys (the
    first is of leaf ``a``)."""
    url = str(tmp_path / how)
    _save(url)
    if how == "swapped-in-array":
        keys = [_key(url, "a", "1/0"), _key(url, "a", "6/0")]
        _swap(url, *keys)
    elif how == "swapped-across-arrays":
        keys = [_key(url, "a", "2/0"), _key(url, "b", "2/0")]
        _swap(url, *keys)
    elif how == "moved":  # the index points at the neighbouring shard of the pack
        key = _key(url, "a", "3/0")
        keys = [key]
        path, doc = _index(url)
        at = doc["refs"][key][1]
        array = key.rsplit("/c/", 1)[0] + "/c/"
        others = [
            r for k, r in doc["refs"].items() if k.startswith(array) and r[0] == doc["refs"][key][0]
        ]
        others = [r for r in others if r[1] != at]
        # the next one; the previous one when the writers happened to store this shard last
        later = [r for r in others if r[1] > at]
        doc["refs"][key] = (
            min(later, key=lambda r: r[1]) if later else max(others, key=lambda r: r[1])
        )
        path.write_text(json.dumps(doc))
        _resign(url)
    else:  # foreign: the same shard of another checkpoint with other values
        key = _key(url, "a", "4/0")
        keys = [key]
        other = str(tmp_path / "other")
        _save(other, 2.0)
        _, od = _index(other)
        _, doc = _index(url)
        src = od["refs"][_key(other, "a", "4/0")]
        dst = doc["refs"][key]
        raw = bytearray(Path(url, dst[0]).read_bytes())
        raw[dst[1] : dst[1] + dst[2]] = Path(other, src[0]).read_bytes()[src[1] : src[1] + src[2]]
        Path(url, dst[0]).write_bytes(bytes(raw))
    return url, keys


HOW = ["swapped-in-array", "swapped-across-arrays", "moved", "foreign"]


@pytest.mark.parametrize("target", ["numpy", "jax", "resharded"])
@pytest.mark.parametrize("how", HOW)
def test_a_wrong_shard_fails_the_load_naming_its_key(tmp_path: Path, how: str, target: str) -> None:
    url, keys = _damaged(tmp_path, how)
    with pytest.raises(CorruptCheckpointError, match="does not match the chunk index") as e:
        _load(url, target)
    assert any(k in str(e.value) for k in keys) and "zarr shard" in str(e.value)


@pytest.mark.parametrize("how", HOW)
def test_a_wrong_shard_fails_a_region_and_verify(tmp_path: Path, how: str) -> None:
    url, keys = _damaged(tmp_path, how)
    row = int(keys[0].rsplit("/", 2)[-2])
    with pytest.raises(CorruptCheckpointError, match=keys[0]):
        quire.open(url).tree["a"][row : row + 1, 20:30].read()  # one inner chunk
    report = quire.verify(url)
    assert not report.ok and set(keys) <= {p.object for p in report.problems}
    assert main(["verify", url]) == 1


def test_an_inner_chunk_forged_under_an_intact_trailer_fails(tmp_path: Path) -> None:
    """Bytes of an inner chunk changed, every trailer as the index has it: the decoder's
    crc32c check of the inner chunk refuses it (what the trailer binding relies on)."""
    url = str(tmp_path / "c")
    _save(url)
    key = _key(url, "a", "5/0")
    _, doc = _index(url)
    pack, off, _n = doc["refs"][key]
    raw = bytearray(Path(url, pack).read_bytes())
    raw[off + 70] ^= 0x10  # inside inner chunk 1 (68 bytes each)
    Path(url, pack).write_bytes(bytes(raw))
    for target in ("numpy", "resharded"):
        with pytest.raises(CorruptCheckpointError, match="crc32c checksum mismatch"):
            _load(url, target)


def test_an_inner_chunk_read_before_its_shard_index_is_still_bound(tmp_path: Path) -> None:
    """A reader asking for an inner chunk's range first: the binding reads the shard index
    itself (once), then checks the inner chunk's trailer at the offset it gives."""
    import asyncio

    url, (key, _) = _damaged(tmp_path, "swapped-in-array")
    rec = _record(url)
    from quire._store.url import open_backend

    async def go() -> None:
        base = open_backend(url)
        reader = _packedreader.reader(base, url, rec["indexes"])
        assert isinstance(reader, _packedreader.PackedReader)
        good = _key(url, "a", "0/0")
        assert len(await reader.get(good, 68, 136)) == 68
        with pytest.raises(ValueError, match=f"{key}: inner chunk 1 .*zarr shard"):
            await reader.get(key, 68, 136)

    asyncio.run(go())


# ----------------------------------------------------------------------------- compatibility
def test_an_index_without_the_map_loads_as_before(tmp_path: Path) -> None:
    """What quire wrote before ``quire.shards`` (and older quire's finalize writes): the
    shards keep their whole-object CRC-32 (verify, cp), loads read them unbound."""
    url = str(tmp_path / "c")
    _save(url)
    path, doc = _index(url)
    del doc["quire"]["shards"]
    path.write_text(json.dumps(doc))
    _resign(url)
    np.testing.assert_array_equal(_load(url, "resharded")["a"], W)
    assert quire.verify(url).ok


@pytest.mark.parametrize("defect", ["not-hex", "short", "unknown-key", "inline-key", "too-many"])
def test_a_malformed_shard_binding_is_refused(tmp_path: Path, defect: str) -> None:
    url = str(tmp_path / "c")
    _save(url)
    path, doc = _index(url)
    shards = doc["quire"]["shards"]
    key = _key(url, "a", "0/0")
    if defect == "not-hex":
        shards[key] = "zz" + shards[key][2:]
    elif defect == "short":
        shards[key] = shards[key][:8]
    elif defect == "unknown-key":
        shards[key + "0"] = shards[key]
    elif defect == "inline-key":
        shards[key.rsplit("/c/", 1)[0] + "/zarr.json"] = shards[key]
    else:  # more inner chunks than the shard can index
        shards[key] = shards[key] * 10
    path.write_text(json.dumps(doc))
    _resign(url)
    with pytest.raises(CorruptCheckpointError, match="chunk index"):
        quire.load(url)
    assert not quire.verify(url).ok


def test_a_lying_shard_binding_is_refused_by_load_and_verify(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    _save(url)
    path, doc = _index(url)
    key = _key(url, "b", "7/0")
    v = doc["quire"]["shards"][key]
    doc["quire"]["shards"][key] = v[:-8] + f"{int(v[-8:], 16) ^ 1:08x}"  # last inner chunk
    path.write_text(json.dumps(doc))
    _resign(url)
    with pytest.raises(CorruptCheckpointError, match=f"{key}: inner chunk 3"):
        quire.load(url)
    assert [p.object for p in quire.verify(url).problems] == [key]


def test_finalize_keeps_the_shard_binding(tmp_path: Path) -> None:
    """Shards copied by a pack rewrite, and shards left in a kept pack, keep their binding
    in the new index; a shard swapped afterwards still fails the load."""
    url = str(tmp_path / "c")
    partial.save(url, {"a": np.ones(4000, np.float32), "s": W}, storage=SHARDED)
    partial.save(url, {"a": np.zeros(4000, np.float32)})  # version 1's pack: mostly dead
    partial.finalize(url)
    shards = {
        k: v
        for e in _record(url)["indexes"]
        for k, v in json.loads(Path(url, e["object"]).read_text())["quire"]
        .get("shards", {})
        .items()
    }
    loc = quire.metadata(url).tree["s"].location
    assert f"{loc}/c/0/0" in shards and len(shards[f"{loc}/c/0/0"]) == 8 * (1 + 32)
    np.testing.assert_array_equal(np.asarray(quire.load(url)["s"]), W)
