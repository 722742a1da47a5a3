"""quire's own checkpoints as a source: array leaves lazy, inline leaves as values.

Array regions are read through the engine's region reader (``_zarr.read_region`` over the
checkpoint's backend and the leaf record's layout), the path ``quire.load`` itself uses, so
every layout the engine reads is read here too.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, ClassVar

import jax
import numpy as np

from quire._engine.load import pytree_unit, read_for_data
from quire._engine.metadata import rebuild_saved
from quire._format.crc import ChunkError
from quire._format.record import PYTREE, RECORD
from quire._format.tree import Node, from_json, keystr
from quire._handlers import select as _selection
from quire._handlers.arrays import layout_from_record
from quire._handlers.base import LoadContext, LoadEntry
from quire._handlers.zarr_io import read_region
from quire._runtime.budget import ByteBudget
from quire._runtime.config import current
from quire._runtime.ioloop import submit
from quire._sources.base import Source
from quire._sources.lazy import LazyArray, Region, region_shape
from quire._store.base import Backend
from quire._store.url import open_backend
from quire.errors import CorruptCheckpointError

__all__ = ["QuireSource"]

# Leaves whose records describe a plain zarr array (shape, dtype, location).
LAZY_HANDLERS = ("numpy", "jax")


class _Reader:
    """Regions of one array leaf; ``saved_sharding`` is its sharding record (a target on an
    abstract mesh resolves against it: ``quire._handlers.meshes``)."""

    def __init__(self, src: QuireSource, backend: Backend, rec: dict[str, Any], path: Any) -> None:
        self.src, self.backend, self.rec, self.path = src, backend, rec, path
        self.layout = layout_from_record(rec, src.url)
        self.saved_sharding = rec.get("sharding")

    async def read_region(self, region: Region) -> np.ndarray:
        out = np.empty(region_shape(region), self.layout.dtype)
        try:
            await read_region(
                self.backend, self.rec["location"], self.layout, region, out, sem=self.src.limit
            )
        except ChunkError as e:
            raise CorruptCheckpointError(
                f"{self.src.url}: leaf {keystr(self.path)!r}: {e}; the checkpoint is damaged "
                "(run `quire verify URL`)"
            ) from e
        self.src.bytes_read += out.nbytes
        return out


class QuireSource(Source):
    """A committed quire checkpoint (its ``pytree`` unit) as a lazy tree, the tree
    :func:`quire.load` returns. A checkpoint of :func:`quire.save_checkpointables` whose only
    unit is a pytree opens as that tree, as it loads; one with several units and no ``pytree``
    unit as ``{unit: tree}`` of its pytree units (its other units are not arrays: load them
    with ``quire.load_checkpointables``).

    ``metadata`` holds the user metadata (``custom``), ``format_version`` and ``created``.
    """

    format: ClassVar[str] = "quire"

    def __init__(self, url: str) -> None:
        self.url = url
        self.tree: Any = None
        self.metadata: dict[str, Any] = {}
        self.bytes_read = 0
        self.limit = asyncio.Semaphore(max(1, current().max_concurrency))

    @classmethod
    def detect(cls, url: str, storage_options: dict[str, Any]) -> bool:
        async def probe() -> bool:
            return await open_backend(url, storage_options).exists(RECORD)

        try:
            return submit(probe()).result()
        except (FileNotFoundError, NotADirectoryError):
            return False

    @classmethod
    def open(cls, url: str, storage_options: dict[str, Any]) -> QuireSource:
        return submit(cls._open(url, storage_options)).result()

    @classmethod
    async def _open(cls, url: str, storage_options: dict[str, Any]) -> QuireSource:
        src = cls(url)
        # The semaphore must belong to quire's loop: make it here, on that loop.
        src.limit = asyncio.Semaphore(max(1, current().max_concurrency))
        doc, backend = await read_for_data(url, storage_options)  # locations checked there
        units = {n: u["tree"] for n, u in doc["units"].items() if u.get("kind") == "pytree"}
        if PYTREE in units or not units or len(doc["units"]) == 1:
            saved = {None: from_json(pytree_unit(doc, url))}
        else:  # quire.save_checkpointables: each pytree unit under its name
            saved = {n: from_json(t, (n,)) for n, t in units.items()}
        values: dict[int, Any] = {}
        eager: dict[str, list[Node]] = collections.defaultdict(list)
        for leaf in (leaf for root in saved.values() for leaf in root.leaves()):
            rec = leaf.value
            if rec.get("handler") in LAZY_HANDLERS:
                values[id(leaf)] = LazyArray(
                    rec["shape"],
                    _Reader(src, backend, rec, leaf.path).layout.dtype,
                    leaf.path,
                    _Reader(src, backend, rec, leaf.path),
                    url,
                )
            else:
                eager[rec["handler"]].append(leaf)
        ctx = LoadContext(url, backend, jax.process_index(), jax.process_count())
        ctx.limit = src.limit
        ctx.budget = ByteBudget(current().byte_budget)

        async def run(hid: str, leaves: list[Node]) -> None:
            h = _selection.get(hid, url=url)
            got = await h.load([LoadEntry(n.path, n.value, None) for n in leaves], ctx)
            for n, v in zip(leaves, got):
                values[id(n)] = v

        await asyncio.gather(*(run(h, ls) for h, ls in eager.items()))
        if None in saved:
            src.tree = rebuild_saved(saved[None], values)
        else:
            src.tree = {n: rebuild_saved(root, values) for n, root in saved.items()}
        src.metadata = {
            "custom": doc.get("metadata", {}),
            "format_version": doc.get("version"),
            "created": doc.get("_created"),
        }
        return src
