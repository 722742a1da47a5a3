"""quire-orbax against orbax-checkpoint itself: what orbax writes, quire opens lazily.

Every checkpoint here is written by orbax-checkpoint (v0 ``StandardCheckpointer`` /
``PyTreeCheckpointer`` / ``CheckpointManager`` and v1 ``save_pytree``; OCDBT on and off;
zarr v2 and v3; arrays on one device and sharded over eight) and must open through
``quire.open`` / ``quire.load`` equal to orbax's own restore.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import orbax.checkpoint.experimental.v1 as ocp1
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from quire_orbax import OrbaxSource

import quire
from quire.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    PluginError,
    UnsupportedLeafError,
)

pytestmark = [
    # orbax's own chatter when restoring without a target / through its v1 aliases.
    pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning"),
    pytest.mark.filterwarnings("ignore:Use `(save|load)` instead:DeprecationWarning"),
]


def make_tree(devices: int) -> dict[str, Any]:
    """A small training-state-like tree: sharded (or single-device) arrays and scalars."""
    rng = np.random.default_rng(devices)
    if devices == 1:
        sh: Any = SingleDeviceSharding(jax.devices()[0])
        rows = cols = sh
    else:
        assert len(jax.devices()) >= 8, "XLA_FLAGS did not give 8 CPU devices"
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
        sh = NamedSharding(mesh, P("x", "y"))
        rows = NamedSharding(mesh, P("x"))
        cols = NamedSharding(mesh, P("y"))
    f32 = rng.standard_normal((8, 6)).astype(np.float32)
    return {
        "params": {
            "dense": {
                "kernel": jax.device_put(f32, sh),
                "bias": jax.device_put(jnp.arange(6, dtype=jnp.bfloat16), cols),
            },
            "embed": jax.device_put(jnp.arange(16, dtype=jnp.int32).reshape(8, 2), rows),
        },
        "opt": [jax.device_put(jnp.zeros((4,), jnp.float16), rows), jnp.array(7, jnp.int32)],
        "host": np.linspace(0, 1, 5),
        "step": 42,
        "lr": 0.5,
    }


def _save_v0(handler: Callable[[], Any], path: str, tree: Any) -> None:
    with ocp.Checkpointer(handler()) as ck:
        ck.save(path, tree)


def _save_standard(path: str, tree: Any) -> None:
    with ocp.StandardCheckpointer() as ck:  # OCDBT on: orbax's default
        ck.save(path, tree)
        ck.wait_until_finished()


def _save_manager(path: str, tree: Any) -> str:
    with ocp.CheckpointManager(path) as mngr:
        mngr.save(3, args=ocp.args.StandardSave(tree))
        mngr.wait_until_finished()
    return os.path.join(path, "3")


def _save_v1(path: str, tree: Any, ocdbt: bool = True) -> None:
    ctx = ocp1.Context()
    ctx.array.saving.use_ocdbt = ocdbt
    with ctx:
        ocp1.save_pytree(path, tree)


# name -> (writer(path, tree) returning the path to open, or None for path; orbax restore)
LAYOUTS: dict[str, tuple[Callable[[str, Any], str | None], Callable[[str], Any]]] = {
    "v0-standard-ocdbt": (_save_standard, lambda p: ocp.StandardCheckpointer().restore(p)),
    "v0-standard-no-ocdbt": (
        lambda p, t: _save_v0(lambda: ocp.StandardCheckpointHandler(use_ocdbt=False), p, t),
        lambda p: ocp.StandardCheckpointer().restore(p),
    ),
    "v0-pytree-ocdbt": (
        lambda p, t: _save_v0(ocp.PyTreeCheckpointHandler, p, t),
        lambda p: ocp.PyTreeCheckpointer().restore(p),
    ),
    "v0-pytree-no-ocdbt": (
        lambda p, t: _save_v0(lambda: ocp.PyTreeCheckpointHandler(use_ocdbt=False), p, t),
        lambda p: ocp.PyTreeCheckpointer().restore(p),
    ),
    "v0-pytree-zarr3-ocdbt": (
        lambda p, t: _save_v0(lambda: ocp.PyTreeCheckpointHandler(use_zarr3=True), p, t),
        lambda p: ocp.PyTreeCheckpointer().restore(p),
    ),
    "v0-pytree-zarr3-no-ocdbt": (
        lambda p, t: _save_v0(
            lambda: ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True), p, t
        ),
        lambda p: ocp.PyTreeCheckpointer().restore(p),
    ),
    "v0-manager-step": (
        _save_manager,
        lambda p: ocp.CheckpointManager(os.path.dirname(p)).restore(3),
    ),
    "v1-ocdbt": (_save_v1, lambda p: ocp1.load_pytree(p)),
    "v1-no-ocdbt": (lambda p, t: _save_v1(p, t, ocdbt=False), lambda p: ocp1.load_pytree(p)),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], str]:
    """Every layout x {1, 8} devices, written once by orbax for the whole module."""
    root = tmp_path_factory.mktemp("orbax")
    out = {}
    for devices in (1, 8):
        tree = make_tree(devices)
        for name, (save, _) in LAYOUTS.items():
            path = str(root / f"{name}-{devices}")
            out[(name, devices)] = save(path, tree) or path
    return out


def to_numpy(tree: Any) -> Any:
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tree)


def same(a: Any, b: Any, path: str = "") -> None:
    """``a`` (quire) equals ``b`` (orbax): structure, container kinds, dtypes, values."""
    if isinstance(b, dict):
        assert isinstance(a, dict) and sorted(a) == sorted(b), path
        for k in b:
            same(a[k], b[k], f"{path}/{k}")
    elif isinstance(b, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}/{i}")
    elif isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray), (path, type(a))
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype)
        np.testing.assert_array_equal(a, b, err_msg=path)
    else:
        assert type(a) is type(b) and a == b, (path, a, b)


def read_all(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: x.read() if isinstance(x, quire.sources.LazyArray) else x,
        tree,
        is_leaf=lambda x: isinstance(x, quire.sources.LazyArray),
    )


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_opens_equal_to_orbax_restore(
    written: dict[tuple[str, int], str], layout: str, devices: int
) -> None:
    path = written[(layout, devices)]
    expected = to_numpy(LAYOUTS[layout][1](path))
    assert OrbaxSource.detect(path, {})
    with quire.open(path) as src:
        assert isinstance(src, OrbaxSource) and src.format == "orbax"
        kernel = src.tree["params"]["dense"]["kernel"]
        assert isinstance(kernel, quire.sources.LazyArray)
        assert (kernel.shape, kernel.dtype, kernel.key) == (
            (8, 6),
            np.dtype(np.float32),
            "params/dense/kernel",
        )
        assert src.tree["step"] == 42 and src.tree["lr"] == 0.5  # inline scalars
        same(read_all(src.tree), expected)
        meta = src.metadata
        assert meta["format"] == "orbax" and meta["api"] == layout[:2]
        (item,) = meta["items"].values()
        assert item["use_ocdbt"] == ("no-ocdbt" not in layout)
        assert item["use_zarr3"] == (layout.startswith("v1") or "zarr3" in layout)
    same(to_numpy(quire.load(path)), expected)


def test_loads_onto_a_mesh(written: dict[tuple[str, int], str]) -> None:
    """A LazyArray reads straight into a sharded jax.Array, each shard its own region."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    sharding = NamedSharding(mesh, P("x", "y"))
    path = written[("v0-standard-ocdbt", 8)]
    expected = np.asarray(ocp.StandardCheckpointer().restore(path)["params"]["dense"]["kernel"])
    with quire.open(path) as src:
        got = src.tree["params"]["dense"]["kernel"].read(sharding=sharding)
    assert isinstance(got, jax.Array) and got.sharding == sharding
    np.testing.assert_array_equal(np.asarray(got), expected)


