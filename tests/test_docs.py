"""Every ```python block of README.md, docs/*.md and the plugin READMEs runs.

Blocks of one file run in order, in one namespace, in a fresh process whose working
directory is a temporary folder (forked from the test process's fork server,
``core/tests/forkserver.py``, which has JAX imported already).  A block that cannot run
here is preceded by ``<!-- docs-test: skip reason="..." -->`` (the reason is required and checked); a hidden
``<!-- docs-test: setup ... -->`` comment holds code run before the file's blocks (helpers
a snippet assumes, such as ``train_step``).
"""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import forkserver  # core/tests/forkserver.py
import pytest

REPO = Path(__file__).resolve().parents[1]
FILES = sorted(
    [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "backends").glob("*/README.md"),
     *(REPO / "plugins").glob("*/README.md")]
)  # fmt: skip
BLOCK = re.compile(
    r"(?:<!-- docs-test: skip(?P<skip>[^>]*)-->\n)?^```python\n(?P<code>.*?)^```", re.S | re.M
)
SETUP = re.compile(r"<!-- docs-test: setup\n(?P<code>.*?)-->", re.S)


def blocks(path: Path) -> tuple[str, list[tuple[str, str | None]]]:
    text = path.read_text()
    setup = "\n".join(m["code"] for m in SETUP.finditer(text))
    out = []
    for m in BLOCK.finditer(text):
        skip = m["skip"]
        reason = None
        if skip is not None:
            r = re.search(r'reason="([^"]+)"', skip)
            reason = r[1].strip() if r else ""
        out.append((m["code"], reason))
    return setup, out


def _body(code: str) -> str:
    """A block's code; its own ``from __future__`` line moves to the script's top."""
    return textwrap.dedent(code).replace("from __future__ import annotations\n", "")


def test_every_python_block_is_found_and_skips_give_a_reason() -> None:
    total = 0
    for path in FILES:
        text = path.read_text()
        _, found = blocks(path)
        assert len(found) == text.count("```python"), path
        for code, reason in found:
            assert reason is None or len(reason) > 10, f"{path}: skip without a reason:\n{code}"
        total += len(found)
    assert total >= 15


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_doc_code_blocks_run(path: Path, tmp_path: Path) -> None:
    setup, found = blocks(path)
    run = [code for code, reason in found if reason is None]
    if not run:
        assert found or "```python" not in path.read_text()
        return  # nothing runnable here: every block carries a checked skip reason
    script = "\n".join(
        [
            "from __future__ import annotations",
            "import os",
            "os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=3')",
            "os.environ.setdefault('JAX_PLATFORMS', 'cpu')",
            setup,
            *(f"# --- block {i}\n{_body(c)}" for i, c in enumerate(run)),
        ]
    )
    (tmp_path / "doc_blocks.py").write_text(script)
    # The README's Quickstart must also work a second time in the same directory (issue 14:
    # it used to fail on an existing checkpoint); it runs on 3 devices, which do not divide
    # its 1024-wide arrays.
    for attempt in ("first", "second")[: 2 if path.name == "README.md" else 1]:
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        p = forkserver.run(["doc_blocks.py"], env=env, cwd=tmp_path, timeout=240)
        assert p.returncode == 0, f"{path} ({attempt} run):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


def test_mkdocs_nav_lists_every_page() -> None:
    nav = set(re.findall(r"^\s*- [^:\n]+: (\S+\.md)$", (REPO / "mkdocs.yml").read_text(), re.M))
    for page in (REPO / "docs").glob("*.md"):
        assert page.name in nav, f"{page.name} is not in mkdocs.yml's nav"
    assert all((REPO / "docs" / p).is_file() for p in nav), nav


def test_api_reference_covers_the_public_api() -> None:
    """docs/api.md (rendered by mkdocstrings) documents every name in ``quire.__all__``,
    directly or through the public module that defines or re-exports it (``::: quire.errors``,
    ``::: quire.sources``, whose ``__all__`` mkdocstrings renders)."""
    import importlib

    import quire

    refs = set(re.findall(r"^::: (\S+)", (REPO / "docs" / "api.md").read_text(), re.M))
    exported = set()
    for ref in refs:
        try:
            mod = importlib.import_module(ref)
        except ImportError:
            continue
        exported |= {f"{ref}.{n}" for n in getattr(mod, "__all__", ())}
    missing = []
    for name in quire.__all__:
        if name.startswith("_"):
            continue
        obj = getattr(quire, name)
        module = getattr(obj, "__module__", None) or ""
        if f"quire.{name}" in refs or module in refs or f"{module}.{name}" in refs:
            continue
        if any(e.endswith(f".{name}") for e in exported):
            continue
        missing.append(name)
    assert missing == [], f"not in docs/api.md: {missing}"


def test_tests_and_files_the_docs_name_exist() -> None:
    """A doc that says "test_x checks this" or "tests/test_y.py runs it" stays true: the
    named test functions and files exist (skip reasons included)."""
    sources = "\n".join(
        f.read_text()
        for d in ("core/tests", "tests", "plugins", "backends")
        for f in (REPO / d).rglob("test*.py")
    )
    for path in FILES:
        text = path.read_text()
        for name in re.findall(r"\b(test_\w+)\b(?!\.py)", text):
            assert f"def {name}(" in sources, f"{path.name} names {name}, which does not exist"
        for rel in re.findall(r"\b((?:core/|plugins/\w+/|backends/\w+/)?tests/[\w/]+\.py)", text):
            if path.name == "writing-a-plugin.md" and rel == "tests/test_conformance.py":
                continue  # the layout of the reader's own plugin, not of this repository
            assert (REPO / rel).is_file(), f"{path.name} names {rel}, which does not exist"


def test_relative_links_lead_somewhere() -> None:
    """README and docs links to files of the repository resolve in a clone (the README once
    pointed at ../shared/DESIGN.md, outside the repository)."""
    for path in FILES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            resolved = (path.parent / target).resolve()
            assert resolved.is_relative_to(REPO), f"{path.name}: {target} leaves the repository"
            assert resolved.exists(), f"{path.name}: {target} does not exist"


def test_no_page_names_a_file_outside_the_repository() -> None:
    """The published site must not point outside the repository: docs/architecture.md named
    ``../shared/tools/import_circles.py``, a file beside the checkout (issue 31).  A ``../``
    path to a file in inline code must be a file of the repository, from the page's folder
    (fenced code blocks hold examples, not references, and are left out)."""
    for path in FILES:
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
        for span in re.findall(r"`([^`]+)`", text):
            for rel in re.findall(
                r"(?:^|\s)((?:\.\./)+[\w./-]+\.(?:py|md|txt|toml|ya?ml|json|sh))\b", span
            ):
                resolved = (path.parent / rel).resolve()
                assert resolved.is_relative_to(REPO) and resolved.is_file(), (
                    f"{path.relative_to(REPO)} names {rel}, which is not a file of the repository"
                )

