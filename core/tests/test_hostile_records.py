"""Hostile commit records: re-signed with a valid checksum, they must only ever load or raise
a typed quire error — never reach numpy, jax or the OS unvalidated (issue 13)."""

from __future__ import annotations

import collections
import copy
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import quire
import quire.partial
from quire._format.bounds import MAX_CODECS
from quire._format.record import record_checksum
from quire.errors import CorruptCheckpointError, PluginError, QuireError


def _tree() -> dict[str, Any]:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    return {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "j": jax.device_put(np.arange(8, dtype=np.float32).reshape(4, 2), sh),
        "k": jax.random.key(0),
        "s": 3,
        "f": 1.5,
        "c": 1 + 2j,
        "n": np.int8(5),
        "h": np.float16(1.0),
        "z": np.complex64(1 + 1j),
        "t": "hi",
        "b": b"xy",
        "none": None,
        "l": [1, (2.0, True)],
    }


def _read(url: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(Path(url, "quire.json").read_text())
    return doc


def _write(url: str, doc: dict[str, Any], *, sign: bool = True) -> None:
    if sign:
        doc = {**doc, "checksum": record_checksum(doc)}
    Path(url, "quire.json").write_text(json.dumps(doc))


def _leaf(doc: dict[str, Any], key: str) -> dict[str, Any]:
    tree = doc["units"]["pytree"]["tree"]
    leaf: dict[str, Any] = tree["children"][tree["keys"].index(key)]
    return leaf


def _set(key: str, field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def f(doc: dict[str, Any]) -> None:
        _leaf(doc, key)[field] = value

    return f


def _del(key: str, field: str) -> Callable[[dict[str, Any]], None]:
    def f(doc: dict[str, Any]) -> None:
        del _leaf(doc, key)[field]

    return f


def _loc(key: str, make: Callable[[str, dict[str, Any]], str]) -> Callable[[dict[str, Any]], None]:
    def f(doc: dict[str, Any]) -> None:
        _leaf(doc, key)["location"] = make(doc["txids"][0], doc)

    return f


def _top(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def f(doc: dict[str, Any]) -> None:
        doc[field] = value

    return f


BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
BITROUND = {"name": "numcodecs.bitround", "configuration": {"keepbits": 3}}


def _astype(encode: str, decode: str) -> dict[str, Any]:
    return {
        "name": "numcodecs.astype",
        "configuration": {"encode_dtype": encode, "decode_dtype": decode},
    }


# (mutation, the key path the error must name)
HOSTILE: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "5000-digit integer": (_set("s", "value", 10**5000), "s/value"),
    "complex as [1.0]": (_set("c", "value", [1.0]), "c/value"),
    "int8 of 300": (_set("n", "value", 300), "n/value"),
    "float of 10**400": (_set("f", "value", 10**400), "f/value"),
    "float16 of 1e300": (_set("h", "value", 1e300), "h/value"),
    "codecs as a string": (_set("a", "codecs", "zstd"), "a/codecs"),
    "sharding not an object": (_set("j", "sharding", "named"), "j/sharding"),
    "mesh not an object": (
        _set("j", "sharding", {"type": "named", "mesh": [2, 2], "spec": ["x"]}),
        "j/sharding/mesh",
    ),
    "duplicate spec": (
        _set("j", "sharding", {"type": "named", "mesh": {"x": 2, "y": 2}, "spec": ["x", "x"]}),
        "j/sharding/spec[1]",
    ),
    "indivisible shape": (
        _set("j", "sharding", {"type": "named", "mesh": {"x": 8}, "spec": ["x"]}),
        "j/sharding/spec[0]",
    ),
    "unknown mesh axis": (
        _set("j", "sharding", {"type": "named", "mesh": {"x": 2}, "spec": [["q"]]}),
        "j/sharding/spec[0]",
    ),
    "axis type unknown": (
        _set(
            "j",
            "sharding",
            {"type": "named", "mesh": {"x": 2, "y": 2}, "spec": ["x"], "axis_types": ["Auto", "x"]},
        ),
        "j/sharding/axis_types",
    ),
    "axis types short": (
        _set(
            "j",
            "sharding",
            {"type": "named", "mesh": {"x": 2, "y": 2}, "spec": ["x"], "axis_types": ["Auto"]},
        ),
        "j/sharding/axis_types",
    ),
    "variable not a string": (_set("a", "variable", {"class": "Param"}), "a/variable"),
    "PRNG impl nope": (_set("k", "impl", "nope"), "k/impl"),
    "too-long location": (_loc("a", lambda t, d: f"d/{t}/" + "x" * 5000), "a/location"),
    "long component": (_loc("a", lambda t, d: f"d/{t}/" + "x" * 300), "a/location"),
    "location at a file": (
        _loc("j", lambda t, d: _leaf(d, "a")["location"] + "/zarr.json"),
        "j/location",
    ),
    "another array's directory": (
        _loc("j", lambda t, d: _leaf(d, "a")["location"]),
        "/location",
    ),
    "location under a foreign txid": (_loc("a", lambda t, d: "d/0000/pytree/a"), "a/location"),
    "plugins not an object": (_top("plugins", ["evil"]), "plugins"),
    "plugins key without group": (_top("plugins", {"evil": "pkg"}), "plugins"),
    "plugins value not a name": (_top("plugins", {"a:b": "x; rm -rf /"}), "plugins"),
    "shape deleted": (_del("a", "shape"), "a"),
    "shape negative": (_set("a", "shape", [-2, 3]), "a/shape[0]"),
    "chunk shape zero": (_set("a", "chunk_shape", [0, 3]), "a/chunk_shape[0]"),
    "dtype unknown": (_set("a", "dtype", "object"), "a/dtype"),
    "dtype not a string": (_set("a", "dtype", ["float32"]), "a/dtype"),
    "scalar type unknown": (_set("s", "type", "decimal"), "s/type"),
    "bytes not base64": (_set("b", "value", "!!"), "b/value"),
    "str not a string": (_set("t", "value", 5), "t/value"),
    "prng shape wrong": (_set("k", "key_shape", [3]), "k/shape"),
    "metadata not an object": (_top("metadata", []), "metadata"),
    "process_count a string": (_top("process_count", "1"), "process_count"),
    # The codec chain (docs/format.md): checked before any codec is built from it.
    "codec numcodecs.pickle": (_set("a", "codecs", [{"name": "numcodecs.pickle"}]), "a/codecs[0]"),
    "codec pickle": (_set("a", "codecs", [{"name": "pickle"}]), "a/codecs[0]/name"),
    "codec vlen-utf8": (_set("a", "codecs", [{"name": "vlen-utf8"}]), "a/codecs[0]/name"),
    "codec json2": (_set("a", "codecs", [{"name": "numcodecs.json2"}]), "a/codecs[0]/name"),
    "codec categorize": (
        _set("a", "codecs", [{"name": "numcodecs.categorize", "configuration": {}}, BYTES]),
        "a/codecs[0]/name",
    ),
    "codec chain too long": (
        _set("a", "codecs", [{"name": "zstd"}] * (MAX_CODECS + 1)),
        "a/codecs",
    ),
    "codec name too long": (_set("a", "codecs", [{"name": "z" * 5000}]), "a/codecs[0]/name"),
    "codec without name": (_set("a", "codecs", [{"configuration": {}}]), "a/codecs[0]/name"),
    "codec configuration a list": (
        _set("a", "codecs", [{"name": "zstd", "configuration": [3]}]),
        "a/codecs[0]/configuration",
    ),
    "codec sharding listed": (
        _set("a", "codecs", [{"name": "sharding_indexed", "configuration": {}}]),
        "a/codecs[0]/name",
    ),
    "bytes big endian": (
        _set("a", "codecs", [BITROUND, {"name": "bytes", "configuration": {"endian": "big"}}]),
        "a/codecs[1]/configuration",
    ),
    "bytes twice": (_set("a", "codecs", [BITROUND, BYTES, BYTES]), "a/codecs[2]"),
    "bytes first": (_set("a", "codecs", [BYTES, {"name": "zstd"}]), "a/codecs[0]"),
    "astype to object": (
        _set("a", "codecs", [_astype("float32", "|O"), BYTES]),
        "a/codecs[0]/configuration/decode_dtype",
    ),
    "astype to a huge string": (
        _set("a", "codecs", [_astype("U100000000", "float32"), BYTES]),
        "a/codecs[0]/configuration/encode_dtype",
    ),
    "delta as a subarray": (
        _set("a", "codecs", [{"name": "numcodecs.delta", "configuration": {"dtype": "(9999,)f4"}}]),
        "a/codecs[0]/configuration/dtype",
    ),
    "codec configuration of 10**5 entries": (
        _set(
            "a",
            "codecs",
            [{"name": "transpose", "configuration": {"order": list(range(10**5))}}, BYTES],
        ),
        "a/codecs[0]/configuration",
    ),
    "lossy not a list": (_set("a", "lossy", "numcodecs.bitround"), "a/lossy"),
    "lossy names no codec of the chain": (_set("a", "lossy", ["numcodecs.bitround"]), "a/lossy[0]"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any], Any]:
    url = str(tmp_path_factory.mktemp("hostile") / "ckpt")
    tree = _tree()
    quire.save(url, tree)
    return url, _read(url), tree


def _calls(url: str, tree: Any) -> list[tuple[str, Callable[[], Any]]]:
    return [
        ("load", lambda: quire.load(url)),
        ("load(abstract)", lambda: quire.load(url, tree)),
        ("metadata", lambda: quire.metadata(url)),
        ("partial.load", lambda: quire.partial.load(url)),
    ]


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_value_is_corrupt_naming_url_and_key_path(
    saved: tuple[str, dict[str, Any], Any], name: str
) -> None:
    url, doc, tree = saved
    mutate, where = HOSTILE[name]
    bad = copy.deepcopy(doc)
    mutate(bad)
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # to write the 5000-digit integer
    try:
        _write(url, bad)
    finally:
        sys.set_int_max_str_digits(old)
    try:
        for call, fn in _calls(url, tree):
            with pytest.raises(CorruptCheckpointError) as ei:
                fn()
            msg = str(ei.value)
            assert url in msg, (call, msg)
            if name != "5000-digit integer":  # the JSON parser refuses it: no key path known
                assert f"at {where}" in msg or where in msg, (call, msg)
    finally:
        _write(url, doc, sign=False)
    assert quire.load(url)["s"] == 3


@pytest.mark.parametrize("value", ["<deleted>", None, False, ""])
def test_record_without_checksum_is_corrupt_unless_opted_out(
    saved: tuple[str, dict[str, Any], Any], value: Any
) -> None:
    url, doc, tree = saved
    bad = {k: v for k, v in doc.items() if k != "checksum"}
    if value != "<deleted>":
        bad["checksum"] = value
    _write(url, bad, sign=False)
    try:
        for call, fn in _calls(url, tree):
            with pytest.raises(CorruptCheckpointError, match="checksum") as ei:
                fn()
            assert url in str(ei.value) and "verify_record=False" in str(ei.value), call
        with quire.Context(verify_record=False):
            for _, fn in _calls(url, tree):
                fn()
            assert quire.load(url)["t"] == "hi"
    finally:
        _write(url, doc, sign=False)


# --------------------------------------------------------------- codec configurations
# Chains that pass the record's checks and go wrong only when their codecs are built or run:
# every read refuses them with a typed error that names the URL and the leaf, in bounded time.
CODED = [BITROUND, BYTES, {"name": "numcodecs.zstd", "configuration": {"level": 1}}]
HOSTILE_CHAINS: dict[str, list[Any]] = {
    "array-to-array codec where bytes-to-bytes go": [BITROUND],
    "bytes-to-bytes codec where array-to-array go": [{"name": "zstd"}, BYTES],
    "numcodecs id smuggled in": [
        BITROUND,
        BYTES,
        {"name": "numcodecs.zstd", "configuration": {"id": "pickle"}},
    ],
    "transpose order not a permutation": [
        {"name": "transpose", "configuration": {"order": [0, 0, 0]}},
        BYTES,
    ],
    "transpose order of 2000 axes": [
        {"name": "transpose", "configuration": {"order": list(range(2000))}},
        BYTES,
    ],
    "unknown configuration key": [
        BITROUND,
        BYTES,
        {"name": "numcodecs.lz4", "configuration": {"x": 1}},
    ],
    "level not a number": [
        BITROUND,
        BYTES,
        {"name": "zstd", "configuration": {"level": "x"}},
    ],
    "decode to another dtype": [_astype("float64", "int32"), BYTES],
    "keepbits huge": [{"name": "numcodecs.bitround", "configuration": {"keepbits": 10**18}}, BYTES],
    "blosc block of 2**62 bytes": [
        BITROUND,
        BYTES,
        {"name": "numcodecs.blosc", "configuration": {"blocksize": 2**62}},
    ],
    "quantize to 10**18 digits": [
        {"name": "numcodecs.quantize", "configuration": {"digits": 10**18, "dtype": "float32"}},
        BYTES,
    ],
    "codec no registry knows": [BITROUND, BYTES, {"name": "numcodecs.nope"}],
}


@pytest.fixture(scope="module")
def coded(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    url = str(tmp_path_factory.mktemp("coded") / "ckpt")
    x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    quire.save(
        url, {"a": x, "s": 3}, storage=quire.StorageOptions(codecs=[BITROUND, "numcodecs.zstd"])
    )
    assert _leaf(_read(url), "a")["codecs"][:2] == CODED[:2]
    return url, _read(url)


@pytest.mark.parametrize("name", sorted(HOSTILE_CHAINS))
def test_hostile_codec_configuration_is_refused_in_bounded_time(
    coded: tuple[str, dict[str, Any]], name: str
) -> None:
    url, doc = coded
    bad = copy.deepcopy(doc)
    _leaf(bad, "a")["codecs"] = HOSTILE_CHAINS[name]
    _leaf(bad, "a").pop("lossy", None)
    _write(url, bad)
    try:
        for call, fn in [
            ("load", lambda: quire.load(url)),
            ("partial.load", lambda: quire.partial.load(url)),
            ("verify", lambda: quire.verify(url).raise_if_damaged()),
        ]:
            t0 = time.monotonic()
            with pytest.raises((CorruptCheckpointError, PluginError)) as ei:
                fn()
            msg = str(ei.value)
            assert url in msg and ("'a'" in msg or "/a" in msg), (call, msg)
            assert time.monotonic() - t0 < 10, (call, "took seconds")
    finally:
        _write(url, doc, sign=False)
    assert quire.load(url)["s"] == 3


# ------------------------------------------------------------------------------- fuzz
def _positions(node: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k != "checksum":
                out.append((node, k))
                _positions(v, out)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.append((node, i))
            _positions(v, out)
    return out


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, 10**400, 300, 2**26])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["", "nan", "inf", "x", "zstd", "named", "d/", "..", "float32", "c/0"])
    | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=6,
)
_OPS = st.sampled_from(["replace", "delete", "swap", "int", "string", "dup"])
_mutation = st.tuples(_OPS, st.integers(0, 10**6), _json, st.integers(-3, 70))
OUTCOMES: collections.Counter[str] = collections.Counter()