def test_strings_none_and_empty_containers(tmp_path: Path) -> None:
    tree = {
        "name": "run-7",
        "nested": {"tag": "wor'ld"},
        "none": None,
        "empty_dict": {},
        "empty_list": [],
        "pair": (np.arange(3), 1.5),
        "count": 3,
    }
    path = str(tmp_path / "misc")
    with ocp.PyTreeCheckpointer() as ck:
        ck.save(path, tree)
        expected = to_numpy(ck.restore(path))
    with quire.open(path) as src:
        assert src.tree["name"] == "run-7" and src.tree["none"] is None
        assert src.tree["empty_dict"] == {} and src.tree["empty_list"] == []
        same(read_all(src.tree), expected)  # orbax restores the tuple as a list; so does quire


def _key_state() -> dict[str, Any]:
    return {
        "w": np.arange(3, dtype=np.float32),
        "rng": jax.random.key(42),
        "keys": jax.random.split(jax.random.key(7, impl="rbg"), 4),
    }


@pytest.mark.parametrize("ocdbt", [True, False])
def test_typed_prng_keys_load_as_keys(tmp_path: Path, ocdbt: bool) -> None:
    """Orbax saves a typed key as its uint32 data and records its impl in array_metadatas;
    it restores a key, and so does quire: as a value, into a key target, through quire cp."""
    state = _key_state()
    path = str(tmp_path / "keys")
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt)) as ck:
        ck.save(path, state)
        assert str(jax.random.key_impl(ck.restore(path)["keys"])) == "rbg"

    def same_keys(got: Any) -> None:
        for name in ("rng", "keys"):
            assert jax.dtypes.issubdtype(got[name].dtype, jax.dtypes.prng_key), name
            assert jax.random.key_impl(got[name]) == jax.random.key_impl(state[name])
            assert got[name].shape == state[name].shape
            np.testing.assert_array_equal(
                jax.random.key_data(got[name]), jax.random.key_data(state[name])
            )

    same_keys(quire.load(path))
    target = jax.eval_shape(lambda: state)
    same_keys(quire.load(path, target))
    dst = str(tmp_path / "converted")
    assert _quire_cli("cp", path, dst, "-q") == 0
    assert quire.metadata(dst).tree["keys"].handler == "prng_key"
    same_keys(quire.load(dst, target))
    # Key data into a key target (or keys into a uint32 one) is refused with the fix named.
    with pytest.raises(quire.TreeMismatchError, match=r"jax\.random\.key_data"):
        quire.load(path, {**target, "rng": jax.ShapeDtypeStruct((2,), np.uint32)})


