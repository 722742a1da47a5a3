"""A third party's view: a separately built and installed plugin distribution
(tests/fake_plugin: an acme:// backend, a bytes-to-bytes and a lossy array-to-array codec, a
leaf handler for its own class and a checkpointable handler for random.Random) is found through
its entry points alone, saves and loads, shows in `quire plugins`, and passes quire.testing's
suites."""

from __future__ import annotations

import contextlib
import importlib
import io
import random
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import quire
from quire._runtime.registry import clear_caches
from quire.testing import (
    BackendSuite,
    CheckpointableHandlerSuite,
    CodecSuite,
    LeafHandlerSuite,
)

DIST = "acme-quire-plugin"
SOURCE = Path(__file__).parent / "fake_plugin"


def _pip(*args: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _forget_module() -> None:
    for name in [m for m in sys.modules if m == "acme_quire" or m.startswith("acme_quire.")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def acme(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Build and install the plugin with pip, as a user would, into a folder of this module's
    own on ``sys.path`` (its dist-info and entry points are found there as in site-packages):
    never into the shared environment, where another xdist worker's tests, or a concurrent
    install of this fixture, would meet it."""
    base = tmp_path_factory.mktemp("acme")
    src, site = base / "acme-quire-plugin", base / "site"
    shutil.copytree(SOURCE, src)  # build outside the repository
    _pip(
        "install",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--target",
        str(site),
        str(src),
    )
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    clear_caches()
    try:
        yield importlib.import_module("acme_quire")
    finally:
        sys.path.remove(str(site))
        importlib.invalidate_caches()
        _forget_module()
        clear_caches()


pytestmark = pytest.mark.usefixtures("acme")


@pytest.fixture
def service() -> Iterator[str]:
    """A fresh acme storage namespace, chosen through per-protocol storage options."""
    name = uuid.uuid4().hex
    with quire.Context(storage_options={"acme": {"service": name}}):
        yield name


def test_save_and_load_through_backend_codec_and_handler(acme: Any, service: str) -> None:
    url = "acme://bucket/runs/step-1"
    price = acme.Money(Decimal("9.99"), "EUR")
    tree = {"price": price, "w": np.arange(1000, dtype=np.float32).reshape(10, 100), "step": 1}
    quire.save(url, tree, storage=quire.StorageOptions(codecs=[{"name": "acme-xor"}]))

    got = quire.load(url)
    assert got["price"] == price and got["step"] == 1
    np.testing.assert_array_equal(got["w"], tree["w"])
    got = quire.load(url, {"price": acme.Money, "w": np.ndarray, "step": int})
    assert got["price"] == price

    rec = quire.metadata(url).record["units"]["pytree"]["tree"]
    leaves = dict(zip(rec["keys"], rec["children"]))
    assert leaves["price"]["handler"] == "acme-money"
    assert leaves["price"]["amount"] == "9.99"
    assert [c["name"] for c in leaves["w"]["codecs"]] == ["acme-xor"]
    # The record names the package of every third-party plugin it needs...
    plugins = quire.metadata(url).record["plugins"]
    assert plugins["quire.leaf_handlers:acme-money"] == "acme-quire-plugin"
    assert plugins["quire.codecs:acme-xor"] == "acme-quire-plugin"
    assert not any(k.startswith("quire.leaf_handlers:numpy") for k in plugins)
    # The data is in the acme service, XOR-ed: not the raw float bytes.
    backend = quire._store.url.open_backend(url)
    keys = quire._runtime.ioloop.submit(backend.list("")).result()
    assert "quire.json" in keys
    packs = [k for k in keys if "/%packs/p00000-" in k]  # format v2: the chunks are in packs
    assert (
        packs
        and tree["w"].tobytes()[:64]
        not in quire._runtime.ioloop.submit(backend.get(packs[0])).result()
    )


def test_checkpointable_handler_for_a_type_it_does_not_own(service: str) -> None:
    url = "acme://bucket/runs/step-2"
    rng = random.Random(1234)
    rng.random()
    quire.save_checkpointables(url, {"rng": rng, "config": {"lr": 0.1}})
    assert quire.metadata(url).units == {"rng": "acme-random", "config": "json"}
    fresh = random.Random(0)
    out = quire.load_checkpointables(url, {"rng": fresh})
    assert out["rng"] is fresh and fresh.random() == rng.random()


def test_quire_plugins_lists_the_distribution() -> None:
    from quire._cli.main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plugins"]) == 0
    rows = [line.split() for line in buf.getvalue().splitlines()]
    for name in ("acme", "acme-xor", "acme-round", "acme-money", "acme-random"):
        row = next(r for r in rows if r and r[0] == name)
        assert row[1:4] == [DIST, "1.2.3", "ok"], row


def test_array_to_array_plugin_codec_takes_its_place(tmp_path: Path) -> None:
    """The lossy acme-round codec goes before ``bytes`` whatever the order given, is
    recorded lossy (and shown so by ``quire info``), and plain zarr reads what quire loads."""
    import zarr

    from quire._cli.main import main

    url = str(tmp_path / "c")
    w = np.linspace(-3, 3, 600, dtype=np.float32).reshape(20, 30)
    codecs = ["acme-xor", {"name": "acme-round", "configuration": {"decimals": 1}}]
    quire.save(url, {"w": w}, storage=quire.StorageOptions(codecs=codecs), layout="chunks")
    got = quire.load(url)["w"]
    np.testing.assert_allclose(got, w, atol=0.051)
    assert not np.array_equal(got, w)
    leaf = quire.metadata(url).tree["w"]
    assert [c["name"] for c in leaf.codec_chain] == ["acme-round", "bytes", "acme-xor", "crc32c"]
    assert leaf.lossy == ("acme-round",)
    assert quire.metadata(url).record["plugins"]["quire.codecs:acme-round"] == DIST
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["info", url]) == 0
    assert (
        "acme-round{decimals=1} (lossy), bytes{endian=little}, acme-xor{key=90}" in out.getvalue()
    )
    z = zarr.open_array(f"{url}/{leaf.location}", mode="r")
    np.testing.assert_array_equal(z[...], got)


def test_codec_is_known_to_plain_zarr(tmp_path: Path) -> None:
    import zarr

    url = str(tmp_path / "c")
    a = np.arange(50, dtype=np.int16)
    quire.save(url, {"a": a}, storage=quire.StorageOptions(codecs=["acme-xor"]))
    loc = quire.metadata(url).record["units"]["pytree"]["tree"]["children"][0]["location"]
    np.testing.assert_array_equal(zarr.open_array(quire.zarr_store(url), path=loc)[...], a)
    quire.save(
        url + "1", {"a": a}, storage=quire.StorageOptions(codecs=["acme-xor"]), layout="chunks"
    )
    loc = quire.metadata(url + "1").record["units"]["pytree"]["tree"]["children"][0]["location"]
    np.testing.assert_array_equal(zarr.open_array(f"{url}1/{loc}", mode="r")[...], a)


# -- the suites, as the plugin's own tests would run them ------------------------------------
class TestAcmeBackend(BackendSuite):
    protocol = "acme"
    large_object_bytes = 1 << 20

    @pytest.fixture
    def backend_url(self) -> str:
        return f"acme://bucket/{uuid.uuid4().hex}"

    @pytest.fixture
    def storage_options(self) -> dict[str, Any]:
        return {"service": "suite"}


class TestAcmeXorCodec(CodecSuite):
    codec_id = "acme-xor"
    configurations = [{}, {"key": 7}]


class TestAcmeRoundCodec(CodecSuite):
    """An array-to-array codec, lossy, found through its entry point alone."""

    codec_id = "acme-round"
    kind = "array_to_array"
    configurations = [{}, {"decimals": 3}]
    tolerance = {"atol": 0.01}
    dtypes = ("float16", "float32", "float64")


class TestMoneyHandler(LeafHandlerSuite):
    handler_id = "acme-money"

    @pytest.fixture
    def values(self, acme: Any) -> list[Any]:
        return [acme.Money(Decimal("9.99"), "EUR"), acme.Money(Decimal("-1e-30"), "JPY")]


class TestTapeHandler(LeafHandlerSuite):
    handler_id = "acme-tape"

    @pytest.fixture
    def values(self, acme: Any) -> list[Any]:
        return [acme.Tape(b"\x00\x01 hello"), acme.Tape(b""), acme.Tape(bytes(range(256)) * 9)]


def test_verify_and_cp_check_a_third_party_handlers_data(acme: Any, tmp_path: Path) -> None:
    """``quire verify`` and ``quire cp`` know the acme-tape format only through its handler."""
    from quire._cli.main import main

    src, dst = tmp_path / "src", tmp_path / "dst"
    # Format v1 keeps the tape as its own file, which the test damages; in format v2 it
    # sits in a pack whose chunk index binds it (test_packed.py damages packs).
    with quire.Context(layout="chunks"):
        quire.save(str(src), {"t": acme.Tape(b"x" * 100), "w": np.arange(4)})
    assert main(["verify", str(src)]) == 0
    tape = next(p for p in src.rglob("tape") if p.is_file())
    blob = bytearray(tape.read_bytes())
    blob[10] ^= 0xFF
    tape.write_bytes(bytes(blob))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["verify", str(src)]) == 1
    assert "crc32 mismatch" in out.getvalue() and "/tape" in out.getvalue(), out.getvalue()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["cp", str(src), str(dst)]) != 0
    assert (
        "CorruptCheckpointError" in err.getvalue() and "tape fails verification" in err.getvalue()
    )
    assert not (dst / "quire.json").exists()


class TestRandomHandler(CheckpointableHandlerSuite):
    handler_id = "acme-random"

    @pytest.fixture
    def obj(self) -> random.Random:
        r = random.Random(99)
        r.gauss(0, 1)  # leaves a cached gauss value in the state
        return r

    def target(self, obj: Any) -> Any:
        return random.Random(0)

    def assert_restored(self, original: Any, restored: Any) -> None:
        assert restored.getstate() == original.getstate()

    def mutate(self, obj: Any) -> None:
        obj.random()
