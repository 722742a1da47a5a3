"""Hostile format-v2 checkpoints (issue 21): forged chunk indexes and packs, re-signed so that
only the deeper defences are tested.  Each is a typed error (the CLI exits 1, no traceback);
nothing outside the checkpoint is opened (inotify); no read blocks on a FIFO; no allocation
follows a length the index states; a codec error reaches the user as itself even while other
leaves wait on the same chunk index."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from outside_watch import OutsideWatch

import quire
from quire._cli.main import main
from quire._format import chunkindex
from quire._format.crc import crc32c
from quire._format.record import record_checksum
from quire._store.memory import MemoryBackend
from quire._store.wrapped import Wrapped
from quire.errors import CorruptCheckpointError, QuireError

TREE = {f"w{i}": np.arange(64, dtype=np.float32).reshape(8, 8) + i for i in range(6)}


def _record(url: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((url / "quire.json").read_text())
    return doc


def _index(url: Path) -> tuple[Path, dict[str, Any]]:
    path = url / _record(url)["indexes"][0]["object"]
    return path, json.loads(path.read_text())


def _resign(url: Path, doc: dict[str, Any] | None = None) -> None:
    """Give the record the size and crc32c of its (edited) index and re-sign it."""
    doc = doc or _record(url)
    for e in doc["indexes"]:
        data = (url / e["object"]).read_bytes()
        e["size"], e["crc32c"] = len(data), f"{crc32c(data):08x}"
    doc["checksum"] = record_checksum(doc)
    (url / "quire.json").write_text(json.dumps(doc))


def _save(url: Path, tree: dict[str, Any] = TREE) -> Path:
    quire.save(str(url), tree)
    return url


def _refused(url: Path, match: str, capsys: pytest.CaptureFixture[str]) -> None:
    """load raises CorruptCheckpointError naming ``url``; verify and cp exit 1."""
    with pytest.raises(CorruptCheckpointError, match=match) as ei:
        quire.load(str(url))
    assert str(url) in str(ei.value)
    assert main(["verify", str(url)]) == 1
    dst = Path(f"{url}-copy")
    assert main(["cp", str(url), str(dst), "-q"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert not (dst / "quire.json").exists()


# ----------------------------------------------------------------------------- unlisted txids
def test_a_ref_into_a_txid_the_record_does_not_list_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another checkpoint's pack, copied into this one with its bindings, and every ref
    pointed at it: the bytes match their bindings, but the txid is garbage to gc."""
    a = _save(tmp_path / "a")
    other = {k: v * 0 + 7 for k, v in TREE.items()}
    b = _save(tmp_path / "b", other)
    ta, tb = _record(a)["txids"][0], _record(b)["txids"][0]
    shutil.copytree(b / "d" / tb, a / "d" / tb)
    path, doc = _index(a)
    _, bdoc = _index(b)
    q, bq = doc["quire"], bdoc["quire"]
    for key in list(doc["refs"]):
        bkey = key.replace(ta, tb)
        doc["refs"][key] = bdoc["refs"][bkey]
        for m in ("crc32", "crc32c"):
            q.get(m, {}).pop(key, None)
            if bkey in bq.get(m, {}):
                q.setdefault(m, {})[key] = bq[m][bkey]
    path.write_text(json.dumps(doc))
    _resign(a)
    _refused(a, "not a pack of a txid the commit record lists", capsys)


def test_the_rule_lives_in_one_place() -> None:
    listed = {"aaaa"}
    assert chunkindex.target_allowed("d/aaaa/%packs/p00000-00000", listed)
    assert not chunkindex.target_allowed("d/bbbb/%packs/p00000-00000", listed)
    assert not chunkindex.target_allowed("d/aaaa/%packs/../../x", listed)
    assert not chunkindex.target_allowed("/etc/passwd", None)


# ----------------------------------------------------------------------------- packs on disk
def _pack(url: Path) -> Path:
    _, doc = _index(url)
    return url / next(v[0] for v in doc["refs"].values() if isinstance(v, list))


@pytest.mark.timeout(60)
def test_a_fifo_as_pack_is_refused_without_blocking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _save(tmp_path / "c")
    pack = _pack(url)
    pack.unlink()
    os.mkfifo(pack)
    _refused(url, "not a data object", capsys)


