"""Every installed plugin has a quire.testing conformance suite run against it.

The test imports every test module of the workspace (core, backends, plugins and the
cross-distribution tests), collects the suite subclasses pytest would run, and compares
what they cover (``protocol`` / ``codec_id`` / ``handler_id``) with every installed entry
point of quire's four groups.  Installing a plugin without running its suite fails here.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from quire.testing import coverage

ROOT = Path(__file__).resolve().parents[2]
TEST_DIRS = [
    ROOT / "core" / "tests",
    ROOT / "tests",
    *sorted((ROOT / "backends").glob("*/tests")),
    *sorted((ROOT / "plugins").glob("*/tests")),
]


def _test_files() -> list[Path]:
    return sorted(p for d in TEST_DIRS if d.is_dir() for p in d.glob("test_*.py"))


def test_every_installed_plugin_runs_a_suite() -> None:
    modules, errors = coverage.import_test_modules(_test_files())
    assert modules
    suites = coverage.suites()
    missing = coverage.uncovered(suites)
    if missing:
        lines = [f"  {m}" for m in missing]
        hint = "".join(f"\n  (could not import {p}: {e})" for p, e in errors.items())
        pytest.fail(
            "installed plugins without a conformance suite run against them "
            "(subclass the matching quire.testing suite in the plugin's tests):\n"
            + "\n".join(lines)
            + hint
        )


def test_the_check_sees_what_is_covered() -> None:
    """The built-ins are covered by name or as aliases (file/local: one backend class)."""
    coverage.import_test_modules(_test_files())
    covered = {pair for c in coverage.suites() for pair in coverage.covered_by(c)}
    assert ("quire.codecs", "zstd") in covered
    assert ("quire.leaf_handlers", "prng_key") in covered
    assert ("quire.checkpointables", "json") in covered
    assert ("quire.backends", "memory") in covered
    local = [i for i in coverage.installed() if (i.group, i.name) == ("quire.backends", "local")]
    assert local and not [u for u in coverage.uncovered(coverage.suites()) if u in local]


def test_an_uncovered_plugin_is_reported(install: Callable[..., None]) -> None:
    install("quire-nosuite", {"quire.leaf_handlers": {"nosuite": "nosuite_mod:Handler"}})
    rows = coverage.uncovered(coverage.suites())
    assert [str(r) for r in rows if r.name == "nosuite"] == [
        "quire.leaf_handlers:nosuite (nosuite_mod:Handler, from quire-nosuite)"
    ]
    assert not [
        r
        for r in coverage.uncovered(coverage.suites(), ignore_distributions=["Quire_NoSuite"])
        if r.name == "nosuite"
    ]

    class TestNoSuite(coverage_base("LeafHandlerSuite")):  # type: ignore[misc]
        handler_id = "nosuite"

    try:
        assert not [r for r in coverage.uncovered(coverage.suites()) if r.name == "nosuite"]
    finally:
        del TestNoSuite
        gc.collect()  # drop it from the suite's __subclasses__()


def coverage_base(name: str) -> type:
    import quire.testing

    base = getattr(quire.testing, name)
    assert isinstance(base, type)
    return base


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """A fake installed distribution (a .dist-info folder on sys.path)."""
    from quire._runtime.registry import clear_caches

    def _install(dist: str, entry_points: dict[str, dict[str, str]]) -> None:
        info = tmp_path / dist / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(
            "".join(
                f"[{g}]\n" + "".join(f"{n} = {v}\n" for n, v in names.items())
                for g, names in entry_points.items()
            )
        )
        monkeypatch.syspath_prepend(str(tmp_path / dist))
        clear_caches()

    yield _install
    monkeypatch.undo()
    clear_caches()
    assert str(tmp_path) not in " ".join(sys.path)
