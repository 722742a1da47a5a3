"""Plugin registries: discovery through (fake) installed distributions, lazy loading,
collisions, broken plugins, handler choice by specificity, run-time registration, the
errors a missing plugin gives, and `quire plugins`."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import quire
from quire._format.record import record_checksum
from quire._handlers import select as _selection
from quire._runtime.registry import clear_caches, codecs, leaf_handlers, registries

REPO = Path(__file__).resolve().parents[2]

# -- fake installed distributions -----------------------------------------------------------


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """``install(dist, entry_points={group: {name: value}}, modules={name: source})`` puts a
    fake distribution (a real ``.dist-info`` folder) on ``sys.path``; removed afterwards."""
    added: list[str] = []

    def _install(
        dist: str,
        entry_points: dict[str, dict[str, str]],
        modules: dict[str, str] | None = None,
        version: str = "1.0",
    ) -> None:
        root = tmp_path / dist
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        eps = "".join(
            f"[{g}]\n" + "".join(f"{n} = {v}\n" for n, v in names.items()) + "\n"
            for g, names in entry_points.items()
        )
        (info / "entry_points.txt").write_text(eps)
        for name, src in (modules or {}).items():
            (root / f"{name}.py").write_text(textwrap.dedent(src))
            added.append(name)
        monkeypatch.syspath_prepend(str(root))
        clear_caches()

    yield _install
    monkeypatch.undo()
    for name in added:
        sys.modules.pop(name, None)
    clear_caches()


HANDLER_MODULE = """
    from dataclasses import dataclass

    IMPORTS = []
    IMPORTS.append(__name__)

    @dataclass
    class Point:
        x: int
        y: int

    class PointHandler:
        id = "point"
        types = (Point,)

        def handles(self, v): return isinstance(v, Point)
        def handles_abstract(self, a): return True
        def snapshot(self, entries): return list(entries)
        async def save(self, entries, ctx): return [{"xy": [e.value.x, e.value.y]} for e in entries]
        def check(self, entry): return None
        async def load(self, entries, ctx): return [Point(*e.record["xy"]) for e in entries]
        def metadata(self, records): return [Point for _ in records]

    def xor(**config):
        raise AssertionError("never called in these tests")
"""


def _plugins_output() -> str:
    from quire._cli.main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plugins"]) == 0
    return buf.getvalue()


# -- discovery ----------------------------------------------------------------------------


def test_builtins_come_through_entry_points() -> None:
    groups = {g: r.names() for g, r in registries.items()}
    assert {"file", "local", "memory"} <= set(groups["quire.backends"])
    assert {"zstd", "gzip", "blosc", "crc32c"} <= set(groups["quire.codecs"])
    builtin_leaves = {"numpy", "jax", "prng_key", "scalar", "str", "bytes", "none"}
    assert builtin_leaves <= set(groups["quire.leaf_handlers"])
    assert "json" in groups["quire.checkpointables"]
    for name in builtin_leaves:
        (ep,) = leaf_handlers.entry_points(name)
        assert ep.dist is not None and ep.dist.metadata["Name"] == "quire"
        assert leaf_handlers.distribution(name) == "quire"


def test_one_pass_over_the_installed_distributions_serves_every_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each group's registry used to read every installed distribution's metadata again
    (~15 ms each in a large environment; a first save or load touched two or three)."""
    from quire._handlers.codecs import distribution
    from quire._runtime import registry as _registry

    passes: list[dict[str, Any]] = []
    real = _registry.entry_points

    def counting(**kw: Any) -> Any:
        passes.append(kw)
        return real(**kw)

    monkeypatch.setattr(_registry, "entry_points", counting)
    clear_caches()
    try:
        groups = {g: r.names() for g, r in registries.items()}
        assert distribution("no-such-codec") is None  # zarr's groups: the same snapshot
        assert len(passes) == 1, passes
        assert "numpy" in groups["quire.leaf_handlers"] and "file" in groups["quire.backends"]
        codecs.clear_cache()  # one registry's clear takes a new snapshot
        assert "zstd" in codecs.names()
        assert len(passes) == 2
    finally:
        monkeypatch.undo()
        clear_caches()


