"""``quire.verify``: every stored object of a checkpoint checked by the handler that owns it
(array chunks and headers, pack ranges, the objects of checkpointable units), for a
committed checkpoint or a partial save (its journal's live data), unit by unit."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quire._engine import journal as _journal
from quire._engine.journal_replay import replayed
from quire._engine.load import read_for_data
from quire._engine.metadata import metadata_tree
from quire._format.record import PYTREE, RECORD
from quire._format.tree import from_json, keystr
from quire._handlers.owned import verify_leaves, verify_units
from quire._store.base import Backend
from quire._store.url import open_backend


@dataclass(frozen=True)
class VerifyProblem:
    """One damaged object found by :func:`quire.verify`.

    Attributes
    ----------
    path : str
        The leaf's key path in its unit (the unit's name for an object of a
        checkpointable unit).
    object : str
        The stored object (or pack range).
    error : str
        What is wrong with it.
    unit : str or None
        The unit whose object it is: a checkpointable unit, or a pytree unit of
        :func:`quire.save_checkpointables`; None for a leaf of :func:`quire.save`'s tree.
    """

    path: str
    object: str
    error: str
    unit: str | None = None


@dataclass(frozen=True)
class Stored:
    """What a checkpoint (or a partial save) holds, as its record describes it.

    Attributes
    ----------
    trees : dict
        Each pytree unit's tree of :class:`quire.metadata.LeafMetadata` (inline leaves as their
        type), by unit name.
    units : dict
        Every unit's name and kind (``"pytree"``, ``"json"`` or a checkpointable handler id).
    versions : int
        The partial-save journal's versions; 0 for a committed checkpoint.
    custom : dict
        The user metadata (a partial save's: its versions' merged).
    """

    trees: dict[str, Any]
    units: dict[str, str] = field(default_factory=dict)
    versions: int = 0
    custom: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Read:
    units: dict[str, dict[str, Any]]
    backend: Backend  # the one their data reads through
    versions: int
    custom: dict[str, Any]


async def _read(url: str, storage_options: dict[str, Any] | None) -> _Read:
    backend = open_backend(url, storage_options)
    if not await backend.exists(RECORD):
        records = await _journal.read_records(backend, url)
        if records:
            tree, view, meta = replayed(backend, url, records)
            units = {PYTREE: {"kind": "pytree", "tree": tree}}
            return _Read(units, view, len(records), meta)
    doc, view = await read_for_data(url, storage_options)  # no record: the error and its hint
    return _Read(doc["units"], view, 0, doc["metadata"])


async def stored(url: str, storage_options: dict[str, Any] | None = None) -> Stored:
    """What the checkpoint or partial save at ``url`` holds (reads records only)."""
    r = await _read(url, storage_options)
    trees = {
        n: metadata_tree(url, u["tree"]) for n, u in r.units.items() if u.get("kind") == "pytree"
    }
    kinds = {n: str(u.get("handler", u["kind"])) for n, u in r.units.items()}
    return Stored(trees, kinds, r.versions, r.custom)


async def verify(
    url: str,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[int, list[VerifyProblem]]:
    """Have every leaf's handler check every object it owns, and every checkpointable
    unit's object its checksum; (objects checked, problems)."""
    r = await _read(url, storage_options)
    units, backend = r.units, r.backend
    trees = {n: u["tree"] for n, u in units.items() if u.get("kind") == "pytree"}

    async def one(name: str, tree: dict[str, Any]) -> tuple[int, list[VerifyProblem]]:
        base = () if name == PYTREE else (name,)  # errors name the unit's leaves in full
        leaves = list(from_json(tree, base).leaves())
        checked, found = await verify_leaves(url, backend, leaves, progress)
        unit = None if name == PYTREE else name
        return checked, [
            VerifyProblem(keystr(p.path[len(base) :]), p.key, p.error, unit) for p in found
        ]

    results = await asyncio.gather(*(one(n, t) for n, t in trees.items()))
    n, in_units = await verify_units(url, backend, units)
    out = [p for _, found in results for p in found]
    for p in sorted(in_units, key=lambda p: (p.path, p.key)):
        out.append(VerifyProblem(str(p.path[0]), p.key, p.error, unit=str(p.path[0])))
    return sum(c for c, _ in results) + n, out
