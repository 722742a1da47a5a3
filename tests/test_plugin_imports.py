"""First-party plugins use only quire's public API (DESIGN.md "Plugin contracts").

Every module of every package under ``backends/`` and ``plugins/`` is parsed; an import
of a private quire module (``quire._x``, ``from quire import _x``, or
``importlib.import_module("quire._x")``) fails the test with the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _private(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "quire" and any(p.startswith("_") for p in parts[1:])


def private_imports(source: str) -> list[tuple[int, str]]:
    """``(line, imported name)`` of every private quire import in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            found += [(node.lineno, n) for n in [node.module, *names] if _private(n)][:1]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and _private(node.args[0].value)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def plugin_sources() -> list[Path]:
    return sorted(
        p
        for top in ("backends", "plugins")
        for src in (ROOT / top).glob("*/src")
        for p in src.rglob("*.py")
    )


def test_the_scanner_sees_every_form_of_private_import() -> None:
    src = (
        "import quire._runtime.ioloop\nfrom quire._store.retries import RetryPolicy\nfrom quire import _config\n"
        "from quire.handlers import LoadEntry\nimport importlib\n"
        "importlib.import_module('quire._handlers.arrays')\nimport quire\n"
    )
    assert [n for _, n in private_imports(src)] == [
        "quire._runtime.ioloop",
        "quire._store.retries",
        "quire._config",
        "quire._handlers.arrays",
    ]


def test_first_party_plugins_import_no_private_quire_module() -> None:
    files = plugin_sources()
    names = {p.relative_to(ROOT).parts[1] for p in files}
    assert {"s3", "gcs", "torch"} <= names, names  # the scan found the packages
    bad = [
        f"{p.relative_to(ROOT)}:{line}: {name}"
        for p in files
        for line, name in private_imports(p.read_text())
    ]
    assert not bad, "plugins must use quire's public API only:\n" + "\n".join(bad)
