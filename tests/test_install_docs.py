"""Issue 14, the newcomer's first hour: install docs for every distribution, the CPU torch
build, the uv path, the demo, and the suite's temporary-folder check."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _members() -> dict[str, str]:
    """Distribution name -> folder, for every workspace member."""
    out = {}
    for pyproject in [REPO / "core" / "pyproject.toml",
                      *sorted(REPO.glob("backends/*/pyproject.toml")),
                      *sorted(REPO.glob("plugins/*/pyproject.toml"))]:  # fmt: skip
        name = tomllib.loads(pyproject.read_text())["project"]["name"]
        out[name] = str(pyproject.parent.relative_to(REPO))
    return out


def test_install_docs_cover_every_distribution() -> None:
    """docs/install.md says how to install every member from a checkout and by its
    published name; quire's install hints know every member's folder."""
    from quire._runtime.install import MEMBERS, install_hint

    members = _members()
    assert set(members) >= {"quire", "quire-s3", "quire-gcs", "quire-torch", "quire-orbax"}
    assert members == MEMBERS
    doc = (REPO / "docs" / "install.md").read_text()
    published = re.search(r"^pip install (quire .*)$", doc, re.M)
    assert published, "install.md lacks the published-name form"
    for name, folder in members.items():
        assert f"pip install -e ./{folder}" in doc, f"install.md: no checkout install of {name}"
        assert name in published[1].split(), f"install.md: {name} missing from the pip line"
        assert f"`{name}` | `{folder}/`" in doc, f"install.md's table lacks {name}"
        assert install_hint(name).endswith(f"pip install -e {REPO / folder}"), name
    for readme in [*REPO.glob("backends/*/README.md"), *REPO.glob("plugins/*/README.md")]:
        folder = str(readme.parent.relative_to(REPO))
        text = readme.read_text()
        assert f"pip install -e ./{folder}" in text or "docs/install.md" in text, readme


def test_the_first_party_table_matches_every_plugin_member() -> None:
    """quire._runtime.install.FIRST_PARTY_PLUGINS, the one table the install hints read, has
    a row per plugin member with that member's folder and exactly the quire entry points its
    pyproject.toml declares; every name it provides gets that distribution in the hint of
    a missing plugin."""
    from quire._runtime.install import FIRST_PARTY_PLUGINS
    from quire._runtime.registry import registries

    declared = {}
    for pyproject in [
        *REPO.glob("backends/*/pyproject.toml"),
        *REPO.glob("plugins/*/pyproject.toml"),
    ]:
        project = tomllib.loads(pyproject.read_text())["project"]
        groups = project.get("entry-points", {})
        points = sorted(
            f"{g}:{n}" for g, names in groups.items() if g.startswith("quire.") for n in names
        )
        declared[project["name"]] = (str(pyproject.parent.relative_to(REPO)), points)
    assert {p.distribution: (p.folder, sorted(p.provides)) for p in FIRST_PARTY_PLUGINS} == declared
    for p in FIRST_PARTY_PLUGINS:
        for point in p.provides:
            group, name = point.split(":")
            assert f"install {p.distribution} (" in str(registries[group]._missing(name, "")), point


def test_torch_cpu_build_is_documented_and_the_test_setup_keeps_it() -> None:
    cpu = "--index-url https://download.pytorch.org/whl/cpu"
    assert cpu in (REPO / "docs" / "install.md").read_text()
    assert cpu in (REPO / "plugins" / "torch" / "README.md").read_text()
    # requirements-dev.txt pins torch to one version, so pip keeps an installed CPU build
    # rather than resolving a CUDA wheel; the pin matches ci/constraints.txt.
    req = (REPO / "requirements-dev.txt").read_text()
    pin = re.search(r"^torch==(\S+)$", req, re.M)
    assert pin, "requirements-dev.txt must pin torch exactly"
    constraints = (REPO / "ci" / "constraints.txt").read_text()
    assert re.search(rf"^torch==({re.escape(pin[1])}|{re.escape(pin[1])}\+cpu)$", constraints, re.M)


def test_uv_workspace_needs_only_the_package_index() -> None:
    """No member names an extra index (the unreachable pytorch index broke `uv sync`)."""
    for pyproject in [REPO / "pyproject.toml", *REPO.glob("*/pyproject.toml"),
                      *REPO.glob("*/*/pyproject.toml")]:  # fmt: skip
        if ".venv" in pyproject.parts:
            continue
        doc = tomllib.loads(pyproject.read_text())
        uv = doc.get("tool", {}).get("uv", {})
        assert "index" not in uv and "extra-index-url" not in uv, pyproject
        assert "index-url" not in uv and "find-links" not in uv, pyproject
        for src in uv.get("sources", {}).values():
            assert "index" not in src, (pyproject, src)
    root = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert set(root["tool"]["uv"]["workspace"]["members"]) == {"core", "backends/*", "plugins/*"}
    assert "uv sync" in (REPO / "docs" / "install.md").read_text()
    assert "uv sync" in (REPO / "README.md").read_text()


def test_demo_uses_the_public_api_and_leaves_nothing_behind(tmp_path: Path) -> None:
    demo = REPO / "examples" / "demo.py"
    tree = ast.parse(demo.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("quire._"), node.module
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith("quire._") for a in node.names)
        if isinstance(node, ast.Attribute):
            assert not (isinstance(node.value, ast.Name) and node.value.id == "quire"
                        and node.attr.startswith("_")), ast.unparse(node)  # fmt: skip
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    p = subprocess.run([sys.executable, str(demo)], env=env, capture_output=True, text=True,
                       timeout=240)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    # it runs the real `quire` command, and what it prints is what it did
    assert "$ quire info" in p.stdout and "$ quire verify" in p.stdout
    assert "OK, " in p.stdout and "every array equal to what was saved: True" in p.stdout
    assert list(tmp.iterdir()) == [], "the demo left its temporary directory behind"


def test_the_suite_fails_when_it_leaves_quire_temp_dirs(tmp_path: Path) -> None:
    """The root conftest's check, run on a tiny suite that leaks one folder."""
    shutil.copy(REPO / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(REPO / "isolation_guard.py", tmp_path / "isolation_guard.py")
    (tmp_path / "test_leak.py").write_text(
        "import tempfile as t\n\n"  # (not spelled out: test_cli scans for it)
        "def test_leaks():\n    t.mkdtemp(prefix='quire-leaky-')\n\n"
        "def test_clean(tmp_path):\n    (tmp_path / 'x').write_text('fine')\n"
    )
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)]
    p = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "2 passed" in p.stdout, p.stdout
    assert "quire-leaky-" in p.stdout and "left 1 quire-* temporary folder" in p.stdout
    (tmp_path / "test_leak.py").write_text("def test_clean():\n    pass\n")
    p = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "left behind" not in p.stdout, p.stdout