def test_a_plugin_is_imported_only_when_used(install: Callable[..., None], tmp_path: Path) -> None:
    install(
        "quire-lazy",
        {"quire.codecs": {"lazy-codec": "lazy_mod:xor"}},
        {"lazy_mod": HANDLER_MODULE},
    )
    assert "lazy-codec" in codecs.names()
    quire.save(str(tmp_path / "c"), {"x": np.ones(3)})
    assert "lazy_mod" not in sys.modules  # scanned, never imported
    assert callable(codecs.get("lazy-codec"))
    assert "lazy_mod" in sys.modules


def test_installed_leaf_handler_for_a_custom_class(
    install: Callable[..., None], tmp_path: Path
) -> None:
    install(
        "quire-points",
        {"quire.leaf_handlers": {"point": "points_mod:PointHandler"}},
        {"points_mod": HANDLER_MODULE},
    )
    import points_mod  # type: ignore[import-not-found]

    url = str(tmp_path / "c")
    quire.save(url, {"p": points_mod.Point(1, 2), "a": np.arange(3)})
    got = quire.load(url)
    assert got["p"] == points_mod.Point(1, 2)
    assert points_mod.IMPORTS == ["points_mod"]  # loaded once


# -- collisions -----------------------------------------------------------------------------


def test_two_distributions_claiming_a_name(install: Callable[..., None], tmp_path: Path) -> None:
    mod = HANDLER_MODULE.replace('id = "point"', 'id = "dup"')
    install("quire-dup-a", {"quire.leaf_handlers": {"dup": "dup_a:PointHandler"}}, {"dup_a": mod})
    install("quire-dup-b", {"quire.leaf_handlers": {"dup": "dup_b:PointHandler"}}, {"dup_b": mod})
    with pytest.raises(quire.errors.PluginError) as e:
        leaf_handlers.get("dup")
    msg = str(e.value)
    assert "quire-dup-a" in msg and "quire-dup-b" in msg
    assert "plugins={'quire.leaf_handlers:dup': '<distribution>'}" in msg
    # Other handlers keep working; `quire plugins` shows the conflict.
    quire.save(str(tmp_path / "c"), {"x": np.ones(2)})
    out = _plugins_output()
    assert out.count("conflict: provided by quire-dup-a and quire-dup-b") == 2

    # A configuration choice is the way out, globally or for a block.
    with quire.Context(plugins={"quire.leaf_handlers:dup": "quire-dup-b"}):
        assert leaf_handlers.get("dup").__module__ == "dup_b"
        assert "not chosen" in _plugins_output()
    with quire.Context(plugins={"quire.leaf_handlers:dup": "Quire_Dup_A"}):  # PEP 503 names
        assert leaf_handlers.get("dup").__module__ == "dup_a"
    with (
        quire.Context(plugins={"quire.leaf_handlers:dup": "quire-dup-c"}),
        pytest.raises(quire.errors.PluginError, match="'quire-dup-c' is neither"),
    ):
        leaf_handlers.get("dup")
    saved = quire._runtime.config.current()
    try:
        quire.configure(plugins={"quire.leaf_handlers:dup": "quire-dup-a"})
        assert leaf_handlers.get("dup").__module__ == "dup_a"
    finally:
        quire.configure(saved)