def test_sequence_root(tmp_path: Path) -> None:
    path = str(tmp_path / "list_root")
    with ocp.PyTreeCheckpointer() as ck:
        ck.save(path, [np.ones(2, np.float32), 3])
        expected = to_numpy(ck.restore(path))
    with quire.open(path) as src:
        same(read_all(src.tree), expected)


def test_composite_items(tmp_path: Path) -> None:
    """A CheckpointManager step with named items is {item: tree}; JSON items are values."""
    tree = make_tree(1)
    with ocp.CheckpointManager(tmp_path / "run", item_names=("state", "extra")) as mngr:
        mngr.save(
            5,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(tree), extra=ocp.args.JsonSave({"epoch": 2})
            ),
        )
        mngr.wait_until_finished()
        expected = to_numpy(mngr.restore(5)["state"])
    with quire.open(tmp_path / "run" / "5") as src:
        assert sorted(src.tree) == ["extra", "state"]
        assert src.tree["extra"] == {"epoch": 2}
        same(read_all(src.tree["state"]), expected)
        assert src.metadata["items"]["extra"]["kind"] == "json"
    # The manager's root is not a checkpoint: the error names the step to open.
    with pytest.raises(CheckpointNotFoundError, match=r"CheckpointManager.*run/5"):
        quire.open(tmp_path / "run")


def _bytes_read() -> int:
    total = 0
    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read"):
        total += sum(int(v.get("value", 0)) for v in m["values"])
    return total


