"""The work a record can cause is bounded, a failed load stops reading, and the local
backend never follows a symbolic link out of a checkpoint (issue 13)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import quire
from quire._format.record import record_checksum
from quire._store import local
from quire.errors import CorruptCheckpointError, QuireError


@pytest.fixture(autouse=True)
def _v1_layout() -> Any:
    """These tests damage and inspect format-v1 chunk objects (one object per chunk);
    format v2's equivalents are in test_packed.py."""
    with quire.Context(layout="chunks"):
        yield


def _rewrite(url: str, edit: Any, *, sign: bool = True) -> dict[str, Any]:
    p = Path(url, "quire.json")
    doc = json.loads(p.read_text())
    edit(doc)
    doc.pop("checksum", None)
    if sign:
        doc["checksum"] = record_checksum(doc)
    p.write_text(json.dumps(doc))
    return doc


def _leaf(doc: dict[str, Any], key: str) -> dict[str, Any]:
    tree = doc["units"]["pytree"]["tree"]
    leaf: dict[str, Any] = tree["children"][tree["keys"].index(key)]
    return leaf


READ_DELAY = [0.002]


@pytest.fixture
def counted_reads(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Times of every chunk read by the local backend (each made slow, so a load that
    does not stop after an error keeps reading while the test watches)."""
    times: list[float] = []
    orig_get, orig_into = local.LocalBackend._get, local.LocalBackend._get_into

    def get(self: Any, key: str, *a: Any) -> Any:
        if "/c/" in key:
            times.append(time.monotonic())
            time.sleep(READ_DELAY[0])
        return orig_get(self, key, *a)

    def get_into(self: Any, key: str, *a: Any) -> Any:
        if "/c/" in key:
            times.append(time.monotonic())
            time.sleep(READ_DELAY[0])
        return orig_into(self, key, *a)

    monkeypatch.setattr(local.LocalBackend, "_get", get)
    monkeypatch.setattr(local.LocalBackend, "_get_into", get_into)
    return times


def test_record_claiming_a_million_chunks_fails_fast_and_stops_reading(
    tmp_path: Path, counted_reads: list[float]
) -> None:
    url = str(tmp_path / "ckpt")
    quire.save(url, {"a": np.array([7], np.int8), "b": np.arange(4, dtype=np.int8)})
    claim = 2**20

    def edit(doc: dict[str, Any]) -> None:
        a = _leaf(doc, "a")
        a.update(shape=[claim], chunk_shape=[1], nbytes=claim)

    doc = _rewrite(url, edit)
    # 300 genuine one-byte chunks, then the claimed ones are missing.
    cdir = Path(url, _leaf(doc, "a")["location"], "c")
    for i in range(1, 300):
        shutil.copyfile(cdir / "0", cdir / str(i))
    t0 = time.monotonic()
    with pytest.raises(CorruptCheckpointError, match="missing chunk") as ei:
        quire.load(url)
    elapsed = time.monotonic() - t0
    assert url in str(ei.value) and "'a'" in str(ei.value)
    assert elapsed < 5, f"load took {elapsed:.1f} s on a record claiming {claim} chunks"
    time.sleep(0.2)  # reads already handed to threads finish
    n = len(counted_reads)
    time.sleep(1.0)
    assert len(counted_reads) == n, f"{len(counted_reads) - n} chunk reads after load raised"
    assert n < 2000, f"{n} chunk reads for a load that failed at chunk 300"


def test_chunk_grid_larger_than_any_save_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    quire.save(url, {"a": np.zeros(4, np.int8)})
    _rewrite(url, lambda d: _leaf(d, "a").update(shape=[2**26], chunk_shape=[1], nbytes=2**26))
    t0 = time.monotonic()
    with pytest.raises(CorruptCheckpointError, match="chunks"):
        quire.load(url)
    with pytest.raises(CorruptCheckpointError, match="chunks"):
        quire.metadata(url)
    assert time.monotonic() - t0 < 2


# ------------------------------------------------------------------------------ symlinks
def _unchecked(url: str) -> None:
    """Strip every checksum: the record's and the chunks' (what an attacker would do)."""

    def edit(doc: dict[str, Any]) -> None:
        _leaf(doc, "a")["checksum"] = False

    _rewrite(url, edit, sign=False)


def test_symlinked_chunk_is_not_followed(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    quire.save(url, {"a": np.zeros(4, np.uint8)}, storage=quire.StorageOptions(checksum=False))
    secret = tmp_path / "secret"
    secret.write_bytes(b"SECR")
    _unchecked(url)
    doc = json.loads(Path(url, "quire.json").read_text())
    chunk = Path(url, _leaf(doc, "a")["location"], "c", "0")
    chunk.unlink()
    os.symlink(secret, chunk)
    with (
        quire.Context(verify_record=False),
        pytest.raises(CorruptCheckpointError, match="not a chunk object") as ei,
    ):
        quire.load(url)
    assert url in str(ei.value)


def test_symlinked_array_directory_is_not_followed(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    quire.save(url, {"a": np.zeros(4, np.uint8)}, storage=quire.StorageOptions(checksum=False))
    outside = tmp_path / "outside"
    (outside / "c").mkdir(parents=True)
    (outside / "c" / "0").write_bytes(b"SECR")
    _unchecked(url)
    doc = json.loads(Path(url, "quire.json").read_text())
    adir = Path(url, _leaf(doc, "a")["location"])
    shutil.rmtree(adir)
    os.symlink(outside, adir)
    with quire.Context(verify_record=False), pytest.raises(CorruptCheckpointError):
        quire.load(url)


def test_save_never_writes_through_a_symlinked_directory(tmp_path: Path) -> None:
    url = tmp_path / "ckpt"
    url.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, url / "d")
    with pytest.raises(QuireError):
        quire.save(str(url), {"a": np.zeros(4, np.uint8)})
    written = [p for p in outside.rglob("*") if p.is_file()]
    assert written == [], written
    assert not (url / "quire.json").exists()


@pytest.fixture
def slow_reads(counted_reads: list[float]) -> Any:
    READ_DELAY[0] = 0.02
    yield counted_reads
    READ_DELAY[0] = 0.002


def test_reads_stop_when_one_leaf_fails(tmp_path: Path, slow_reads: list[float]) -> None:
    import jax

    counted_reads = slow_reads
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    url = str(tmp_path / "ckpt")
    big = {f"w{i}": jax.device_put(np.arange(64, dtype=np.float32), sh) for i in range(60)}
    quire.save(url, {**big, "bad": np.zeros(4, np.float32)})
    doc = json.loads(Path(url, "quire.json").read_text())
    shutil.rmtree(Path(url, _leaf(doc, "bad")["location"], "c"))
    err: list[BaseException] = []

    def run() -> None:
        try:
            quire.load(url)
        except BaseException as e:
            err.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert err and isinstance(err[0], CorruptCheckpointError), err
    time.sleep(0.2)
    n = len(counted_reads)
    time.sleep(0.5)
    assert len(counted_reads) == n, "chunk reads went on after load raised"
