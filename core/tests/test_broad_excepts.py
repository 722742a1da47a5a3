"""No silent fallbacks (issue 29, STYLE.md "Pitfalls"): a broad ``except`` whose body only
returns, passes or continues must say on its ``except`` line why nothing a user relies on
is lost, in a comment starting with ``# broad:``; otherwise it is narrowed to the
exceptions it means.  Checked with ``ast`` over quire's core, the backends and the
plugins.  Also here: the one such fallback the audit replaced by code, waiting for an
earlier operation without taking on its outcome (``quire._runtime.tasks.settled``).
"""

from __future__ import annotations

import ast
import asyncio
import time
from pathlib import Path

import quire
from quire._runtime.responses import chain

REPO = Path(quire.__file__).resolve().parents[3]
ROOTS = [
    REPO / "core" / "src" / "quire",
    *sorted(REPO.glob("backends/*/src")),
    *sorted(REPO.glob("plugins/*/src")),
]
BROAD = {"Exception", "BaseException"}
MARKER = "# broad:"
# The async snapshot's fallback is being replaced by an explicit snapshot step (issue 29,
# branch s8-grain31); drop this entry when that lands.
PENDING = {("quire/_handlers/unit_ops.py", "snapshot")}


def _is_broad(h: ast.ExceptHandler) -> bool:
    if h.type is None:  # a bare except
        return True
    types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
    return any(isinstance(t, ast.Name) and t.id in BROAD for t in types)


def _swallows(h: ast.ExceptHandler) -> bool:
    return all(isinstance(s, ast.Return | ast.Pass | ast.Continue) for s in h.body)


def offenders(source: str, name: str) -> list[str]:
    """``name:line (function)`` of each unjustified broad, swallowing except in ``source``."""
    lines = source.splitlines()
    tree = ast.parse(source, name)
    owner = {}  # handler -> the innermost function around it ("<module>" if none)
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for h in ast.walk(fn):
                if isinstance(h, ast.ExceptHandler):
                    owner[h] = fn.name  # inner functions come later in the walk and win
    out = []
    for h in ast.walk(tree):
        if not (isinstance(h, ast.ExceptHandler) and _is_broad(h) and _swallows(h)):
            continue
        where = owner.get(h, "<module>")
        line = lines[h.lineno - 1]
        reason = line.partition(MARKER)[2].strip() if MARKER in line else ""
        if not reason and (name, where) not in PENDING:
            out.append(f"{name}:{h.lineno} ({where}): {line.strip()}")
    return out


def _sources() -> list[tuple[str, str]]:
    out = []
    for root in ROOTS:
        for p in sorted(root.rglob("*.py")):
            out.append((p.read_text(), str(p.relative_to(root.parent))))
    return out


def test_every_broad_swallowing_except_is_justified_or_narrowed() -> None:
    sources = _sources()
    found = [o for text, name in sources for o in offenders(text, name)]
    assert found == [], (
        "a broad except that only returns/passes/continues: narrow it to the exceptions it "
        f"means, or say why nothing a user relies on is lost with '{MARKER} <reason>' on "
        "its except line:\n" + "\n".join(found)
    )
    assert len(sources) > 150  # the scan sees the code it must (core, backends, plugins)


def test_the_scan_finds_what_it_must() -> None:
    bad = """
def f(x):
    try:
        return g(x)
    except Exception:  # not a reason
        return None
    try:
        g(x)
    except (OSError, BaseException):
        pass
    for y in x:
        try:
            g(y)
        except:
            continue
try:
    import k
except BaseException:
    pass
"""
    found = sorted(int(o.split(" ", 1)[0].split(":")[1]) for o in offenders(bad, "m.py"))
    assert found == [5, 9, 14, 18]
    good = """
def f(x):
    try:
        return g(x)
    except Exception:  # broad: a hint only, the caller raises its own error
        return None
    try:
        g(x)
    except OSError:
        pass
    try:
        g(x)
    except Exception as e:
        raise ValueError(x) from e
try:
    import k
except Exception:
    k = None
"""
    assert offenders(good, "m.py") == []


def test_a_cancelled_chained_operation_neither_runs_nor_cancels_the_one_before() -> None:
    """Writes to one URL run one after the other (``responses.chain``).  Cancelling one
    that waits for its predecessor must stop it there: before, the wait swallowed the
    cancellation (``except BaseException: pass``), went on to run the operation, and the
    cancelled wait had cancelled the predecessor too."""
    ran: list[str] = []

    async def first() -> str:
        await asyncio.sleep(0.5)
        ran.append("first")
        return "first"

    async def second() -> None:
        ran.append("second")

    url = "memory://broad-excepts/chain"
    one = chain(url, first, "first")
    two = chain(url, second, "second")
    time.sleep(0.1)  # the second waits for the first
    assert two._future.cancel()
    assert one.result(timeout=10) == "first"
    time.sleep(0.1)
    assert ran == ["first"]