def test_same_distribution_seen_twice_is_no_conflict(
    install: Callable[..., None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install(
        "quire-twice", {"quire.codecs": {"twice": "twice_mod:xor"}}, {"twice_mod": HANDLER_MODULE}
    )
    monkeypatch.syspath_prepend(str(tmp_path / "quire-twice"))  # on sys.path twice
    clear_caches()
    assert len(codecs.entry_points("twice")) == 1
    assert callable(codecs.get("twice"))


# -- broken plugins -------------------------------------------------------------------------


def test_a_broken_plugin_never_breaks_quire(install: Callable[..., None], tmp_path: Path) -> None:
    install(
        "quire-broken",
        {
            "quire.leaf_handlers": {"broken": "broken_mod:Handler"},
            "quire.backends": {"brk": "broken_mod:Backend"},
        },
        {"broken_mod": "raise ImportError('libfoo.so: cannot open shared object file')\n"},
    )
    # import quire, and saves that do not need the plugin, work.
    url = str(tmp_path / "c")
    quire.save(url, {"x": np.ones(2)})
    np.testing.assert_array_equal(quire.load(url)["x"], np.ones(2))
    # Using it raises PluginError with the reason and the import error as cause.
    with pytest.raises(quire.errors.PluginError, match=r"quire-broken.*libfoo\.so") as e:
        quire.save("brk://bucket/x", {"x": 1})
    assert isinstance(e.value.__cause__, ImportError)
    with pytest.raises(quire.errors.PluginError, match="failed to import"):
        _selection.get("broken")
    out = _plugins_output()
    line = next(ln for ln in out.splitlines() if ln.split()[:1] == ["broken"])
    assert "quire-broken" in line and "1.0" in line
    assert "failed: ImportError: libfoo.so: cannot open shared object file" in line


def test_import_quire_with_a_broken_plugin_in_a_fresh_process(
    install: Callable[..., None],
) -> None:
    import os
    import subprocess

    install(
        "quire-broken2",
        {g: {"broken2": "broken2_mod:X"} for g in registries},
        {"broken2_mod": "raise RuntimeError('boom')\n"},
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [sys.executable, "-m", "quire._cli.main", "plugins"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("failed: RuntimeError: boom") == len(registries)  # one per group
    assert "memory" in r.stdout


# -- missing plugins ------------------------------------------------------------------------


def test_missing_leaf_handler_names_the_id_and_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "c")
    quire.save(url, {"x": np.ones(2), "s": "text"})
    rec = json.loads((tmp_path / "c" / "quire.json").read_text())
    rec["units"]["pytree"]["tree"]["children"][0]["handler"] = "torch"
    rec["units"]["pytree"]["tree"]["children"][1]["handler"] = "fancy-strings"
    rec["checksum"] = record_checksum(rec)
    (tmp_path / "c" / "quire.json").write_text(json.dumps(rec))
    # As if quire-torch were not installed:
    scanned = dict(leaf_handlers._scan())
    scanned.pop("torch", None)
    monkeypatch.setattr(leaf_handlers, "_eps", scanned)
    _selection.clear_instances()
    with pytest.raises(quire.errors.PluginError, match=r"'torch'.*install quire-torch \(pip install"):
        quire.load(url)
    rec["units"]["pytree"]["tree"]["children"][0]["handler"] = "numpy"
    rec["checksum"] = record_checksum(rec)
    (tmp_path / "c" / "quire.json").write_text(json.dumps(rec))
    with pytest.raises(quire.errors.PluginError, match=r"'fancy-strings'.*install the package"):
        quire.load(url)


def test_missing_codec_names_the_id(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    quire.save(url, {"x": np.arange(10.0)}, storage=quire.StorageOptions(codecs=["zstd"]))
    path = tmp_path / "c" / "quire.json"
    rec = json.loads(path.read_text())
    rec["units"]["pytree"]["tree"]["children"][0]["codecs"][0]["name"] = "zippy"
    rec["checksum"] = record_checksum(rec)
    path.write_text(json.dumps(rec))
    with pytest.raises(quire.errors.PluginError, match=r"no quire\.codecs plugin named 'zippy'"):
        quire.load(url)
    with pytest.raises(quire.errors.PluginError, match="'zippy'"):
        quire.save(
            str(tmp_path / "d"), {"x": np.ones(3)}, storage=quire.StorageOptions(codecs=["zippy"])
        )


def test_missing_backend_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    backends = registries["quire.backends"]
    scanned = {k: v for k, v in backends._scan().items() if k not in ("s3", "gs")}
    monkeypatch.setattr(backends, "_eps", scanned)  # as if quire-s3/quire-gcs were absent
    with pytest.raises(quire.errors.PluginError, match=r"s3://.*install quire-s3 \(pip install quire-s3"):
        quire.load("s3://bucket/x")
    with pytest.raises(quire.errors.PluginError, match="install quire-gcs"):
        quire.metadata("gs://bucket/x")


def test_install_hints_name_the_distribution_and_the_checkout_path() -> None:
    from quire._runtime.install import install_hint

    hint = install_hint("quire-s3")
    assert hint.startswith("pip install quire-s3")
    assert f"pip install -e {REPO / 'backends' / 's3'}" in hint
    err = registries["quire.backends"]._missing("s3", "")
    assert "pip install -e" in str(err) or "quire-s3" not in str(err)


# -- handler choice -------------------------------------------------------------------------


class Base:
    pass


class Derived(Base):
    pass


class MoreDerived(Derived):
    pass


def _handler(hid: str, types: Any = None, priority: int = 0, accept: Any = None) -> Any:
    class H:
        id = hid

        def handles(self, v: Any) -> bool:
            return accept is None or accept(v)

        def handles_abstract(self, a: Any) -> bool:
            return True

        def snapshot(self, entries: Any) -> list[Any]:
            return list(entries)

        async def save(self, entries: Any, ctx: Any) -> list[dict[str, Any]]:
            return [{"cls": type(e.value).__name__} for e in entries]

        def check(self, entry: Any) -> None:
            return None

        async def load(self, entries: Any, ctx: Any) -> list[Any]:
            kinds = {"Base": Base, "Derived": Derived, "MoreDerived": MoreDerived}
            return [kinds[e.record["cls"]]() for e in entries]

        def metadata(self, records: Any) -> list[Any]:
            return [object for _ in records]

    h = H()
    if types is not None:
        h.types = types  # type: ignore[attr-defined]
    h.priority = priority  # type: ignore[attr-defined]
    return h


@pytest.fixture
def registered() -> Iterator[Callable[[Any], Any]]:
    ids: list[str] = []

    def reg(h: Any) -> Any:
        ids.append(h.id)
        return quire.handlers.register_leaf_handler(h)

    yield reg
    for i in ids:
        quire.handlers.unregister_leaf_handler(i)


def test_most_specific_type_wins(registered: Callable[[Any], Any]) -> None:
    base, derived = _handler("h-base", (Base,)), _handler("h-derived", (Derived,), priority=-5)
    generic = _handler("h-generic", None, priority=100, accept=lambda v: isinstance(v, Base))
    for h in (generic, base, derived):
        registered(h)
    assert _selection.for_value(Base()) is base
    assert _selection.for_value(Derived()) is derived  # despite its lower priority
    assert _selection.for_value(MoreDerived()) is derived  # nearest in the MRO
    assert _selection.for_value(object()) is None
    assert [h.id for h in _selection.ranked(MoreDerived)][:3] == ["h-derived", "h-base", "h-generic"]


def test_priority_then_handles_break_ties(registered: Callable[[Any], Any]) -> None:
    low = registered(_handler("h-low", (Derived,), priority=0))
    high = registered(_handler("h-high", (Derived,), priority=1, accept=lambda v: v.ok))
    d = Derived()
    d.ok = True  # type: ignore[attr-defined]
    assert _selection.for_value(d) is high
    d.ok = False  # type: ignore[attr-defined]
    assert _selection.for_value(d) is low  # the winner declined: next in rank


def test_builtins_keep_their_choice() -> None:
    import jax

    assert _selection.for_value(np.ones(2)).id == "numpy"
    assert _selection.for_value(jax.numpy.ones(2)).id == "jax"
    assert _selection.for_value(jax.random.key(0)).id == "prng_key"
    assert _selection.for_value(np.float32(1)).id == "scalar"
    assert _selection.for_value(True).id == "scalar"
    assert _selection.for_value("s").id == "str"
    assert _selection.for_value(b"s").id == "bytes"
    assert _selection.for_value(None).id == "none"
    assert _selection.for_value(object()) is None


def test_run_time_registration_round_trip(tmp_path: Path) -> None:
    @quire.handlers.register_leaf_handler
    class PointHandler:
        id = "rt-base"
        types = (Base,)

        def handles(self, v: Any) -> bool:
            return True

        def handles_abstract(self, a: Any) -> bool:
            return True

        def snapshot(self, entries: Any) -> list[Any]:
            return list(entries)

        async def save(self, entries: Any, ctx: Any) -> list[dict[str, Any]]:
            return [{} for _ in entries]

        def check(self, entry: Any) -> None:
            return None

        async def load(self, entries: Any, ctx: Any) -> list[Any]:
            return [Base() for _ in entries]

        def metadata(self, records: Any) -> list[Any]:
            return [Base for _ in records]

    url = str(tmp_path / "c")
    try:
        assert isinstance(PointHandler, type)  # the decorator returns the class
        quire.save(url, {"b": Base()})
        assert isinstance(quire.load(url)["b"], Base)
        assert "rt-base" in _plugins_output()
    finally:
        quire.handlers.unregister_leaf_handler("rt-base")
    with pytest.raises(quire.errors.PluginError, match="'rt-base'"):
        quire.load(url)
    with pytest.raises(quire.errors.UnsupportedLeafError):
        quire.save(str(tmp_path / "d"), {"b": Base()})


def test_registration_is_checked() -> None:
    with pytest.raises(TypeError, match="no str `id`"):
        quire.handlers.register_leaf_handler(object())
    with pytest.raises(TypeError, match="no `handles`"):
        quire.checkpointables.register_checkpointable_handler(type("X", (), {"id": "x"}))


# -- checkpointable handlers for types you do not own ---------------------------------------


class Vocab:
    """A type "from another library": this test does not control it."""

    def __init__(self, words: list[str]) -> None:
        self.words = words


class VocabHandler:
    id = "vocab"

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, Vocab)

    def save(self, obj: Vocab, io: Any) -> Any:
        io.write("words.txt", "\n".join(obj.words).encode())
        return {"n": len(obj.words)}

    def load(self, io: Any, record: Any, target: Any) -> Vocab:
        words = io.read("words.txt").decode().split("\n")
        assert len(words) == record["n"]
        return Vocab(words)


def test_run_time_checkpointable_handler(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    assert quire.checkpointables.register_checkpointable_handler(VocabHandler) is VocabHandler
    try:
        quire.save_checkpointables(url, {"vocab": Vocab(["a", "b"]), "state": {"w": np.ones(2)}})
        assert quire.metadata(url).units["vocab"] == "vocab"
        assert quire.load_checkpointables(url, {"vocab": None})["vocab"].words == ["a", "b"]
    finally:
        quire.checkpointables.unregister_checkpointable_handler("vocab")
    with pytest.raises(quire.errors.PluginError, match="'vocab'"):
        quire.load_checkpointables(url, {"vocab": None})


VOCAB_MODULE = """
    class VocabHandler:
        id = "vocab"

        def handles(self, obj):
            return type(obj).__name__ == "Vocab"

        def save(self, obj, io):
            io.write_json("words.json", obj.words)
            return None

        def load(self, io, record, target):
            target.words = io.read_json("words.json")
            return target
"""


def test_installed_checkpointable_handler(install: Callable[..., None], tmp_path: Path) -> None:
    install(
        "quire-vocab",
        {"quire.checkpointables": {"vocab": "vocab_mod:VocabHandler"}},
        {"vocab_mod": VOCAB_MODULE},
    )
    url = str(tmp_path / "c")
    quire.save_checkpointables(url, {"vocab": Vocab(["x"])})
    assert quire.metadata(url).units == {"vocab": "vocab"}
    assert quire.load_checkpointables(url, {"vocab": Vocab([])})["vocab"].words == ["x"]


# -- `quire plugins` --------------------------------------------------------------------------


def test_quire_plugins_lists_every_group_and_status() -> None:
    out = _plugins_output()
    for g in registries:
        assert f"{g}:" in out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.startswith("  ")}
    assert rows["memory"][1:4] == ["quire", quire.__version__, "ok"]
    assert rows["zstd"][1:4] == ["quire", quire.__version__, "ok"]
    assert rows["json"][1:4] == ["quire", quire.__version__, "ok"]


def test_pytest_plugin_is_registered(
    pytestconfig: pytest.Config, quire_url: str, quire_fresh_registry: None
) -> None:
    """quire's pytest11 plugin is loaded (without importing quire) and gives fixtures."""
    plugin = pytestconfig.pluginmanager.get_plugin("quire")
    assert plugin is not None and plugin.__name__ == "_quire_pytest"
    quire.save(quire_url, {"x": np.arange(3)})
    np.testing.assert_array_equal(quire.load(quire_url)["x"], np.arange(3))


def test_pytest_plugin_does_not_import_quire_or_jax() -> None:
    """pytest loads its plugins before any conftest: JAX must still be configurable then."""
    import subprocess

    code = "import sys, _quire_pytest; print(sorted({'quire', 'jax'} & set(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_missing_plugin_error_names_the_package_from_the_record(tmp_path: Any) -> None:
    """A checkpoint records which distribution provided each third-party plugin; a reader
    without it is told what the record claims (issue 13: never as quire's advice)."""
    import json

    import numpy as np

    url = str(tmp_path / "c")
    quire.save(url, {"w": np.ones(3)})
    with open(f"{url}/quire.json") as f:
        doc = json.load(f)
    leaf = doc["units"]["pytree"]["tree"]["children"][0]
    leaf["handler"] = "acme-gone"
    doc["plugins"] = {"quire.leaf_handlers:acme-gone": "acme-gone-dist"}
    doc["checksum"] = record_checksum(doc)
    with open(f"{url}/quire.json", "w") as f:
        json.dump(doc, f)
    # The record is untrusted: its claim is quoted, not turned into install advice.
    with pytest.raises(
        quire.errors.PluginError, match="written with plugin distribution 'acme-gone-dist'"
    ) as e:
        quire.load(url)
    assert "pip install acme-gone-dist" not in str(e.value)


ZARR_ONLY_MODULE = """
    from dataclasses import dataclass

    import numpy as np
    from zarr.abc.codec import BytesBytesCodec

    @dataclass(frozen=True)
    class Invert(BytesBytesCodec):
        is_fixed_size = True

        @classmethod
        def from_dict(cls, data):
            return cls()

        def to_dict(self):
            return {"name": "zonly-invert"}

        async def _encode_single(self, buf, spec):
            return type(buf).from_bytes((~buf.as_numpy_array()).tobytes())

        async def _decode_single(self, buf, spec):
            return type(buf).from_bytes((~buf.as_numpy_array()).tobytes())

        def compute_encoded_size(self, n, spec):
            return n
"""


def test_a_codec_only_zarr_knows_is_named_with_its_distribution(
    install: Callable[..., None], tmp_path: Path
) -> None:
    """A codec a third party registers with zarr (group ``zarr.codecs``), not with quire, is
    found by name, and the record names its distribution for a reader that lacks it."""
    from zarr.registry import register_codec

    install(
        "zarr-only-codec",
        {"zarr.codecs": {"zonly-invert": "zonly_mod:Invert"}},
        {"zonly_mod": ZARR_ONLY_MODULE},
    )
    import zonly_mod  # zarr read its entry points at import, before this install

    register_codec("zonly-invert", zonly_mod.Invert)
    url = str(tmp_path / "c")
    x = np.arange(100, dtype=np.int16)
    quire.save(url, {"x": x}, storage=quire.StorageOptions(codecs=["zonly-invert"]))
    np.testing.assert_array_equal(quire.load(url)["x"], x)
    record = quire.metadata(url).record
    assert record["plugins"] == {"quire.codecs:zonly-invert": "zarr-only-codec"}
    assert [c["name"] for c in record["units"]["pytree"]["tree"]["children"][0]["codecs"]] == [
        "zonly-invert"
    ]
