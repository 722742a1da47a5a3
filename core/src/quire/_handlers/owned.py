"""What leaves own, asked of their handlers: the one place ``verify`` and ``cp`` learn it.

Neither parses a handler's records: each leaf's handler names the objects (byte ranges)
its entries own and how to check them (:class:`quire.handlers.StoredObject`), and reports
problems through its ``verify`` (``quire.handlers.check_objects`` by default).  Keys a
handler names outside ``d/`` are refused as a damaged record.  A checkpointable unit stored
as objects owns every object under its location (every process's, for a per-process unit),
each ending in its crc32c (:func:`verify_units`).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from quire._format import record as _records
from quire._format.crc import crc_bytes
from quire._format.paths import is_safe_location
from quire._format.tree import Node, keystr
from quire._handlers import select as _selection
from quire._handlers.base import LoadContext, LoadEntry, ObjectProblem, StoredObject
from quire._handlers.objects import check_objects, default_objects
from quire._store.base import Backend
from quire.errors import CorruptCheckpointError


def _by_handler(url: str, leaves: Sequence[Node]) -> dict[str, list[Node]]:
    groups: dict[str, list[Node]] = defaultdict(list)
    for leaf in leaves:
        hid = leaf.value.get("handler") if isinstance(leaf.value, dict) else None
        if not isinstance(hid, str):
            raise CorruptCheckpointError(
                f"{url}/{_records.RECORD}: leaf {keystr(leaf.path)!r} names no handler"
            )
        groups[hid].append(leaf)
    return groups


def _entries(leaves: Sequence[Node]) -> list[LoadEntry]:
    return [LoadEntry(leaf.path, leaf.value) for leaf in leaves]


async def _owned(
    handler: Any, entries: list[LoadEntry], ctx: LoadContext
) -> list[list[StoredObject]]:
    fn = getattr(handler, "objects", None)
    got = await (fn(entries, ctx) if fn is not None else default_objects(entries, ctx))
    out = [list(objs) for objs in got]
    if len(out) != len(entries):
        raise CorruptCheckpointError(
            f"{ctx.url}: handler {handler.id!r} named objects for {len(out)} of "
            f"{len(entries)} leaves"
        )
    for e, objs in zip(entries, out):
        for o in objs:
            if not is_safe_location(o.key):
                raise CorruptCheckpointError(
                    f"{ctx.url}/{_records.RECORD}: leaf {keystr(e.path)!r} owns object "
                    f"{o.key!r}, outside d/; refusing to touch it"
                )
    return out


async def leaf_objects(
    url: str, backend: Backend, leaves: Sequence[Node]
) -> list[tuple[Node, list[StoredObject]]]:
    """Every leaf with the stored objects its handler says it owns."""
    ctx = LoadContext(url, backend)
    out: list[tuple[Node, list[StoredObject]]] = []
    for hid, group in _by_handler(url, leaves).items():
        handler = _selection.get(hid, url=url)
        out += zip(group, await _owned(handler, _entries(group), ctx))
    return out


async def verify_leaves(
    url: str,
    backend: Backend,
    leaves: Sequence[Node],
    progress: Callable[[int], None] | None = None,
) -> tuple[int, list[ObjectProblem]]:
    """Each handler's ``verify`` over its leaves: (objects checked, problems)."""
    problems: list[ObjectProblem] = []
    checked = 0
    for hid, group in _by_handler(url, leaves).items():
        handler = _selection.get(hid, url=url)
        ctx = LoadContext(url, backend)
        entries = _entries(group)
        custom = getattr(handler, "verify", None)
        if custom is not None:
            found = custom(entries, ctx)
        else:
            found = check_objects(entries, await _owned(handler, entries, ctx), ctx)
        async for p in found:
            problems.append(p)
        n = int(ctx.stats.get("objects", 0))
        checked += n
        if progress is not None:
            progress(n)
    problems.sort(key=lambda p: (keystr(p.path), p.key))  # found in completion order
    return checked, problems


def check_unit_object(data: bytes) -> None:
    """A checkpointable unit's object against its crc32c trailer (``UnitIO.write``)."""
    if len(data) < 4 or crc_bytes(data[:-4]) != data[-4:]:
        raise ValueError("crc32c checksum mismatch")


async def verify_units(
    url: str, backend: Backend, units: Mapping[str, dict[str, Any]]
) -> tuple[int, list[ObjectProblem]]:
    """Every object of the units stored as objects, read and checked against its crc32c:
    (objects checked, problems, each with the unit's name as its path)."""
    limit = asyncio.Semaphore(8)

    async def one(name: str, key: str) -> ObjectProblem | None:
        async with limit:
            try:
                check_unit_object(await backend.get(key))
            except FileNotFoundError:
                return ObjectProblem((name,), key, "missing")
            except ValueError as e:
                return ObjectProblem((name,), key, str(e))
        return None

    found = [(n, u["location"]) for n, u in units.items() if u.get("kind") == "handler"]
    listed = await asyncio.gather(*(backend.list(loc) for _, loc in found))
    keys = [(n, k) for (n, _), ks in zip(found, listed) for k in ks]
    got = await asyncio.gather(*(one(n, k) for n, k in keys))
    return len(keys), [p for p in got if p is not None]