@pytest.mark.parametrize("ocdbt", [True, False], ids=["ocdbt", "no-ocdbt"])
def test_a_slice_reads_only_its_chunks(tmp_path: Path, ocdbt: bool) -> None:
    """Byte counting: one of 8 row-shards of a 64 KiB array reads ~1/8 of its bytes."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    data = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    tree = {"w": jax.device_put(data, NamedSharding(mesh, P("x"))), "other": np.ones(4096)}
    path = str(tmp_path / "big")
    _save_v0(lambda: ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt), path, tree)
    with quire.open(path) as src:
        before = _bytes_read()
        part = src.tree["w"][8:16, 10:20].read()
        sliced = _bytes_read() - before
    # The whole array through a source of its own: within one, tensorstore may still hold
    # the slice's chunk (its cache keeps entries something references), so that a whole
    # read after it counted 7 of the 8 chunks (53,176 bytes) in one run of the suite.
    with quire.open(path) as src:
        before = _bytes_read()
        whole = src.tree["w"].read()
        full = _bytes_read() - before
    np.testing.assert_array_equal(part, data[8:16, 10:20])
    np.testing.assert_array_equal(whole, data)
    assert full >= data.nbytes * 0.9  # random floats do not compress
    assert 0 < sliced < full / 4, (sliced, full)


def test_a_slice_needs_only_its_chunk_files(tmp_path: Path) -> None:
    """Without OCDBT each chunk is a file: delete the others and the slice still reads."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    data = np.arange(64, dtype=np.float32).reshape(8, 8)
    path = tmp_path / "chunks"
    _save_v0(
        lambda: ocp.PyTreeCheckpointHandler(use_ocdbt=False),
        str(path),
        {"w": jax.device_put(data, NamedSharding(mesh, P("x")))},
    )
    chunks = sorted(p.name for p in (path / "w").iterdir() if not p.name.startswith("."))
    assert len(chunks) == 8
    for name in chunks[1:]:
        (path / "w" / name).unlink()
    with quire.open(path) as src:
        np.testing.assert_array_equal(src.tree["w"][0:1].read(), data[0:1])
        with pytest.raises(CorruptCheckpointError, match=r"chunks.*w"):
            src.tree["w"].read()


