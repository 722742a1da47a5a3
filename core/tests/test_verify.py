"""``quire verify`` through the leaf handlers' ``objects``: damage to any owned object of
a built-in array leaf (plain, sharded, compressed) is reported by key; a corrupted
``zarr.json`` too (zarr readers need it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import quire
from quire._engine import verify as _verify_engine
from quire._runtime import ioloop as _io

pytestmark = pytest.mark.quick  # the quick tier (CONTRIBUTING.md)


@pytest.fixture(autouse=True)
def _v1_layout() -> Any:
    """These tests damage and inspect format-v1 chunk objects (one object per chunk);
    format v2's equivalents are in test_packed.py."""
    with quire.Context(layout="chunks"):
        yield


STORAGE = {
    "plain": quire.StorageOptions(),
    "sharded": quire.StorageOptions(chunk_bytes=64),
    "sharded+zstd": quire.StorageOptions(chunk_bytes=64, codecs=["zstd"]),
}


def _verify(url: str) -> tuple[int, list[_verify_engine.VerifyProblem]]:
    return _io.submit(_verify_engine.verify(url)).result(timeout=60)


def _save(tmp_path: Path, storage: quire.StorageOptions) -> Path:
    url = tmp_path / "ckpt"
    tree = {"w": np.arange(256, dtype=np.float32), "n": 3, "s": "text"}
    quire.save(str(url), tree, storage=storage)
    return url


@pytest.mark.parametrize("name", sorted(STORAGE))
def test_every_object_checked_and_a_flipped_byte_found(tmp_path: Path, name: str) -> None:
    url = _save(tmp_path, STORAGE[name])
    checked, problems = _verify(str(url))
    chunks = [
        p for p in url.rglob("*") if (p.is_file() and "/w/c/" in str(p)) or p.name == "zarr.json"
    ]
    assert problems == [] and checked == len(chunks)
    victim = next(p for p in sorted(url.rglob("*")) if p.is_file() and "/w/c/" in str(p))
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 3] ^= 0x40
    victim.write_bytes(bytes(blob))
    _, problems = _verify(str(url))
    assert [(p.path, p.object) for p in problems] == [
        ("w", str(victim.relative_to(url)).replace("\\", "/"))
    ]


def test_corrupt_or_missing_zarr_json_is_reported(tmp_path: Path) -> None:
    url = _save(tmp_path, STORAGE["plain"])
    meta = next(url.rglob("zarr.json"))
    meta.write_text(meta.read_text().replace('"shape": [256]', '"shape": [255]'))
    _, problems = _verify(str(url))
    assert len(problems) == 1 and problems[0].object.endswith("w/zarr.json")
    assert "shape" in problems[0].error
    meta.write_text("{not json")
    assert "not JSON" in _verify(str(url))[1][0].error
    meta.unlink()
    assert _verify(str(url))[1][0].error == "missing"
