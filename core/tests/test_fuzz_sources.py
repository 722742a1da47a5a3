"""Hypothesis fuzz (issue 21) of the parsers of input quire did not write: the safetensors
header, the HF index and the format-v2 chunk index.  Each either accepts the input, and then
what it returns holds the invariants its readers rely on, or raises the typed error, never
anything else; a safetensors file the reference library reads, quire reads equal.

The default lane runs a few examples of each; the slow lane (``-m slow``) runs
``QUIRE_FUZZ_EXAMPLES`` (200 unless set; the issue-21 run used 5,000 per parser)."""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import struct
import uuid
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import quire
from quire._format import chunkindex
from quire._format.crc import ChunkError
from quire._sources.safetensors import DTYPES, parse_header
from quire.errors import CorruptCheckpointError, QuireError

FAST = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))  # fmt: skip
# The slow lane's length: CI runs every test, so a bounded default; a long run sets it.
LONG = int(os.environ.get("QUIRE_FUZZ_EXAMPLES", "200"))
SLOW = settings(max_examples=LONG, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))  # fmt: skip

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats() | st.text(max_size=6),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3)
    ),
    max_leaves=8,
)


# ----------------------------------------------------------------------------- safetensors
def _entry() -> st.SearchStrategy[Any]:
    near = st.integers(-1, 80) | st.sampled_from([2**63, 2**64, -(2**63)])
    return (
        st.fixed_dictionaries(
            {
                "dtype": st.sampled_from([*DTYPES, "F4", "X", 3]),
                "shape": st.lists(st.integers(-1, 6) | st.just(2**62), max_size=3) | JSON,
                "data_offsets": st.lists(near, min_size=0, max_size=3) | JSON,
            }
        )
        | JSON
    )


NAMES = st.from_regex(r"[a-d]{1,3}", fullmatch=True)
HEADERS = st.dictionaries(NAMES | st.just("__metadata__"), _entry(), max_size=5) | JSON


@st.composite
def safetensors_files(draw: st.DrawFn) -> bytes:
    doc = draw(HEADERS)
    body = json.dumps(doc).encode()
    if draw(st.booleans()):  # raw damage: duplicated keys, cut or flipped bytes
        body = draw(st.binary(max_size=8)) + body[: draw(st.integers(0, len(body)))]
    n = draw(st.sampled_from([len(body), len(body)]) | st.integers(0, 2**64 - 1))
    data = draw(st.binary(max_size=80))
    return struct.pack("<Q", n) + body + data


