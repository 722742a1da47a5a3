"""Checkpoints written by format versions 1 and 2 must load forever (golden files, never
regenerated).  Version 2 comes in both chunk-index forms: ``v2`` (index format 2, a CRC-32
for every key) and ``v2-index3`` (format 3: plain chunks bound by their crc32c trailer)."""

from __future__ import annotations

import os
import sys
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import pytest

import quire

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
sys.path.insert(0, HERE)
from make_golden import (  # noqa: E402
    GoldenPerProcess,
    GoldenPosition,
    codecs_expected,
    expected,
    incremental_expected,
    jaxlibs_expected,
    units_expected,
)

V1 = os.path.join(HERE, "v1")


def same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    else:
        assert type(a) is type(b) and a == b


def index_formats(path: str) -> set[int]:
    """The chunk-index formats of a golden checkpoint or journal (empty for version 1)."""
    import glob
    import json

    out = set()
    for f in glob.glob(os.path.join(path, "d", "*", "%packs", "*.index.json")):
        with open(f) as fh:
            meta = json.load(fh)["quire"]
        assert ("crc32c" in meta) == (meta["format"] == 3)
        out.add(meta["format"])
    return out


FORMS = {"v1": set(), "v2": {2}, "v2-index3": {3}}


@pytest.mark.parametrize("version", sorted(FORMS))
@pytest.mark.parametrize("name", ["plain", "compressed"])
def test_golden_loads(name: str, version: str) -> None:
    path = os.path.join(HERE, version, name)
    assert os.path.isfile(os.path.join(path, "quire.json")), (
        f"golden checkpoint {path} is missing; it is committed with the repository and must "
        "never be regenerated silently (tests/golden/make_golden.py writes it once per format)"
    )
    assert index_formats(path) == FORMS[version]
    with unsigned_ok(path):
        got = quire.load(path)
        want = expected()
        if name == "plain":
            sharded = got.pop("sharded")
            key = got.pop("key")
            assert np.array_equal(
                np.asarray(sharded), np.arange(64, dtype=np.float32).reshape(8, 8)
            )
            # Written before records kept axis types (issue 31): rebuilt on Auto axes.
            assert sharded.sharding.mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2
            assert np.array_equal(jax.random.key_data(key), jax.random.key_data(jax.random.key(5)))
            assert quire.metadata(path).custom == {"golden": True}
        same(want, got)
        from quire._cli.main import main

        assert main(["verify", path]) == 0
        assert quire.metadata(path).format_version == int(version[1])


def unsigned_ok(path: str) -> Any:
    """These golden files predate the record checksum: since issue 13 a record without
    one is refused unless the caller opts out, which is what a user holding such a
    checkpoint does too."""
    import contextlib
    import json

    with open(os.path.join(path, "quire.json")) as f:
        signed = "checksum" in json.load(f)
    if not signed:
        with pytest.raises(quire.CorruptCheckpointError, match="verify_record=False"):
            quire.load(path)
        return quire.Context(verify_record=False)
    return contextlib.nullcontext()


@pytest.mark.parametrize("version", sorted(FORMS))
def test_golden_journal(version: str) -> None:
    path = os.path.join(HERE, version, "journal")
    assert os.path.isdir(os.path.join(path, "journal")), f"golden journal {path} is missing"
    assert index_formats(path) == FORMS[version]
    import json

    with open(os.path.join(path, "journal", "0000000001.json")) as f:
        signed = "checksum" in json.load(f)
    if not signed:  # v1's records predate the record checksum: refused unless opted out
        with pytest.raises(quire.CorruptCheckpointError, match="verify_record=False"):
            quire.partial.load(path)
    with quire.Context(verify_record=signed):
        got = quire.partial.load(path)
        assert sorted(got) == ["part0", "part1"]
        assert np.array_equal(got["part1"], np.full(3, 1, np.int32))
        assert [v.version for v in quire.partial.versions(path)] == [1, 2]


@pytest.mark.parametrize("version", ["v2", "v2-index3"])
def test_golden_v2_rewritten_journal(version: str) -> None:
    """A journal finalized with a pack rewrite (docs/format.md, "Partial saves"): a chunk
    copied into the rewrite's pack, another read in place from a kept pack of version 1
    through the rewrite's index."""
    from make_golden import rewritten_expected

    path = os.path.join(HERE, version, "rewritten")
    assert index_formats(path) == FORMS[version]
    assert os.path.isfile(os.path.join(path, "quire.json")), f"golden checkpoint {path} is missing"
    import json

    with open(os.path.join(path, "quire.json")) as f:
        doc = json.load(f)
    foreign = []
    for e in doc["indexes"]:
        with open(os.path.join(path, e["object"])) as f:
            refs = json.load(f)["refs"]
        foreign += [v[0] for v in refs.values() if isinstance(v, list) and e["txid"] not in v[0]]
    assert foreign, "the golden rewrite has no index pointing at a kept pack of version 1"
    same(rewritten_expected(), quire.load(path))
    from quire._cli.main import main

    assert main(["verify", path]) == 0
    assert quire.metadata(path).format_version == 2


