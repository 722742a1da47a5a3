"""What ``quire verify`` and ``quire cp`` ask of a leaf handler that does not say itself:
:func:`default_objects` (every object under a record's location) and :func:`check_objects`
(read and check each stored object).  Published by :mod:`quire.handlers`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from quire._format.paths import is_chunk
from quire._handlers.base import KeyPath, LoadContext, LoadEntry, ObjectProblem, StoredObject
from quire._runtime import progress as _progress


async def default_objects(
    entries: Sequence[LoadEntry], ctx: LoadContext
) -> list[list[StoredObject]]:
    """What a handler without ``objects`` owns: every object under each record's
    ``location`` (listed, no checks), nothing for records without one.

    Parameters
    ----------
    entries : sequence of LoadEntry
        The leaves (targets unused).
    ctx : LoadContext
        Where they live.

    Returns
    -------
    list of list of StoredObject
        One list per entry.
    """

    async def one(e: LoadEntry) -> list[StoredObject]:
        loc = e.record.get("location")
        if not isinstance(loc, str) or not loc:
            return []
        return [StoredObject(k) for k in await ctx.backend.list(loc)]

    return list(await asyncio.gather(*(one(e) for e in entries)))


async def check_objects(
    entries: Sequence[LoadEntry], objects: Sequence[Sequence[StoredObject]], ctx: LoadContext
) -> AsyncIterator[ObjectProblem]:
    """Read every stored range and run its check: the default ``verify``.

    At most ``ctx.limit`` reads run at once (8 without one), each holding its bytes in
    ``ctx.budget`` when there is one; ``ctx.stats["objects"]`` and ``["bytes"]`` count
    what was read.

    Parameters
    ----------
    entries : sequence of LoadEntry
        The leaves.
    objects : sequence of sequence of StoredObject
        What each entry owns (from ``objects``).
    ctx : LoadContext
        Where they live.

    Yields
    ------
    ObjectProblem
        One per missing or damaged range, in completion order.
    """
    limit = ctx.limit or asyncio.Semaphore(8)

    async def read(obj: StoredObject) -> bytes:
        end = None if obj.length is None else obj.offset + obj.length
        need = obj.size or obj.length or 0
        async with ctx.budget.hold(need) if ctx.budget else contextlib.nullcontext():
            data = await ctx.backend.get(obj.key, obj.offset or None, end)
            ctx.stats["objects"] = ctx.stats.get("objects", 0) + 1
            ctx.stats["bytes"] = ctx.stats.get("bytes", 0) + len(data)
            if obj.length is not None and len(data) != obj.length:
                raise ValueError(f"{len(data)} bytes at {obj.offset}, expected {obj.length}")
            if obj.check is not None:
                await asyncio.to_thread(obj.check, data)
            _progress.advance(len(data), int(is_chunk(obj.key)))  # chunks, as cp counts
            return data

    async def one(path: KeyPath, obj: StoredObject) -> ObjectProblem | None:
        async with limit:
            try:
                await read(obj)
            except FileNotFoundError:
                return ObjectProblem(path, obj.key, "missing")
            except ValueError as e:
                return ObjectProblem(path, obj.key, str(e) or type(e).__name__)
        return None

    tasks = [
        asyncio.ensure_future(one(e.path, o)) for e, objs in zip(entries, objects) for o in objs
    ]
    try:
        for fut in asyncio.as_completed(tasks):
            problem = await fut
            if problem is not None:
                yield problem
    finally:
        for t in tasks:
            t.cancel()