def test_import_quire_never_imports_orbax_or_tensorstore(written: Any) -> None:
    path = written[("v0-pytree-ocdbt", 1)]
    code = (
        "import sys, quire\n"
        "assert quire.sources.available()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('orbax', 'tensorstore'))\n"
        "assert not bad, bad\n"
        f"src = quire.open({path!r})\n"
        "assert type(src).__name__ == 'OrbaxSource'\n"
        "src.tree['params']['embed'].read()\n"
        "assert 'orbax' not in sys.modules  # reading never needs orbax itself\n"
    )
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_detect(tmp_path: Path, written: Any) -> None:
    assert OrbaxSource.detect(written[("v1-ocdbt", 1)], {})
    assert not OrbaxSource.detect(str(tmp_path / "missing"), {})
    (tmp_path / "empty").mkdir()
    assert not OrbaxSource.detect(str(tmp_path / "empty"), {})
    quire.save(str(tmp_path / "q"), {"a": np.ones(3)})
    assert not OrbaxSource.detect(str(tmp_path / "q"), {})
    assert type(quire.open(str(tmp_path / "q"))).__name__ != "OrbaxSource"
    assert not OrbaxSource.detect("memory://bucket/ckpt", {})
    (tmp_path / "w.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    assert not OrbaxSource.detect(str(tmp_path / "w.safetensors"), {})
    # file:// URLs are local paths too.
    with quire.open("file://" + written[("v0-pytree-ocdbt", 1)]) as src:
        assert src.format == "orbax" and src.tree["step"] == 42


def _copy(written: Any, tmp_path: Path, layout: str = "v0-pytree-no-ocdbt") -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(written[(layout, 1)], dst)
    return dst


def test_metadata_that_is_not_json(tmp_path: Path, written: Any) -> None:
    path = _copy(written, tmp_path)
    (path / "_METADATA").write_bytes(b"\x80not json")
    with pytest.raises(CorruptCheckpointError, match=rf"{path}.*_METADATA is not valid JSON"):
        quire.open(path)


def test_metadata_without_tree(tmp_path: Path, written: Any) -> None:
    path = _copy(written, tmp_path)
    (path / "_METADATA").write_text(json.dumps({"something": "else"}))
    with pytest.raises(CorruptCheckpointError, match=rf"{path}.*no 'tree_metadata'"):
        quire.open(path)


def test_missing_array_metadata_names_the_leaf(tmp_path: Path, written: Any) -> None:
    path = _copy(written, tmp_path)
    shutil.rmtree(path / "params.dense.kernel")
    with pytest.raises(CorruptCheckpointError, match=rf"{path}.*params/dense/kernel"):
        quire.open(path)


def test_missing_chunk_fails_the_read(tmp_path: Path, written: Any) -> None:
    path = _copy(written, tmp_path)
    for p in (path / "params.embed").iterdir():
        if not p.name.startswith("."):
            p.unlink()
    with (
        quire.open(path) as src,
        pytest.raises(CorruptCheckpointError, match=rf"{path}.*params/embed"),
    ):
        src.tree["params"]["embed"].read()


def test_unknown_value_type(tmp_path: Path, written: Any) -> None:
    path = _copy(written, tmp_path)
    meta = json.loads((path / "_METADATA").read_text())
    entry = next(iter(meta["tree_metadata"].values()))
    entry["value_metadata"]["value_type"] = "my.CustomThing"
    (path / "_METADATA").write_text(json.dumps(meta))
    with pytest.raises(UnsupportedLeafError, match=rf"{path}.*my.CustomThing"):
        quire.open(path)


def test_unknown_layout(tmp_path: Path) -> None:
    path = tmp_path / "odd"
    (path / "thing").mkdir(parents=True)
    (path / "_CHECKPOINT_METADATA").write_text(
        json.dumps({"item_handlers": {"thing": "my.ThingHandler"}})
    )
    with pytest.raises(CorruptCheckpointError, match=rf"{path}.*my.ThingHandler"):
        quire.open(path)
    with pytest.raises(CheckpointNotFoundError, match=str(tmp_path / "nothing")):
        quire.open(tmp_path / "nothing", format="orbax")


def test_unsupported_protocols_are_refused_clearly() -> None:
    with pytest.raises(PluginError, match=r"memory://b/ck.*local paths, s3:// and gs://"):
        quire.open("memory://b/ck", format="orbax")


def test_convert_to_quire(tmp_path: Path, written: Any) -> None:
    """Orbax -> quire: the quire checkpoint loads equal to orbax's restore."""
    path = written[("v0-standard-ocdbt", 8)]
    expected = to_numpy(ocp.StandardCheckpointer().restore(path))
    dst = str(tmp_path / "converted")
    quire.save(dst, quire.load(path))
    same(to_numpy(quire.load(dst)), expected)


def _quire_cli(*argv: str) -> int:
    """The installed ``quire`` command (its console-script entry point), in this process."""
    (ep,) = entry_points(group="console_scripts", name="quire")
    return int(ep.load()(list(argv)))


@pytest.mark.parametrize("layout", ["v0-standard-ocdbt", "v1-no-ocdbt"])
def test_quire_cp_converts(tmp_path: Path, written: Any, layout: str) -> None:
    """``quire cp ./orbax_ckpt dst`` writes a verified quire checkpoint equal to orbax's restore."""
    path = written[(layout, 8)]
    expected = to_numpy(LAYOUTS[layout][1](path))
    dst = str(tmp_path / "converted")
    assert _quire_cli("cp", path, dst, "-q") == 0
    assert _quire_cli("verify", dst) == 0
    same(to_numpy(quire.load(dst)), expected)
    assert quire.metadata(dst).custom["source_format"] == "orbax"


def test_quire_plugins_lists_the_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert _quire_cli("plugins") == 0
    out = capsys.readouterr().out
    assert "orbax" in out and "quire-orbax" in out


def test_load_with_partition_rules_and_transform(written: Any) -> None:
    """Orbax arrays land on a mesh by regex rules; a transform reads only what it uses."""
    path = written[("v1-ocdbt", 8)]
    expected = to_numpy(ocp1.load_pytree(path))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    rules = quire.surgery.partition_rules([(r"kernel$", P("x", "y")), (r".*", P())], mesh)
    got = quire.load(
        path,
        transform=lambda t: {"kernel": t["params"]["dense"]["kernel"][:, :4], "step": t["step"]},
        shardings=rules,
    )
    assert got["step"] == 42
    kernel = got["kernel"]
    assert isinstance(kernel, jax.Array) and kernel.sharding.spec == P("x", "y")
    np.testing.assert_array_equal(np.asarray(kernel), expected["params"]["dense"]["kernel"][:, :4])


# -- the conformance suite every quire source passes -------------------------------------------
from quire.testing import SourceSuite  # noqa: E402


class TestOrbaxSourceSuite(SourceSuite):
    source_format = "orbax"

    def write(self, directory: Path, arrays: dict[str, np.ndarray]) -> str:
        from quire import surgery

        _save_standard(str(directory), surgery.unflatten(arrays, "/"))
        return str(directory)


def test_tensorstore_failures_map_to_quire_errors() -> None:
    from quire_orbax._source import storage_error

    from quire.errors import EndpointUnreachableError, ObjectStorePermissionError

    what = "s3://b/ck: reading params/w"
    denied = storage_error(ValueError("PERMISSION_DENIED: [http_response_code='403']"), what)
    assert isinstance(denied, ObjectStorePermissionError) and str(denied).startswith(what)
    down = storage_error(ValueError("UNAVAILABLE: connection refused"), what)
    assert isinstance(down, EndpointUnreachableError)
    other = storage_error(ValueError("NOT_FOUND: chunk 0.0"), what)
    assert isinstance(other, CorruptCheckpointError) and "damaged or incomplete" in str(other)


def test_s3_storage_options_map_onto_tensorstore_s3_kvstore(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from quire_orbax._store import Store

    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var, raising=False)
    anon = Store("s3://bkt/runs/7", {"anon": True, "retry_deadline": 5})
    assert anon.root == "bkt/runs/7"
    assert anon.kvstore("bkt/runs/7/params.w") == {
        "driver": "s3",
        "bucket": "bkt",
        "path": "runs/7/params.w/",
        "aws_credentials": {"type": "anonymous"},
    }
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    keyed = Store(
        "s3://bkt/ck",
        {"key": "id", "secret": "s3cret", "client_kwargs": {"region_name": "eu-west-1"}},
    )
    spec = keyed.kvstore("bkt/ck")
    assert spec["endpoint"] == "http://127.0.0.1:9" and spec["aws_region"] == "eu-west-1"
    creds = spec["aws_credentials"]
    assert creds["type"] == "profile" and os.stat(creds["credentials_file"]).st_mode & 0o077 == 0
    with open(creds["credentials_file"]) as f:
        assert "s3cret" in f.read()
    keyed.close()
    assert not os.path.exists(creds["credentials_file"])
    assert Store("s3://bkt/ck", {})._aws_credentials() == {"type": "default"}
def test_quire_diff_between_orbax_and_quire(
    tmp_path: Path, written: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 14: ``quire diff`` over Orbax sources: vs the quire checkpoint converted from it,
    across Orbax layouts, and values that differ only beyond a tolerance."""
    path = written[("v0-standard-ocdbt", 8)]
    dst = str(tmp_path / "converted")
    assert _quire_cli("cp", path, dst, "-q") == 0
    assert _quire_cli("diff", path, dst, "--values") == 0
    out = capsys.readouterr().out
    assert "(orbax)" in out and "(quire)" in out and "values of 8 leaves equal" in out
    # two Orbax layouts of the same tree; then the tree written from another seed
    r = quire.diff(written[("v0-pytree-ocdbt", 8)], written[("v1-no-ocdbt", 8)], values=True)
    assert r.same and r.formats == ("orbax", "orbax"), r.lines()
    r = quire.diff(written[("v1-ocdbt", 1)], written[("v1-ocdbt", 8)], values=True)
    assert [line.split(":")[0] for line in r.changed] == ["params/dense/kernel"]
    # a quire checkpoint whose kernel differs by 1e-5: within atol=1e-4, not within 1e-7
    tree = quire.load(dst)
    tree["params"]["dense"]["kernel"] = np.asarray(tree["params"]["dense"]["kernel"]) + 1e-5
    quire.save(tmp_path / "nudged", tree)
    assert quire.diff(path, tmp_path / "nudged", atol=1e-4).same
    r = quire.diff(path, tmp_path / "nudged", atol=1e-7)
    assert r.changed and r.changed[0].startswith("params/dense/kernel: 48 of 48 values differ")