def _check_header(raw: bytes) -> None:
    try:
        start, doc = parse_header(raw[:8], raw[8:], len(raw), "fuzz://x.safetensors")
    except CorruptCheckpointError:
        return
    data = len(raw) - start
    spans = []
    for name, info in doc.items():
        if name == "__metadata__":
            assert info is None or all(isinstance(v, str) for v in info.values())
            continue
        b, e = info["data_offsets"]
        assert 0 <= b <= e <= data
        assert e - b == math.prod(info["shape"]) * DTYPES[info["dtype"]].itemsize
        spans.append((b, e))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the file each example rewrites (Hypothesis runs many per test)."""
    return tmp_path_factory.mktemp("fuzz")


def _differential(raw: bytes, d: Path) -> None:
    """If the reference library reads it, quire reads it equal; else quire refuses it
    typed or reads it (quire allows gaps between tensors; the reference does not)."""
    f = d / "m.safetensors"  # one file, rewritten by each example
    f.write_bytes(raw)
    try:
        ref = safetensors.numpy.load_file(str(f))
    except Exception:
        ref = None
    try:
        got = quire.load(str(f))
    except QuireError:
        assert ref is None, "the reference library reads what quire refuses"
        return
    if ref is not None:
        assert sorted(ref) == sorted(got)
        for k, v in ref.items():
            np.testing.assert_array_equal(np.asarray(got[k]), v)


@FAST
@given(raw=safetensors_files())
def test_safetensors_header_fuzz(fuzz_dir: Path, raw: bytes) -> None:
    _check_header(raw)
    _differential(raw, fuzz_dir)


@pytest.mark.slow
@SLOW
@given(raw=safetensors_files())
def test_safetensors_header_fuzz_long(fuzz_dir: Path, raw: bytes) -> None:
    _check_header(raw)
    _differential(raw, fuzz_dir)


# ----------------------------------------------------------------------------- HF index
SHARD_NAMES = st.sampled_from(
    ["model.safetensors", "../model.safetensors", ".", "", "/etc/passwd", "a\x00b", "x/../y",
     "file:///etc/passwd", "missing.safetensors", "sub/model.safetensors", "\\\\host\\x"]
)  # fmt: skip


@st.composite
def hf_indexes(draw: st.DrawFn) -> bytes:
    doc: Any = {"weight_map": draw(st.dictionaries(NAMES, SHARD_NAMES, max_size=4) | JSON)}
    if draw(st.booleans()):
        doc["metadata"] = draw(JSON)
    if draw(st.booleans()):
        doc = draw(JSON)
    raw = json.dumps(doc).encode()
    if draw(st.booleans()):
        raw = raw[: draw(st.integers(0, len(raw)))] + draw(st.binary(max_size=6))
    return raw


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hf")
    safetensors.numpy.save_file({"a": np.ones(2, np.float32), "b": np.zeros(3, np.int8)},
                                str(d / "model.safetensors"))  # fmt: skip
    (d / "sub").mkdir()
    return d


def _open_index(d: Path, raw: bytes) -> None:
    (d / "model.safetensors.index.json").write_bytes(raw)
    try:
        src = quire.open(str(d))
    except QuireError:
        return
    assert set(src.metadata["files"]) <= {"model.safetensors"}


@FAST
@given(raw=hf_indexes())
def test_hf_index_fuzz(hf_dir: Path, raw: bytes) -> None:
    _open_index(hf_dir, raw)


@pytest.mark.slow
@SLOW
@given(raw=hf_indexes())
def test_hf_index_fuzz_long(hf_dir: Path, raw: bytes) -> None:
    _open_index(hf_dir, raw)


# ----------------------------------------------------------------------------- chunk index
TXID = "abcd1234"
KEY = f"d/{TXID}/pytree/w/c/0"


def _valid_index() -> dict[str, Any]:
    return {
        "version": 1,
        "refs": {KEY: [f"d/{TXID}/%packs/p00000-00000", 0, 16], f"d/{TXID}/pytree/w/zarr.json": "{}"},
        "quire": {
            "format": 2, "txid": TXID, "process": 0,
            "crc32": {KEY: "00000000", f"d/{TXID}/pytree/w/zarr.json": f"{zlib.crc32(b'{}'):08x}"},
        },
    }  # fmt: skip


PATHS = st.sampled_from(
    [("refs", KEY), ("refs", KEY, 0), ("refs", KEY, 1), ("refs", KEY, 2), ("quire", "crc32"),
     ("quire", "crc32", KEY), ("quire", "format"), ("quire", "txid"), ("quire", "shards"),
     ("quire", "crc32c"), ("version",), ("refs",), ("quire",), ("refs", "d/zz/x")]
)  # fmt: skip
VALUES = JSON | st.sampled_from(
    ["d/other/%packs/p00000-00000", f"d/{TXID}/%packs/../x", "/etc/passwd", 2**64, 2**40,
     -1, 3, "ffffffff00000000", [f"d/{TXID}/%packs/p00000-00000", 2**64, 1]]
)  # fmt: skip


@st.composite
def chunk_indexes(draw: st.DrawFn) -> bytes:
    doc: Any = _valid_index()
    for _ in range(draw(st.integers(1, 3))):
        path, value = draw(PATHS), copy.deepcopy(draw(VALUES))  # sampled values are shared
        node = doc
        for p in path[:-1]:
            if not (isinstance(node, dict) and p in node):
                break
            node = node[p]
        else:
            if isinstance(node, dict):
                node[path[-1]] = value
    raw = json.dumps(doc).encode()
    if draw(st.integers(0, 9)) == 0:
        raw = raw[: draw(st.integers(0, len(raw)))]
    return raw


def _parse_index(raw: bytes) -> None:
    entry = chunkindex.index_entry(TXID, 0, chunkindex.index_key(TXID, 0), raw)
    try:
        refs = chunkindex.parse_index(raw, entry, "fuzz://c", {TXID})
    except ChunkError:
        return
    for key, ref in refs.items():
        assert key.startswith(f"d/{TXID}/")
        if ref.inline is None:
            assert chunkindex.target_allowed(ref.target, {TXID})
            assert 0 <= ref.offset < chunkindex.MAX_OBJECT_BYTES
            assert 0 <= ref.length < chunkindex.MAX_OBJECT_BYTES


@FAST
@given(raw=chunk_indexes())
def test_chunk_index_fuzz(raw: bytes) -> None:
    _parse_index(raw)


@pytest.mark.slow
@SLOW
@given(raw=chunk_indexes())
def test_chunk_index_fuzz_long(raw: bytes) -> None:
    _parse_index(raw)


@pytest.mark.slow
@settings(
    max_examples=max(LONG // 10, 10),
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(edits=st.lists(st.tuples(PATHS, VALUES), min_size=1, max_size=2))
def test_forged_index_loads_fuzz(tmp_path_factory: pytest.TempPathFactory, edits: Any) -> None:
    """A real checkpoint whose index is edited and re-signed: load and verify load it or
    raise a typed error."""
    from quire._format.crc import crc32c
    from quire._format.record import record_checksum

    url = tmp_path_factory.mktemp("forge") / uuid.uuid4().hex
    quire.save(str(url), {"w": np.arange(16, dtype=np.float32), "b": np.ones(3, np.int8)})
    rec = json.loads((url / "quire.json").read_text())
    e = rec["indexes"][0]
    path = url / e["object"]
    doc = json.loads(path.read_text())
    key = next(k for k, v in doc["refs"].items() if isinstance(v, list))
    for p, value in copy.deepcopy(edits):
        p = tuple(key if x == KEY else x for x in p)
        node = doc
        for x in p[:-1]:
            node = node.get(x) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node[p[-1]] = value
    data = json.dumps(doc).encode()
    path.write_bytes(data)
    e["size"], e["crc32c"] = len(data), f"{crc32c(data):08x}"
    rec["checksum"] = record_checksum(rec)
    (url / "quire.json").write_text(json.dumps(rec))
    for fn in (lambda: quire.load(str(url)), lambda: quire.verify(str(url))):
        try:
            fn()
        except QuireError:
            pass
