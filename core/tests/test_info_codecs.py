"""``quire info`` shows an array's whole codec chain as stored in its ``zarr.json``.

``bytes, crc32c`` by default (never "raw"), the compressors between, no ``crc32c`` without
checksums, and a sharded array's ``sharding_indexed`` with its inner chain.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import quire
from quire._cli.main import main as cli
from quire._format.describe import chain_text
from quire._handlers.zarr_layout import codec_chain

CASES = [
    ("default", {}, "[bytes, crc32c]"),
    ("zstd", {"codecs": ["zstd"]}, "[bytes, zstd, crc32c]"),
    ("no checksum", {"checksum": False}, "[bytes]"),
    ("sharded", {"chunk_bytes": 256}, "[sharding_indexed(bytes, crc32c)]"),
    (
        "sharded zstd",
        {"chunk_bytes": 256, "codecs": ["zstd"]},
        "[sharding_indexed(bytes, zstd, crc32c)]",
    ),
    ("sharded no checksum", {"chunk_bytes": 256, "checksum": False}, "[sharding_indexed(bytes)]"),
]


def _save(root: Path, storage: dict[str, Any], layout: str = "packed") -> Path:
    url = root / "ck"
    w = np.arange(512, dtype=np.float32).reshape(64, 8)
    quire.save(url, {"w": w, "step": 1}, storage=quire.StorageOptions(**storage), layout=layout)
    return url


@pytest.mark.parametrize(("name", "storage", "want"), CASES, ids=[c[0] for c in CASES])
def test_info_lists_the_whole_chain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, storage: Any, want: str
) -> None:
    url = _save(tmp_path, storage)
    assert cli(["info", str(url)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("w:"))
    assert f"codecs={want}" in line, line
    assert "raw" not in line


@pytest.mark.parametrize(("name", "storage", "want"), CASES, ids=[c[0] for c in CASES])
def test_metadata_chain_is_the_one_in_zarr_json(
    tmp_path: Path, name: str, storage: Any, want: str
) -> None:
    url = _save(tmp_path, storage, layout="chunks")
    leaf = quire.metadata(url).tree["w"]
    stored = json.loads((url / str(leaf.location) / "zarr.json").read_text())["codecs"]
    assert list(leaf.codec_chain) == stored
    assert f"[{chain_text(leaf.codec_chain)}]" == want
    # LeafMetadata.codecs keeps its meaning: the bytes-to-bytes codecs only.
    assert leaf.codecs == tuple(storage.get("codecs", ()))


def test_info_json_prints_the_record_whose_fields_give_the_chain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _save(tmp_path, {"chunk_bytes": 256, "codecs": ["zstd"]})
    assert cli(["info", "--json", str(url)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads((url / "quire.json").read_text())  # the record, as stored
    rec = doc["units"]["pytree"]["tree"]["children"][0]
    assert [c["name"] for c in rec["codecs"]] == ["zstd"]
    chain = codec_chain(rec["codecs"], rec["checksum"], rec.get("inner_shape"))
    assert chain == list(quire.metadata(url).tree["w"].codec_chain)
    assert chain_text(chain) == "sharding_indexed(bytes, zstd, crc32c)"
