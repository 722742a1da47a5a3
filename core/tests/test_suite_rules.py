"""The test suite's own rules (CONTRIBUTING.md, "Where tests go" and "Running the tests"):
tests leave no temporary folders behind; the quick tier touches every room; CI runs the
README's test command."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the quick tier (CONTRIBUTING.md)

REPO = Path(__file__).resolve().parents[2]


def test_tests_use_tmp_path_not_tempfile() -> None:
    """The suite must not leave temporary directories behind: tests use ``tmp_path``."""
    offenders = []
    for d in ("core/tests", "tests", "plugins", "backends"):
        for f in (REPO / d).rglob("test*.py"):
            text = f.read_text()
            if re.search(r"tempfile\.(mkdtemp|mkstemp|TemporaryDirectory)\(", text):
                offenders.append(str(f.relative_to(REPO)))
    assert offenders == [], offenders
    assert not (REPO / "core/tests/test_partial.py").read_text().count("quire-model-")


# ----------------------------------------------------------------------------- quick tier
def _test_files() -> list[Path]:
    trees = [REPO / "core" / "tests", REPO / "tests", *sorted(REPO.glob("plugins/*/tests"))]
    return [f for tree in trees for f in sorted(tree.rglob("test_*.py"))]


def _quire_imports(path: Path) -> set[str]:
    """The quire modules a test file imports (``from quire import x`` counts ``quire.x``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m == "quire" or m.startswith("quire.")}


def test_the_quick_tier_touches_every_room() -> None:
    """``pytest -m quick`` (CONTRIBUTING.md, "Running the tests") runs tests of every room:
    for each room of ``test_architecture.ORDER`` some file with quick tests imports one of
    its modules, and every subpackage of ``quire`` is in a room."""
    from test_architecture import ORDER, SRC

    quick = [f for f in _test_files() if "pytest.mark.quick" in f.read_text()]
    imported = set().union(*(_quire_imports(f) for f in quick))
    untouched = [
        room
        for room, prefixes in ORDER
        if not any(m == p or m.startswith(p + ".") for m in imported for p in prefixes)
    ]
    assert untouched == [], f"no quick test imports a module of the rooms {untouched}"
    rooms = {p for _, prefixes in ORDER for p in prefixes}
    subpackages = {f"quire.{d.name}" for d in SRC.iterdir() if (d / "__init__.py").is_file()}
    assert subpackages <= rooms, sorted(subpackages - rooms)


# ----------------------------------------------------------------------------- CI
def test_ci_runs_the_readme_test_command() -> None:
    """``.ci/run`` runs the suite exactly as the README tells a contributor to."""
    readme = (REPO / "README.md").read_text()
    setup = re.search(
        r"^python3 -m venv \.venv && (.*) && (\.venv/bin/python -m pytest.*)$", readme, re.M
    )
    assert setup, "README.md: no test command line"
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert setup[2] in ci, f".ci/run does not run the README's {setup[2]!r}"
    assert "pip install" in setup[1] and "-r requirements-dev.txt" in setup[1]
    assert any("pip install" in line and "-r requirements-dev.txt" in line for line in ci)
    for doc in ("docs/install.md", "CONTRIBUTING.md"):
        assert setup[2] in (REPO / doc).read_text(), f"{doc} does not give {setup[2]!r}"
