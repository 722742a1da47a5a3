"""A leaf's codec chain as zarr v3 defines it (issue 37): array-to-array codecs, ``bytes``,
bytes-to-bytes codecs, ``crc32c``; numcodecs' codecs by name through zarr's registry; codecs
that decode to Python objects refused whichever registry offers them; lossy codecs only where
named, and marked.

The two saves the issue showed failing (``numcodecs.zstd`` by name: "no quire.codecs plugin";
a ``BitRound`` object: "'BitRound' object has no attribute '_encode_sync'") are the first two
tests; both failed before the chain was rebuilt.
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
import zarr.codecs.numcodecs as znc
from hypothesis import given, settings
from hypothesis import strategies as st

import quire
from quire._cli.main import main as cli
from quire._runtime.registry import codecs as codec_registry
from quire.errors import CodecError, CorruptCheckpointError, PluginError


def _leaf_record(url: str | Path, key: str = "w") -> dict[str, Any]:
    tree = quire.metadata(str(url)).record["units"]["pytree"]["tree"]
    leaf: dict[str, Any] = dict(zip(tree["keys"], tree["children"]))[key]
    return leaf


def _zarr_json(url: Path, key: str = "w") -> dict[str, Any]:
    loc = _leaf_record(url, key)["location"]
    doc: dict[str, Any] = json.loads((url / loc / "zarr.json").read_text())
    return doc


def _names(chain: list[dict[str, Any]]) -> list[str]:
    return [c["name"] for c in chain]


@pytest.fixture
def weights() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)


# ------------------------------------------------------------------- the two saves
def test_numcodecs_codec_by_name(tmp_path: Path, weights: np.ndarray) -> None:
    url = tmp_path / "c"
    quire.save(url, {"w": weights}, storage=quire.StorageOptions(codecs=["numcodecs.zstd"]))
    np.testing.assert_array_equal(quire.load(url)["w"], weights)
    assert _names(_leaf_record(url)["codecs"]) == ["numcodecs.zstd"]
    quire.save(
        tmp_path / "v1",
        {"w": weights},
        storage=quire.StorageOptions(codecs=["numcodecs.zstd"]),
        layout="chunks",
    )
    assert _names(_zarr_json(tmp_path / "v1")["codecs"]) == ["bytes", "numcodecs.zstd", "crc32c"]


def test_array_to_array_codec_object(tmp_path: Path, weights: np.ndarray) -> None:
    url = tmp_path / "c"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr: numcodecs' codecs are outside the v3 spec
        bitround = znc.BitRound(keepbits=8)
    quire.save(url, {"w": weights}, storage=quire.StorageOptions(codecs=[bitround]))
    got = quire.load(url)["w"]
    assert got.dtype == weights.dtype and got.shape == weights.shape
    np.testing.assert_allclose(got, weights, rtol=2.0**-8)
    assert not np.array_equal(got, weights)  # it did round
    rec = _leaf_record(url)
    assert _names(rec["codecs"]) == ["numcodecs.bitround", "bytes"]
    assert rec["lossy"] == ["numcodecs.bitround"]
    leaf = quire.metadata(url).tree["w"]
    assert leaf.lossy == ("numcodecs.bitround",)
    assert leaf.filters == ("numcodecs.bitround",) and leaf.codecs == ()


# ------------------------------------------------------------------- every kind in its place
# (spec, kind) for codecs exact on int32 data; the oracle does not ask quire for the kinds.
_AA = [
    ({"name": "numcodecs.delta", "configuration": {"dtype": "<i4"}}, "aa"),
    ({"name": "transpose", "configuration": {"order": [1, 0]}}, "aa"),
]
_BB = [
    ("zstd", "bb"),
    ("numcodecs.zlib", "bb"),
    ("numcodecs.lz4", "bb"),
    ({"name": "blosc", "configuration": {"cname": "lz4", "shuffle": "bitshuffle"}}, "bb"),
]


@settings(max_examples=25, deadline=None)
@given(
    picked=st.lists(st.sampled_from(_AA + _BB), min_size=1, max_size=5, unique_by=lambda c: str(c)),
    order=st.randoms(use_true_random=False),
    chunk_bytes=st.sampled_from([None, 512]),
)
def test_every_kind_goes_in_its_place(
    tmp_path_factory: pytest.TempPathFactory, picked: list[Any], order: Any, chunk_bytes: Any
) -> None:
    order.shuffle(picked)
    url = tmp_path_factory.mktemp("kinds") / "c"
    x = (np.arange(32 * 24, dtype=np.int32).reshape(32, 24) * 7) % 1001
    storage = quire.StorageOptions(codecs=[s for s, _ in picked], chunk_bytes=chunk_bytes)
    if all(aa in picked for aa in _AA):
        # zarr-python misreads transpose beside numcodecs' array-to-array codecs (and cannot
        # write it): quire writes no such chain.
        with pytest.raises(CodecError, match="transpose"):
            quire.save(url, {"w": x}, storage=storage, layout="chunks")
        return
    quire.save(url, {"w": x}, storage=storage, layout="chunks")
    np.testing.assert_array_equal(quire.load(url)["w"], x)

    def name(spec: Any) -> str:
        return spec if isinstance(spec, str) else spec["name"]

    want = (
        [name(s) for s, k in picked if k == "aa"]
        + ["bytes"]
        + [name(s) for s, k in picked if k == "bb"]
        + ["crc32c"]
    )
    chain = _zarr_json(url)["codecs"]
    if chunk_bytes is not None:
        assert _names(chain) == ["sharding_indexed"]
        chain = chain[0]["configuration"]["codecs"]
    assert _names(chain) == want
    # Plain zarr reads what quire wrote, whatever the order given.
    loc = _leaf_record(url)["location"]
    np.testing.assert_array_equal(zarr.open_array(str(url / loc), mode="r")[...], x)


@pytest.mark.parametrize(
    ("codec", "match"),
    [
        ({"name": "bytes", "configuration": {"endian": "big"}}, "array-to-bytes"),
        ("sharding_indexed", "chunk_bytes"),
        (object(), "cannot use"),
        ({"name": "zstd", "configuration": {"level": "high"}}, "refuses configuration"),
        ({"name": "numcodecs.zstd", "configuration": {"nope": 1}}, "refuses configuration"),
    ],
    ids=["bytes big endian", "sharding_indexed", "not a codec", "bad level", "unknown key"],
)
def test_a_codec_with_no_place_is_named(tmp_path: Path, codec: Any, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        quire.save(tmp_path / "c", {"w": np.ones(4)}, storage=quire.StorageOptions(codecs=[codec]))
    assert not (tmp_path / "c" / "quire.json").exists()


def test_bytes_and_crc32c_named_are_already_in_place(tmp_path: Path) -> None:
    url = tmp_path / "c"
    x = np.arange(10.0)
    codecs = ["crc32c", {"name": "bytes", "configuration": {"endian": "little"}}, "zstd"]
    quire.save(url, {"w": x}, storage=quire.StorageOptions(codecs=codecs), layout="chunks")
    assert _names(_zarr_json(url)["codecs"]) == ["bytes", "zstd", "crc32c"]
    np.testing.assert_array_equal(quire.load(url)["w"], x)


def test_too_long_a_chain_is_refused(tmp_path: Path) -> None:
    from quire._format.bounds import MAX_CODECS

    with pytest.raises(CodecError, match=f"at most {MAX_CODECS}"):
        quire.save(
            tmp_path / "c",
            {"w": np.ones(4)},
            storage=quire.StorageOptions(codecs=["zstd"] * (MAX_CODECS + 1)),
        )


def test_unknown_codec_names_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(PluginError, match=r"'numcodecs.nope'.*install the package"):
        quire.save(
            tmp_path / "c",
            {"w": np.ones(4)},
            storage=quire.StorageOptions(codecs=["numcodecs.nope"]),
        )


def test_a_numcodecs_codec_whose_library_is_missing_names_the_extra(tmp_path: Path) -> None:
    """zarr knows ``numcodecs.pcodec`` by name; numcodecs builds it only with ``pcodec``
    installed: saving and loading say which extra to install."""
    import importlib.util

    from quire._format.record import record_checksum

    def save() -> None:
        storage = quire.StorageOptions(codecs=["numcodecs.pcodec"])
        quire.save(tmp_path / "s", {"w": np.ones(4)}, storage=storage)

    if importlib.util.find_spec("pcodec") is not None:  # installed: an array-to-bytes codec
        with pytest.raises(CodecError, match="array-to-bytes"):
            save()
        return
    with pytest.raises(PluginError, match=r"pip install 'numcodecs\[pcodec\]'"):
        save()
    url = tmp_path / "c"
    quire.save(url, {"w": np.arange(8.0)}, storage=quire.StorageOptions(codecs=["numcodecs.lz4"]))
    doc = json.loads((url / "quire.json").read_text())
    doc["units"]["pytree"]["tree"]["children"][0]["codecs"] = [{"name": "numcodecs.pcodec"}]
    doc["checksum"] = record_checksum(doc)
    (url / "quire.json").write_text(json.dumps(doc))
    with pytest.raises(PluginError, match=r"'w'.*numcodecs\[pcodec\]"):
        quire.load(url)


def test_default_codecs_from_the_context(tmp_path: Path) -> None:
    x = np.arange(60, dtype=np.int64).reshape(6, 10)
    with quire.Context(
        codecs=["numcodecs.lz4", {"name": "transpose", "configuration": {"order": [1, 0]}}]
    ):
        quire.save(tmp_path / "c", {"w": x}, layout="chunks")
    assert _names(_zarr_json(tmp_path / "c")["codecs"]) == [
        "transpose",
        "bytes",
        "numcodecs.lz4",
        "crc32c",
    ]
    np.testing.assert_array_equal(quire.load(tmp_path / "c")["w"], x)


def test_evolved_configuration_is_recorded(tmp_path: Path, weights: np.ndarray) -> None:
    """What a codec infers from the array (numcodecs.quantize's dtype) is in the record."""
    quire.save(
        tmp_path / "c",
        {"w": weights},
        storage=quire.StorageOptions(
            codecs=[{"name": "numcodecs.quantize", "configuration": {"digits": 3}}]
        ),
    )
    (q, _) = _leaf_record(tmp_path / "c")["codecs"]
    assert q == {"name": "numcodecs.quantize", "configuration": {"digits": 3, "dtype": "float32"}}
    np.testing.assert_allclose(quire.load(tmp_path / "c")["w"], weights, atol=1e-3)


# ------------------------------------------------------------------- never pickle
OBJECT_NAMES = [
    "numcodecs.pickle",
    "pickle",
    "numcodecs.json2",
    "numcodecs.msgpack2",
    "numcodecs.vlen-utf8",
    "numcodecs.vlen-bytes",
    "numcodecs.vlen-array",
    "numcodecs.categorize",
    "vlen-utf8",
    "vlen-bytes",
]


@pytest.mark.parametrize("name", OBJECT_NAMES)
def test_object_codecs_are_refused_on_save(tmp_path: Path, name: str) -> None:
    with pytest.raises(CodecError, match="Python objects"):
        quire.save(tmp_path / "c", {"w": np.ones(4)}, storage=quire.StorageOptions(codecs=[name]))


class _PickleInDisguise(znc._NumcodecsBytesBytesCodec, codec_name="pickle"):
    """numcodecs' Pickle wrapped as zarr wraps numcodecs' codecs (zarr itself does not)."""


class _Smuggler(_PickleInDisguise):
    """Registered with zarr under an innocent name, it makes that wrapped Pickle."""

    @classmethod
    def from_dict(cls, data: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _PickleInDisguise()


def test_object_codecs_are_refused_whichever_registry_offers_them(tmp_path: Path) -> None:
    from zarr.codecs import VLenUTF8Codec
    from zarr.registry import register_codec

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        disguised = _PickleInDisguise()
    offers: list[Any] = [disguised, VLenUTF8Codec()]
    # Registered with zarr under an innocent name...
    register_codec("innocent-codec", _Smuggler)
    offers.append("innocent-codec")
    # ... and as a quire.codecs plugin.
    codec_registry.register("friendly-codec", lambda **_: disguised)
    try:
        offers.append("friendly-codec")
        for i, spec in enumerate(offers):
            with pytest.raises(CodecError, match="Python objects"):
                quire.save(
                    tmp_path / str(i),
                    {"w": np.ones(4)},
                    storage=quire.StorageOptions(codecs=[spec]),
                )
    finally:
        codec_registry.unregister("friendly-codec")


def test_object_codec_in_a_record_is_refused_on_load(tmp_path: Path) -> None:
    from quire._format.record import record_checksum

    url = tmp_path / "c"
    quire.save(url, {"w": np.arange(8.0)}, storage=quire.StorageOptions(codecs=["numcodecs.zstd"]))
    doc = json.loads((url / "quire.json").read_text())
    doc["units"]["pytree"]["tree"]["children"][0]["codecs"] = [{"name": "numcodecs.pickle"}]
    doc["checksum"] = record_checksum(doc)
    (url / "quire.json").write_text(json.dumps(doc))
    for call in (quire.load, quire.metadata, quire.partial.load):
        with pytest.raises(CorruptCheckpointError, match="Python objects"):
            call(str(url))
    assert cli(["verify", str(url)]) != 0


# ------------------------------------------------------------------- lossy only where asked
def test_a_codec_configured_for_another_dtype_is_refused(tmp_path: Path) -> None:
    """A decode to another dtype than was saved is refused before anything is written."""
    spec = {
        "name": "numcodecs.astype",
        "configuration": {"encode_dtype": "u8", "decode_dtype": "u4"},
    }
    with pytest.raises(CodecError, match=r"decode_dtype='u4'.*float32"):
        quire.save(
            tmp_path / "c",
            {"w": np.ones(4, np.float32)},
            storage=quire.StorageOptions(codecs=[spec]),
        )
    assert not (tmp_path / "c" / "quire.json").exists()


def test_lossy_codec_on_a_prng_key_is_refused(tmp_path: Path) -> None:
    import jax

    tree = {"key": jax.random.key(0), "w": np.ones(4, np.uint32)}
    lossy = quire.StorageOptions(
        codecs=[
            {
                "name": "numcodecs.astype",
                "configuration": {"encode_dtype": "uint8", "decode_dtype": "uint32"},
            }
        ]
    )
    with pytest.raises(CodecError, match=r"'key'.*bit for bit"):
        quire.save(tmp_path / "c", tree, storage=lossy)
    # An exact array-to-array codec is fine on a key.
    exact = quire.StorageOptions(
        codecs=[
            {
                "name": "numcodecs.astype",
                "configuration": {"encode_dtype": "uint64", "decode_dtype": "uint32"},
            }
        ]
    )
    quire.save(tmp_path / "d", tree, storage=exact)
    got = quire.load(tmp_path / "d")
    assert (jax.random.key_data(got["key"]) == jax.random.key_data(tree["key"])).all()
    assert quire.metadata(tmp_path / "d").tree["key"].lossy == ()


@pytest.mark.parametrize(
    ("spec", "dtype", "lossy"),
    [
        ({"name": "numcodecs.bitround", "configuration": {"keepbits": 23}}, "float32", False),
        ({"name": "numcodecs.bitround", "configuration": {"keepbits": 10}}, "float32", True),
        ({"name": "numcodecs.quantize", "configuration": {"digits": 2}}, "float64", True),
        (
            {
                "name": "numcodecs.astype",
                "configuration": {"encode_dtype": "float16", "decode_dtype": "float32"},
            },
            "float32",
            True,
        ),
        (
            {
                "name": "numcodecs.astype",
                "configuration": {"encode_dtype": "int64", "decode_dtype": "int32"},
            },
            "int32",
            False,
        ),
        ({"name": "numcodecs.delta", "configuration": {"dtype": "int16"}}, "int16", False),
        ({"name": "numcodecs.delta", "configuration": {"dtype": "float32"}}, "float32", True),
        (
            {
                "name": "numcodecs.fixedscaleoffset",
                "configuration": {"scale": 100, "offset": 0, "dtype": "float64", "astype": "int32"},
            },
            "float64",
            True,
        ),
        (
            {
                "name": "numcodecs.fixedscaleoffset",
                "configuration": {"scale": 1, "offset": 0, "dtype": "int16", "astype": "int32"},
            },
            "int16",
            False,
        ),
        ({"name": "transpose", "configuration": {"order": [0]}}, "float32", False),
        ("numcodecs.zstd", "float32", False),
    ],
)
def test_lossy_is_recorded_exactly_where_it_applies(
    tmp_path: Path, spec: Any, dtype: str, lossy: bool
) -> None:
    x = (np.random.default_rng(1).standard_normal(100) * 100).astype(dtype)
    url = tmp_path / "c"
    quire.save(url, {"w": x}, storage=quire.StorageOptions(codecs=[spec]))
    name = spec if isinstance(spec, str) else spec["name"]
    assert _leaf_record(url).get("lossy", []) == ([name] if lossy else [])
    got = quire.load(url)["w"]
    if not lossy:
        np.testing.assert_array_equal(got, x)


# ------------------------------------------------------------------- verify, cp, plain zarr
CHAINS: dict[str, list[Any]] = {
    "numcodecs.lz4": ["numcodecs.lz4"],
    "numcodecs.zstd + shuffle": [
        {"name": "numcodecs.shuffle", "configuration": {"elementsize": 4}},
        "numcodecs.zstd",
    ],
    "bitround + numcodecs.blosc": [
        {"name": "numcodecs.bitround", "configuration": {"keepbits": 6}},
        {"name": "numcodecs.blosc", "configuration": {"cname": "zstd", "clevel": 3, "shuffle": 2}},
    ],
    "transpose + zstd": [{"name": "transpose", "configuration": {"order": [1, 0]}}, "zstd"],
    "quantize + gzip": [{"name": "numcodecs.quantize", "configuration": {"digits": 2}}, "gzip"],
}


@pytest.mark.parametrize("chain", sorted(CHAINS))
@pytest.mark.parametrize("chunk_bytes", [None, 1024])
def test_verify_cp_and_plain_zarr_read_every_chain(
    tmp_path: Path, weights: np.ndarray, chain: str, chunk_bytes: int | None
) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    storage = quire.StorageOptions(codecs=CHAINS[chain], chunk_bytes=chunk_bytes)
    quire.save(src, {"w": weights, "step": 3}, storage=storage)
    loaded = quire.load(src)["w"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli(["verify", str(src)]) == 0
        assert cli(["cp", str(src), str(dst)]) == 0
        assert cli(["verify", str(dst)]) == 0
    np.testing.assert_array_equal(quire.load(dst)["w"], loaded)
    for url in (src, dst):  # format v2, through the reference file system
        loc = _leaf_record(url)["location"]
        z = zarr.open_array(quire.zarr_store(str(url)), path=loc, mode="r")
        np.testing.assert_array_equal(z[...], loaded)
    v1 = tmp_path / "v1"
    quire.save(v1, {"w": weights}, storage=storage, layout="chunks")
    np.testing.assert_array_equal(quire.load(v1)["w"], loaded)
    z = zarr.open_array(str(v1 / _leaf_record(v1)["location"]), mode="r")
    np.testing.assert_array_equal(z[...], loaded)


def test_verify_finds_a_damaged_chunk_under_a_numcodecs_chain(tmp_path: Path) -> None:
    url = tmp_path / "c"
    x = np.arange(4096, dtype=np.int32)
    storage = quire.StorageOptions(
        codecs=["numcodecs.lz4", {"name": "numcodecs.delta", "configuration": {"dtype": "int32"}}]
    )
    quire.save(url, {"w": x}, storage=storage, layout="chunks")
    chunk = next(p for p in (url / "d").rglob("c/*") if p.is_file())
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    chunk.write_bytes(bytes(raw))
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli(["verify", str(url)]) == 1
    with pytest.raises(CorruptCheckpointError):
        quire.load(url)


@pytest.mark.parametrize("chunk_bytes", [None, 1024])
def test_tensorstore_reads_standard_chains(
    tmp_path: Path, weights: np.ndarray, chunk_bytes: int | None
) -> None:
    import tensorstore as ts

    url = tmp_path / "c"
    codecs = [
        {"name": "blosc", "configuration": {"cname": "lz4", "shuffle": "bitshuffle"}},
        {"name": "transpose", "configuration": {"order": [1, 0]}},
        "zstd",
    ]
    storage = quire.StorageOptions(codecs=codecs, chunk_bytes=chunk_bytes)
    quire.save(url, {"w": weights}, storage=storage, layout="chunks")
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(url / _leaf_record(url)["location"])},
    }
    got = ts.open(spec, open=True, read=True).result().read().result()
    np.testing.assert_array_equal(np.asarray(got), quire.load(url)["w"])
    np.testing.assert_array_equal(np.asarray(got), weights)