def _mutate(doc: dict[str, Any], op: str, pick: int, value: Any, n: int) -> None:
    pos = _positions(doc, [])
    parent, key = pos[pick % len(pos)]
    cur = parent[key]
    if op == "replace":
        parent[key] = value
    elif op == "delete":
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif op == "swap":
        other, okey = pos[(pick * 7919 + 13) % len(pos)]
        parent[key] = copy.deepcopy(other[okey])
    elif op == "int":
        parent[key] = (cur * 2**n if n >= 0 else cur + n) if type(cur) is int else n
    elif op == "string":
        parent[key] = (cur + "/x" * max(n, 1)) if isinstance(cur, str) else str(cur)
    elif op == "dup" and isinstance(cur, list):
        parent[key] = cur + cur[: max(n, 1)]


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any], Any]:
    url = str(tmp_path_factory.mktemp("fuzz") / "ckpt")
    tree = _tree()

    def storage(path: Any, leaf: Any) -> quire.StorageOptions:
        # "a" carries a chain of every kind, so the fuzzer mutates codec configurations too.
        codecs = [BITROUND, "numcodecs.zstd"] if tuple(path) == ("a",) else None
        return quire.StorageOptions(chunk_bytes=8, codecs=codecs)

    quire.save(url, tree, storage=storage)
    assert _leaf(_read(url), "a")["codecs"][0] == BITROUND
    return url, _read(url), tree


