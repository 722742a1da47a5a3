"""Every dotted quire name the documentation and the docstrings mention resolves: a renamed
module or a removed function leaves no stale reference behind (issue 38).

Checked: ``quire.<module>.<name>...`` anywhere in ``docs/*.md``, the READMEs and every
docstring of the package; and the ``_room/module.Name`` paths of ``docs/architecture.md``
(the map of the code).  A name resolves when its longest importable prefix is a module and
the rest are attributes.  Some dotted words are not Python names: the entry-point groups
(``quire.codecs``), keys of the commit record and of the chunk index (``quire.metrics``,
``quire.crc32c``) and the record's file name ``quire.json``; they are listed below, each
checked against the code that defines it.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Any

import pytest

import quire
from quire._format.root import METRICS_KEY
from quire._runtime.config import GROUPS

SRC = Path(quire.__file__).parent
REPO = SRC.parents[2]

#: Dotted words that are data, not Python: entry-point groups, record and index keys.
NOT_PYTHON = {*GROUPS, METRICS_KEY, "quire.json"}
#: The chunk index's maps (docs/format.md), checked against the writer's source below.
INDEX_MAPS = {"quire.crc32c", "quire.crc32", "quire.shards", "quire.borrowed", "quire.xxh3"}

DOTTED = re.compile(r"(?<![\w./-])quire(?:\.[A-Za-z_]\w*)+")
ROOM_PATH = re.compile(r"`(_[a-z]+)/(\w+)((?:\.\w+)*)`")


def resolves(name: str) -> bool:
    parts = name.split(".")
    obj: Any = None
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        break
    else:
        return False
    for p in parts[i:]:
        if not hasattr(obj, p):
            return False
        obj = getattr(obj, p)
    return True


def texts() -> list[tuple[str, str]]:
    out = []
    pages = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
    pages += sorted(REPO.glob("backends/*/README.md")) + sorted(REPO.glob("plugins/*/README.md"))
    out += [(str(p.relative_to(REPO)), p.read_text()) for p in pages]
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    line = getattr(node, "lineno", 1)
                    out.append((f"{path.relative_to(REPO)}:{line}", doc))
    return out


def stale(found: list[tuple[str, str]]) -> list[str]:
    out = []
    for where, text in found:
        for m in DOTTED.finditer(text):
            name = m.group(0).rstrip(".")
            if name in NOT_PYTHON or name in INDEX_MAPS or name.startswith("quire.json"):
                continue
            if not resolves(name):
                out.append(f"{where}: {name}")
        if where == "docs/architecture.md":
            for m in ROOM_PATH.finditer(text):
                if m.group(3) == ".py":  # a file: `_engine/garbage.py`
                    ok = (SRC / m.group(1) / f"{m.group(2)}.py").is_file()
                else:
                    ok = resolves(f"quire.{m.group(1)}.{m.group(2)}{m.group(3)}")
                if not ok:
                    out.append(f"{where}: {m.group(0)}")
    return out


def test_every_dotted_quire_name_resolves() -> None:
    assert stale(texts()) == []


def test_the_data_words_exist_in_the_code() -> None:
    """The index maps are the keys of the index's ``"quire"`` object (docs/format.md)."""
    writer = "".join(p.read_text() for p in (SRC / "_format").glob("*.py"))
    for key in INDEX_MAPS:
        assert f'"{key.split(".", 1)[1]}"' in writer, key


@pytest.mark.parametrize(
    "text, found",
    [
        ("see ``quire._engine.tierio``", ["quire._engine.tierio"]),
        ("call quire.load_and_transform(x)", ["quire.load_and_transform"]),
        ("`_format/chunkindex.PackedReader`", ["`_format/chunkindex.PackedReader`"]),
        ("quire.load, quire.errors.QuireError, `_format/packedreader.PackedReader`", []),
        ("`_engine/garbage.py` and `_engine/tierio.py`", ["`_engine/tierio.py`"]),
        ("the record quire.json and quire.codecs", []),
    ],
)
def test_the_check_finds_stale_names(text: str, found: list[str]) -> None:
    assert [s.split(": ", 1)[1] for s in stale([("docs/architecture.md", text)])] == found
