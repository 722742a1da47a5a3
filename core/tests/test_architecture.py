"""The package's architecture, checked: subpackages in one declared order, no import circle.

``ORDER`` (lowest first) is the one declaration of the order ``docs/architecture.md`` draws.
A module may import its own room and the rooms below it, never one above.  Imports inside
functions count (they run); imports under ``if TYPE_CHECKING:`` do not.  The source is read
with ``ast``: nothing is imported.
"""

from __future__ import annotations

import ast
import builtins
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import quire

pytestmark = pytest.mark.quick  # the quick tier (CONTRIBUTING.md)

SRC = Path(quire.__file__).parent

#: The rooms, lowest first; each is a set of module prefixes.  The contract modules of the
#: bottom room import nothing of quire; the faces only re-export what rooms below define.
#: ``peers`` (the TLS peer link) sits right above ``runtime`` so that it may import nothing
#: else (a small security boundary); ``tiers`` (the local tier: its transactions, peer
#: copies, restores) sits right below the Checkpointer, which hands it its roots.
ORDER: list[tuple[str, frozenset[str]]] = [
    ("contracts", frozenset({"quire.errors", "quire.options", "quire.metadata"})),
    ("runtime", frozenset({"quire._runtime"})),
    ("peers", frozenset({"quire._peers"})),
    ("store", frozenset({"quire._store"})),
    ("format", frozenset({"quire._format"})),
    ("handlers", frozenset({"quire._handlers"})),
    ("engine", frozenset({"quire._engine"})),
    ("sources", frozenset({"quire._sources"})),
    ("tiers", frozenset({"quire._tiers"})),
    ("api", frozenset({"quire._api", "quire._ops", "quire.partial", "quire._checkpointer"})),
    (
        "faces",
        frozenset(
            {
                "quire.backends",
                "quire.handlers",
                "quire.checkpointables",
                "quire.sources",
                "quire.surgery",
                "quire.progress",
                "quire.policies",
                "quire.tiers",
                "quire.reports",
            }
        ),
    ),
    ("package", frozenset({"quire"})),
    ("cli", frozenset({"quire._cli", "quire.__main__"})),
    ("testing", frozenset({"quire.testing"})),
]

#: Private modules allowed at the top of the package (everything else lives in a room).
TOP_PRIVATE = {"quire._api", "quire._ops"}

#: Rooms placed low for what they may import, not for who uses them: room -> the lowest
#: room allowed to import it (besides itself).  The peer link is the local tier's.
LOWEST_USER = {"peers": "tiers"}


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("").parts
        if rel[-1] == "__init__":
            rel = rel[:-1]
        out[".".join(("quire", *rel))] = path
    return out


def _type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    p = parents.get(node)
    while p is not None:
        if isinstance(p, ast.If) and "TYPE_CHECKING" in ast.unparse(p.test):
            return True
        p = parents.get(p)
    return False


def imports(mod: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported quire module, line) for every import in ``path`` that runs."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        while parts:
            if ".".join(parts) in known:
                return ".".join(parts)
            parts.pop()
        return None

    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom) or _type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            assert node.level == 0, f"{path}: relative import"
            base = node.module or ""
            # `from quire._x import y` imports the module quire._x.y if there is one, else
            # takes the name y from quire._x
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        for name in names:
            if name.split(".")[0] == "quire" and (target := resolve(name)) and target != mod:
                yield target, node.lineno


def graph(root: Path) -> dict[str, dict[str, int]]:
    known = modules(root)
    return {m: dict(imports(m, p, known)) for m, p in known.items()}