def test_golden_incremental_root() -> None:
    """An incremental root (docs/format.md "Borrowed bytes"): step 1 retired (record
    deleted, pack kept), steps 2 and 3 borrow ``frozen`` from step 1's pack."""
    import json

    from quire._cli.main import main

    root = os.path.join(HERE, "incremental")
    assert os.path.isfile(os.path.join(root, "checkpointer.json")), (
        f"golden incremental root {root} is missing; it is committed with the repository "
        "(tests/golden/make_golden.py --incremental writes it once)"
    )
    assert not os.path.exists(os.path.join(root, "step_00000001", "quire.json"))
    assert quire.Checkpointer(root).steps() == [2, 3]
    for step in (2, 3):
        path = os.path.join(root, f"step_{step:08d}")
        with open(os.path.join(path, "quire.json")) as f:
            (entry,) = json.load(f)["indexes"]
        (lent,) = entry["borrowed"]
        assert lent.startswith("../step_00000001/d/")
        want = incremental_expected(step)
        got = jax.tree.map(np.asarray, quire.load(path))  # saved jax arrays load as jax
        assert int(got.pop("step")) == want.pop("step")
        same(want, got)
        assert main(["verify", path]) == 0


def test_golden_axis_types_and_nnx_variables() -> None:
    """The optional fields of issue 31 (docs/format.md): a sharding's ``axis_types`` and a
    leaf's NNX ``variable``, as first written; loaded without flax's help."""
    path = os.path.join(HERE, "jaxlibs", "plain")
    assert os.path.isfile(os.path.join(path, "quire.json")), (
        f"golden checkpoint {path} is missing; it is committed with the repository "
        "(tests/golden/make_golden.py --jaxlibs writes it once)"
    )
    got = quire.load(path)
    x = got["x"]
    assert x.sharding.mesh.axis_types == (jax.sharding.AxisType.Explicit,) * 2
    assert x.sharding.spec == jax.sharding.PartitionSpec("x", "y")
    want = jaxlibs_expected()
    assert np.array_equal(np.asarray(x), want["x"])
    for key in ("nnx/w/value", "nnx/mean/value"):
        a, b, c = key.split("/")
        assert np.array_equal(np.asarray(got[a][b][c]), want[key])
    key = got["nnx"]["key"]["value"]
    assert np.array_equal(jax.random.key_data(key), jax.random.key_data(jax.random.key(5)))
    tree = quire.metadata(path).tree["nnx"]
    assert [tree[k]["value"].variable for k in ("key", "mean", "w")] == [
        "RngKey",
        "BatchStat",
        "Param",
    ]


def test_golden_units(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kind of unit (docs/format.md "Units"): a pytree, a JSON config, a whole
    ``Checkpointable`` (one ``record``) and a per-process one (``processes``, ``records``,
    its object under ``p00000/``), as first written; a load by another process count is
    refused for the per-process unit only."""
    from quire._cli.main import main

    path = os.path.join(HERE, "units", "plain")
    assert os.path.isfile(os.path.join(path, "quire.json")), (
        f"golden checkpoint {path} is missing; it is committed with the repository "
        "(tests/golden/make_golden.py --units writes it once)"
    )
    units = quire.metadata(path).record["units"]
    assert units["whole"]["record"] == {"pos": 21} and "processes" not in units["whole"]
    assert (units["it"]["processes"], units["it"]["records"]) == (1, [{"pos": 13}])
    assert os.path.isfile(os.path.join(path, units["it"]["location"], "p00000", "pos.json"))
    got = quire.load_checkpointables(
        path,
        {"state": None, "config": None, "whole": GoldenPosition(0), "it": GoldenPerProcess(0)},
    )
    want = units_expected()
    same(want["state"], got["state"])
    assert got["config"] == want["config"]
    assert (got["whole"].pos, got["it"].pos) == (want["whole"], want["it"])
    assert main(["verify", path]) == 0
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert quire.load_checkpointables(path, {"whole": GoldenPosition(0)})["whole"].pos == 21
    with pytest.raises(quire.TreeMismatchError, match="unit 'it'"):
        quire.load_checkpointables(path, {"it": GoldenPerProcess(0)})


@pytest.mark.parametrize("name", ["plain", "chunks"])
def test_golden_codec_chains(name: str) -> None:
    """Array -> array codecs in a chain (issue 37), formats v2 and v1: the record lists
    ``bytes`` after them and names the lossy one; quire, plain zarr and (v1, standard codecs)
    tensorstore read the values; the lossy leaf is what numcodecs' own bit-round makes."""
    import numcodecs
    import zarr

    path = os.path.join(HERE, "codecs", name)
    assert os.path.isfile(os.path.join(path, "quire.json")), f"golden checkpoint {path} is missing"
    want = codecs_expected()
    rounded = numcodecs.BitRound(keepbits=10)
    exact = {
        "w": rounded.decode(rounded.encode(want["w"][0].copy())),
        "i": want["i"][0],
        "t": want["t"][0],
    }
    got = quire.load(path)
    assert sorted(got) == sorted(exact)
    for k, v in exact.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k
    meta = quire.metadata(path)
    assert meta.tree["w"].lossy == ("numcodecs.bitround",) and meta.tree["i"].lossy == ()
    assert [c["name"] for c in meta.tree["i"].codec_chain] == [
        "numcodecs.delta",
        "bytes",
        "numcodecs.lz4",
        "crc32c",
    ]
    from quire._cli.main import main

    assert main(["verify", path]) == 0
    store = quire.zarr_store(path)
    for k, v in exact.items():
        loc = meta.tree[k].location
        np.testing.assert_array_equal(zarr.open_array(store, path=loc, mode="r")[...], v)
    if name == "chunks":
        import tensorstore as ts

        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": f"{path}/{meta.tree['t'].location}"},
        }
        np.testing.assert_array_equal(
            ts.open(spec, open=True, read=True).result().read().result(), exact["t"]
        )