@pytest.mark.timeout(60)
def test_a_symlinked_pack_is_refused_and_its_target_never_opened(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _save(tmp_path / "c")
    pack = _pack(url)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(pack, outside / "pack")
    pack.symlink_to(outside / "pack")
    with OutsideWatch(outside, outside / "pack") as w:
        _refused(url, "not a data object", capsys)
    assert w.opened == []


# ----------------------------------------------------------------------------- sizes
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        (1, 2**64, "bad reference"),
        (1, 2**63 - 1, "bad reference"),
        (2, 2**40, "too long|truncated"),
    ],
)
def test_offsets_and_lengths_past_the_pack_allocate_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: int, value: int, match: str
) -> None:
    """An offset of 2^64 (OverflowError before) or a length of 2^40 (verify allocated it:
    MemoryError) is checked against the pack's real size first."""
    url = _save(tmp_path / "c")
    path, doc = _index(url)
    key = next(k for k, v in doc["refs"].items() if isinstance(v, list))
    doc["refs"][key][field] = value
    path.write_text(json.dumps(doc))
    _resign(url)
    _refused(url, match, capsys)


# ----------------------------------------------------------------------------- the race
class _Gate(Wrapped):
    """Reads of the index object wait for ``open`` (the others pass)."""

    def __init__(self, base: Any) -> None:
        super().__init__(base)
        self.open = asyncio.Event()
        self.reads = 0

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        if key.endswith(".index.json"):
            self.reads += 1
            await self.open.wait()
        return await self.base.get(key, start, end)


def test_a_waiter_cancelled_while_others_wait_on_the_same_index() -> None:
    """The first failing leaf of a load cancels its siblings; a cancelled waiter must not
    cancel the shared read of the index (before: the reader's ``set_result`` on a cancelled
    future raised ``asyncio.InvalidStateError``, and the others got it)."""

    async def run() -> None:
        base = MemoryBackend(f"memory://quire-tests/race-{os.getpid()}")
        url = "memory://quire-tests/race"
        txid, key = "abcd", "d/abcd/pytree/w/zarr.json"
        text = '{"zarr_format": 3}'
        index = {
            "version": 1,
            "refs": {key: text},
            "quire": {
                "format": 2,
                "txid": txid,
                "process": 0,
                "crc32": {key: chunkindex.crc_hex(__import__("zlib").crc32(text.encode()))},
            },
        }
        data = json.dumps(index).encode()
        obj = chunkindex.index_key(txid, 0)
        await base.put(obj, [data])
        gate = _Gate(base)
        idx = chunkindex.ChunkIndex(gate, url, [chunkindex.index_entry(txid, 0, obj, data)])
        first = asyncio.ensure_future(idx.lookup(key))
        waiters = [asyncio.ensure_future(idx.lookup(key)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert gate.reads == 1  # one shared read
        waiters[0].cancel()  # a sibling leaf failed
        await asyncio.sleep(0)
        gate.open.set()
        got = await asyncio.gather(first, *waiters[1:])
        assert all(r is not None and r.inline == text.encode() for r in got)
        assert waiters[0].cancelled()
        first.cancel()

    asyncio.run(run())


CODECS = {
    "unknown codec": [{"name": "nope"}],
    "zstd level 10^9": [{"name": "zstd", "configuration": {"level": 10**9}}],
    "blosc cname nope": [{"name": "blosc", "configuration": {"cname": "nope"}}],
    "gzip level -100": [{"name": "gzip", "configuration": {"level": -100}}],
    "a second bytes": [{"name": "bytes"}],
    "a bare sharding_indexed": [{"name": "sharding_indexed"}],
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codecs", list(CODECS.values()), ids=list(CODECS))
def test_a_record_naming_a_codec_that_cannot_be_built_is_a_typed_error(
    tmp_path: Path, codecs: list[Any]
) -> None:
    """The record fuzzer's mutations that raised InvalidStateError (15 of 4,080 trials):
    one leaf's codec cannot be built while the other leaves wait on the same index.  Each
    is loaded 15 times: the error is the typed one every time."""
    url = _save(tmp_path / "c")
    doc = _record(url)
    tree = doc["units"]["pytree"]["tree"]
    leaf = tree["children"][tree["keys"].index("w3")]
    leaf["codecs"] = codecs
    _resign(url, doc)
    for _ in range(15):
        with pytest.raises(QuireError):
            quire.load(str(url))