@settings(
    max_examples=4000,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(muts=st.lists(_mutation, min_size=1, max_size=3), which=st.integers(0, 3))
def test_fuzzed_records_only_load_or_raise_typed_errors(
    fuzz_target: tuple[str, dict[str, Any], Any], muts: list[Any], which: int
) -> None:
    url, doc, tree = fuzz_target
    bad = copy.deepcopy(doc)
    for m in muts:
        _mutate(bad, *m)
    try:
        _write(url, bad)
    except (TypeError, ValueError):  # e.g. a mutation json cannot write
        OUTCOMES["unwritable"] += 1
        return
    name, fn = _calls(url, tree)[which]
    t0 = time.monotonic()
    try:
        fn()
        OUTCOMES[f"{name}: ok"] += 1
    except QuireError as e:
        OUTCOMES[f"{name}: {type(e).__name__}"] += 1
    assert time.monotonic() - t0 < 10, "a record made a load run for seconds"


def test_fuzz_outcomes_are_reported() -> None:
    # Runs after the fuzz test (file order): both outcomes must have occurred.
    print("fuzz outcomes:", dict(sorted(OUTCOMES.items())), "total", sum(OUTCOMES.values()))
    if OUTCOMES:
        assert any(k.endswith(": ok") for k in OUTCOMES)
        assert any("CorruptCheckpointError" in k for k in OUTCOMES)
