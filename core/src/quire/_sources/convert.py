"""Writing any source as a quire checkpoint (:func:`convert`, behind ``quire.copy`` and
``quire cp``).  The command line's side of sources is in ``quire._cli`` (``export``, ``diff``).
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

import numpy as np

from quire._engine import save as _saving
from quire._engine import verify as _verify
from quire._format import record as _records
from quire._handlers.base import SaveEntry
from quire._runtime import progress as _progress
from quire._runtime.config import current
from quire._runtime.ioloop import submit
from quire._runtime.responses import chain
from quire._runtime.tasks import gather_cancelling
from quire._sources.base import Source
from quire._sources.lazy import LazyValue, full_region
from quire._sources.opening import opened
from quire._store.url import normalize
from quire.errors import CorruptCheckpointError

__all__ = ["convert"]


def _placeholders(node: Any, lazy: dict[int, LazyValue]) -> Any:
    """``node`` with each LazyValue replaced by a zero-stride numpy array of its shape and
    dtype (no memory): the save machinery plans it as an ordinary numpy leaf."""
    if isinstance(node, LazyValue):
        p = np.broadcast_to(np.zeros((), node.dtype), node.shape)
        lazy[id(p)] = node
        return p
    if isinstance(node, dict):
        return {k: _placeholders(v, lazy) for k, v in node.items()}
    if isinstance(node, list):
        return [_placeholders(v, lazy) for v in node]
    if isinstance(node, tuple):
        items = [_placeholders(v, lazy) for v in node]
        return type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
    return node


def _feed(lazy: dict[int, LazyValue], limit: int) -> Any:
    """The save's feed: entries in batches of at most ``limit`` bytes of source data (or one
    larger tensor alone), the next batch read while one within ``limit`` is written (none
    beside a larger one): the feed holds at most ``limit`` + max(``limit``, one tensor) bytes,
    i.e. the byte budget plus one tensor for ``limit`` = budget / 2."""

    def size(e: SaveEntry) -> int:
        v = lazy.get(id(e.value))
        return 0 if v is None else v.nbytes

    async def fill(batch: list[SaveEntry]) -> list[SaveEntry]:
        # Reads are the source's, not this operation's progress (a quire source reports its
        # own reads): count only what the save writes.
        _progress._current.set(None)

        async def one(e: SaveEntry) -> SaveEntry:
            v = lazy.get(id(e.value))
            if v is None:
                return e
            return replace(e, value=await v.read_region(full_region(v.shape)))

        return await gather_cancelling(*(one(e) for e in batch))

    async def feed(entries: list[SaveEntry]) -> AsyncGenerator[list[SaveEntry], None]:
        todo = deque(entries)

        def take() -> tuple[list[SaveEntry], int]:
            batch: list[SaveEntry] = []
            held = 0
            while todo and (not batch or held + size(todo[0]) <= limit):
                e = todo.popleft()
                batch.append(e)
                held += size(e)
            return batch, held

        batch, held = take()
        nxt: asyncio.Future[list[SaveEntry]] | None = asyncio.ensure_future(fill(batch))
        try:
            while nxt is not None:
                ready = await nxt
                nxt = None
                if todo and held <= limit:  # prefetch beside a batch within the limit only
                    batch, held = take()
                    nxt = asyncio.ensure_future(fill(batch))
                yield ready
                del ready
                if todo and nxt is None:
                    batch, held = take()
                    nxt = asyncio.ensure_future(fill(batch))
        finally:
            if nxt is not None:
                nxt.cancel()
                await asyncio.gather(nxt, return_exceptions=True)

    return feed


def convert(
    src: Any,
    dst: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
    progress: Any = None,
    verify: bool = True,
    layout: str | None = None,
) -> tuple[int, int]:
    """Write source ``src`` (any format) as a quire checkpoint at ``dst``, then verify it.

    Streaming: leaves are read in batches within half the byte budget (one larger tensor
    alone), each batch while the previous one is written, through the ordinary save (one
    commit, atomic: an interrupted conversion leaves no checkpoint, or the one it was to
    replace).  ``progress`` is as for :func:`quire.save` (the operation is ``"cp"``, then
    ``"verify"``).  Returns (bytes of array data, objects verified).
    """
    with opened(src, storage_options) as source:
        return _convert(source, normalize(dst), overwrite, dst_options, progress, verify, layout)


def _convert(
    source: Source,
    u: str,
    overwrite: bool,
    dst_options: dict[str, Any] | None,
    progress: Any,
    verify: bool,
    layout: str | None,
) -> tuple[int, int]:
    lazy: dict[int, LazyValue] = {}
    tree = _placeholders(source.tree, lazy)
    nbytes = sum(v.nbytes for v in lazy.values())
    meta = {"converted_from": source.url, "source_format": source.format}
    rep = _progress.make(progress, "cp", u, bytes_total=nbytes)
    prep = _saving.prepare_save({_records.PYTREE: tree}, None, copy=False, url=u, layout=layout)
    prep.feed = _feed(lazy, max(1, current().byte_budget // 2))

    def save() -> Any:
        return _saving.save_prepared(
            u, prep, metadata=meta, overwrite=overwrite, storage_options=dst_options
        )

    close = rep is not progress
    chain(u, lambda: _progress.tracked(rep, save, close=close), f"cp {u}").result()
    checked = 0
    if verify:
        with _progress.reporting(progress, "verify", u):
            checked, problems = submit(_verify.verify(u, dst_options)).result()
        if problems:
            raise CorruptCheckpointError(
                f"{u}: {len(problems)} object(s) failed verification after conversion: "
                + "; ".join(f"{p.path}: {p.error}" for p in problems[:5])
            )
    return nbytes, checked