def room(mod: str) -> int | None:
    best: tuple[int, int] | None = None
    for i, (_, prefixes) in enumerate(ORDER):
        for p in prefixes:
            inside = mod == p or (p != "quire" and mod.startswith(p + "."))  # the face: itself
            if inside and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def circles(g: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected sets of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def violations(root: Path) -> list[str]:
    g = graph(root)
    out = []
    for mod in sorted(g):
        if room(mod) is None:
            out.append(f"{mod} is in no room of ORDER: move it into the subpackage that owns it")
    for mod, targets in sorted(g.items()):
        a = room(mod)
        for target, line in sorted(targets.items()):
            b = room(target)
            if a is not None and b is not None and b > a:
                out.append(
                    f"{mod}:{line} imports {target}: {ORDER[a][0]} may not import "
                    f"{ORDER[b][0]}, which is above it"
                )
    names = [name for name, _ in ORDER]
    for mod, targets in sorted(g.items()):
        a = room(mod)
        for target, line in sorted(targets.items()):
            b = room(target)
            if a is None or b is None or a == b or names[b] not in LOWEST_USER:
                continue
            if a < names.index(LOWEST_USER[names[b]]):
                out.append(
                    f"{mod}:{line} imports {target}: {names[b]} is for {LOWEST_USER[names[b]]} "
                    f"and the rooms above it, not {names[a]}"
                )
    for comp in circles(g):
        out.append("import circle: " + " -> ".join(comp))
    return out


def test_no_circle_and_no_import_against_the_order() -> None:
    assert violations(SRC) == []


def test_the_check_fails_on_an_added_circle(tmp_path: Path) -> None:
    copy = tmp_path / "quire"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    budget = copy / "_runtime" / "budget.py"
    budget.write_text(
        budget.read_text() + "\n\ndef _up():\n    from quire._engine.save import new_txid\n"
    )
    found = violations(copy)
    assert any("quire._runtime.budget" in v and "runtime may not import engine" in v for v in found)
    assert any(v.startswith("import circle:") and "quire._runtime.budget" in v for v in found)


def test_the_check_fails_on_a_peer_link_user_below_the_tiers(tmp_path: Path) -> None:
    copy = tmp_path / "quire"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    save = copy / "_engine" / "save.py"
    save.write_text(save.read_text() + "\nfrom quire._peers import link  # noqa\n")
    found = violations(copy)
    assert [v for v in found if "quire._engine.save" in v] == [
        f"quire._engine.save:{len(save.read_text().splitlines())} imports "
        "quire._peers.link: peers is for tiers and the rooms above it, not engine"
    ]


def test_a_type_checking_import_is_not_counted(tmp_path: Path) -> None:
    copy = tmp_path / "quire"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    errors = copy / "errors.py"
    errors.write_text(
        errors.read_text()
        + "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import quire._api\n"
    )
    assert violations(copy) == []


def test_subpackage_faces_hold_only_their_docstring() -> None:
    """Each room's ``__init__`` says what it owns and what it may import, and nothing else:
    its modules are imported by their full names."""
    for init in sorted(SRC.glob("_*/__init__.py")):
        body = ast.parse(init.read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr), init
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc or "may import" in doc, f"{init}: say what it may import"


def test_few_private_modules_at_the_top() -> None:
    top = {m for m in modules(SRC) if m.count(".") == 1 and m.split(".")[1].startswith("_")} - {
        "quire.__main__"
    }
    assert top <= TOP_PRIVATE | {m for _, ps in ORDER for m in ps if m.count(".") == 1}
    assert not {m for m in top if (SRC / (m.split(".")[1] + ".py")).is_file()} - TOP_PRIVATE


#: Where classes hold their parts (objects with narrow interfaces, each owning its state)
#: rather than being assembled from mixins that read each other's attributes through
#: ``self`` (STYLE.md habit 20): all of core, the Checkpointer, its tier parts and the
#: object-store backend included.
COMPOSED = ("quire",)
_TYPING_BASES = {"Protocol", "Generic", "typing.Protocol", "typing.Generic"}
#: An error mixes in the builtin of the same role (``QuireError, ValueError``: STYLE.md
#: habit 8); that second base is no mixin.
_BUILTIN_ERRORS = {
    n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
}


def assembled(root: Path) -> list[str]:
    """Classes of the COMPOSED rooms that look assembled from mixins: named ``*Mixin``, with
    two or more bases (``Protocol`` / ``Generic`` and builtin exceptions aside), or declaring
    under ``if TYPE_CHECKING:`` in their body the attributes some other class sets."""
    out = []
    for mod, path in modules(root).items():
        if not any(mod == p or mod.startswith(p + ".") for p in COMPOSED):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [ast.unparse(b) for b in node.bases]
            bases = [b for b in bases if b.split("[")[0] not in _TYPING_BASES | _BUILTIN_ERRORS]
            declares = any(
                isinstance(s, ast.If) and "TYPE_CHECKING" in ast.unparse(s.test) for s in node.body
            )
            if node.name.endswith("Mixin") or len(bases) > 1 or declares:
                out.append(
                    f"{mod}.{node.name}({', '.join(bases)}) looks assembled from mixins: hold "
                    "the parts as attributes and pass them what they need"
                )
    return out


def test_core_classes_are_composed_not_mixed() -> None:
    assert assembled(SRC) == []


def test_the_mixin_check_finds_each_kind(tmp_path: Path) -> None:
    for room, parts in [
        ("_checkpointer", "parts"),
        ("_store", "object_backend"),
    ]:
        (tmp_path / "quire" / room).mkdir(parents=True)
        (tmp_path / "quire" / room / "__init__.py").write_text('"""A room."""\n')
        (tmp_path / "quire" / room / f"{parts}.py").write_text(
            "from typing import TYPE_CHECKING, Generic, Protocol, TypeVar\n"
            "T = TypeVar('T')\n"
            "class SavingMixin: ...\n"
            "class Big(Base, Other): ...\n"
            "class Reads:\n    if TYPE_CHECKING:\n        _lock: object\n"
            "class Fine(Base): ...\n"
            "class Contract(Protocol, Generic[T]): ...\n"
            "class Failed(QuireError, ValueError): ...\n"
        )
    found = assembled(tmp_path / "quire")
    assert sorted(f.split("(")[0] for f in found) == [
        f"quire.{room}.{parts}.{name}"
        for room, parts in [("_checkpointer", "parts"), ("_store", "object_backend")]
        for name in ("Big", "Reads", "SavingMixin")
    ]


#: A module holds one responsibility, named for what it holds (STYLE.md habit 23); its size
#: is a prompt to look for a second responsibility, never a reason to cut one in two.  The
#: budget is a line count past which a module must be named here with the reason one
#: responsibility needs the room, and the most it may grow to.
BUDGET = 500
OVER_BUDGET: dict[str, tuple[int, str]] = {}


def over_budget(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        n = len(path.read_text().splitlines())
        cap, why = OVER_BUDGET.get(rel, (BUDGET, ""))
        if n > cap:
            what = f"its allowance of {cap} ({why})" if why else f"the budget of {BUDGET}"
            out.append(
                f"{rel}: {n} lines, over {what}: if it holds two responsibilities, move one "
                "into a module named for it; if one needs the room, name it in OVER_BUDGET "
                "with the reason"
            )
    return out


def test_modules_keep_to_the_budget() -> None:
    assert over_budget(SRC) == []


def test_every_allowance_is_used_and_explained() -> None:
    for rel, (cap, why) in OVER_BUDGET.items():
        n = len((SRC / rel).read_text().splitlines())
        assert BUDGET < n <= cap, f"{rel}: {n} lines; allowance {cap} (drop it when unneeded)"
        assert len(why) > 20, f"{rel}: say why one responsibility needs {cap} lines"


def test_the_budget_check_names_the_module(tmp_path: Path) -> None:
    (tmp_path / "big.py").write_text("x = 1\n" * (BUDGET + 1))
    (tmp_path / "small.py").write_text("x = 1\n")
    found = over_budget(tmp_path)
    assert len(found) == 1 and found[0].startswith(f"big.py: {BUDGET + 1} lines")


#: The repository's Python files outside the package, also held to the alias rule (tests,
#: benchmarks and CI scripts import rooms too).
REPO = SRC.parents[2]


def shadowing_aliases(files: list[Path]) -> list[str]:
    """``import ... as <name>`` where ``<name>`` is a room's own name (``record as _format``):
    the reader takes ``_format.build`` for the room when it is one module of it."""
    rooms = {m.split(".")[1] for _, ps in ORDER for m in ps if m.count(".") == 1}
    rooms = {r for r in rooms if r.startswith("_")}
    out = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for a in node.names:
                    if a.asname in rooms:
                        out.append(f"{path}:{node.lineno}: {a.name} imported as {a.asname}")
    return out


def _python_files() -> list[Path]:
    out = []
    for d, dirs, files in os.walk(REPO):
        dirs[:] = [x for x in dirs if not x.startswith(".") and x not in {"site", "build"}]
        out += [Path(d, f) for f in files if f.endswith(".py")]
    return out


def test_no_import_alias_shadows_a_room() -> None:
    assert shadowing_aliases(_python_files()) == []


def test_the_alias_check_finds_a_shadowing_alias(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text(
        "from quire._format import record as _format\n"
        "from quire._engine import save as _saving\n"
        "import quire._handlers.select as _handlers\n"
    )
    assert [s.split(": ", 1)[1] for s in shadowing_aliases([f])] == [
        "record imported as _format",
        "quire._handlers.select imported as _handlers",
    ]
