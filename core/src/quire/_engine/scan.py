"""Checkpoints anywhere under a prefix: what ``quire ls`` lists on any URL (and
``quire gc`` collects, ``quire._engine.prefix_garbage``).

A prefix may hold plain checkpoints (a folder with ``quire.json``, whatever its name),
quire.Checkpointer roots (a folder with ``checkpointer.json``, whose steps are
checkpoints), partial saves (``journal/``) and the debris of killed saves: ``d/<txid>/``
prefixes no commit record references.  The scan lists one level at a time and never
descends into a checkpoint's data.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quire._format import record as _records
from quire._format import root as _root
from quire._store.base import Backend
from quire.errors import QuireError

TXID = re.compile(r"^[0-9a-f]{16}$")
MAX_DEPTH = 8


@dataclass(frozen=True)
class Found:
    """One checkpoint (or the debris of one) under the scanned prefix."""

    path: str  # relative to the scanned prefix ("" for the prefix itself)
    state: str  # "committed", "partial" (journal) or "incomplete" (only d/<txid>/ data)
    root: str | None = None  # the Checkpointer root managing it (relative path)
    step: int | None = None


@dataclass(frozen=True)
class Scan:
    checkpoints: list[Found]
    roots: list[str]  # Checkpointer roots (relative paths)


def join(a: str, b: str) -> str:
    if not b:
        return a
    return f"{a}/{b}" if a else b


Opener = Callable[[str], Backend]  # a relative path -> the backend rooted there


async def scan(backend: Backend, opener: Opener) -> Scan:
    """Every checkpoint and Checkpointer root under the backend's root."""
    found: list[Found] = []
    roots: list[str] = []
    todo: list[tuple[str, int, str | None, Any]] = [("", 0, None, None)]
    while todo:
        prefix, depth, root, fmt = todo.pop()
        files, dirs = await backend.list_dir(prefix)
        step = None
        if root is not None and fmt is not None:
            step = fmt.parse(prefix.rsplit("/", 1)[-1])
        if _records.RECORD in files:
            found.append(Found(prefix, "committed", root, step))
            continue
        if _records.JOURNAL_DIR in dirs:  # a partial save's, or a folder named so
            names, _ = await backend.list_dir(join(prefix, _records.JOURNAL_DIR))
            if any(_records.is_journal_record(n) for n in names):
                found.append(Found(prefix, "partial", root, step))
                continue
        if "d" in dirs and (root is None or step is not None):
            _, txids = await backend.list_dir(join(prefix, "d"))
            if txids and all(TXID.match(t) for t in txids):
                found.append(Found(prefix, "incomplete", root, step))
                continue
        sub_root, sub_fmt = root, fmt
        if _root.ROOT_RECORD in files:
            roots.append(prefix)
            sub_root = prefix
            try:
                doc = await _root.read_root_record(opener(prefix) if prefix else backend, "")
            except QuireError:
                doc = None
            sub_fmt = _root.StepFormat(doc["step_format"] if doc else _root.DEFAULT_STEP_FORMAT)
        elif root is not None:
            sub_root, sub_fmt = None, None  # a folder inside a root that is not a step
        if depth < MAX_DEPTH:
            for d in reversed(dirs):
                todo.append((join(prefix, d), depth + 1, sub_root, sub_fmt))
    found.sort(key=lambda f: f.path)
    return Scan(found, sorted(roots))
