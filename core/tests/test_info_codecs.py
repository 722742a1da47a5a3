"""``quire info`` shows an array's whole codec chain as stored in its ``zarr.json``.

``bytes, crc32c`` by default (never "raw"), the compressors between, the array-to-array codecs
before ``bytes`` (a lossy one marked), no ``crc32c`` without checksums, and a sharded array's
``sharding_indexed`` with its inner chain; each codec with its configuration.
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

B = "bytes{endian=little}"
Z = "zstd{level=3, checksum=false}"
S = "sharding_indexed{chunk_shape=[8, 8], index_codecs=[%s], index_location=end}"
CASES = [
    ("default", {}, f"[{B}, crc32c]"),
    ("zstd", {"codecs": ["zstd"]}, f"[{B}, {Z}, crc32c]"),
    ("no checksum", {"checksum": False}, f"[{B}]"),
    ("sharded", {"chunk_bytes": 256}, f"[{S % (B + ', crc32c')}({B}, crc32c)]"),
    (
        "sharded zstd",
        {"chunk_bytes": 256, "codecs": ["zstd"]},
        f"[{S % (B + ', crc32c')}({B}, {Z}, crc32c)]",
    ),
    ("sharded no checksum", {"chunk_bytes": 256, "checksum": False}, f"[{S % B}({B})]"),
    (
        "array-to-array, lossy",
        {
            "codecs": [
                "numcodecs.lz4",
                {"name": "numcodecs.bitround", "configuration": {"keepbits": 9}},
            ]
        },
        f"[numcodecs.bitround{{keepbits=9}} (lossy), {B}, numcodecs.lz4, crc32c]",
    ),
    (
        "array-to-array, exact",
        {"codecs": [{"name": "transpose", "configuration": {"order": [1, 0]}}]},
        f"[transpose{{order=[1, 0]}}, {B}, crc32c]",
    ),
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
    assert f"[{chain_text(leaf.codec_chain, leaf.lossy)}]" == want
    # LeafMetadata.codecs keeps its meaning: the bytes-to-bytes codecs only; the
    # array-to-array ones are its filters.
    names = [c if isinstance(c, str) else c["name"] for c in storage.get("codecs", ())]
    assert leaf.codecs == tuple(n for n in names if n in ("zstd", "numcodecs.lz4"))
    assert leaf.filters == tuple(n for n in names if n not in leaf.codecs)


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
    assert chain_text(chain) == f"{S % (B + ', crc32c')}({B}, {Z}, crc32c)"
