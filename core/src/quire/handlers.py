"""The leaf-handler contract.

A leaf handler saves and loads one kind of leaf (numpy arrays, jax arrays, strings...).
It is found through the ``quire.leaf_handlers`` entry-point group (the name is the
handler id recorded in ``quire.json``) or registered at run time with
:func:`quire.register_leaf_handler`.

Call order for a save::

    handles(value)                    # choose the handler: most specific `types`, then
                                      # `priority` (docs/writing-a-plugin.md)
    snapshot(entries)                 # save_async only: host copies, in the caller
    await save(entries, ctx)          # write data, return one JSON record per leaf

and for a load::

    handles_abstract(target)          # may this handler produce that target?
    check(entry)                      # shape/dtype diff, before anything is read
    await load(entries, ctx)          # read, verify, return values

``quire verify`` and ``quire cp`` know nothing of a handler's format; they ask it
(both methods optional, with the defaults below)::

    await objects(entries, ctx)       # the StoredObjects each leaf owns, with checks
    async for p in verify(entries, ctx):   # ObjectProblems (default: check_objects)

``cp`` copies every object a leaf owns and runs each :class:`StoredObject`'s ``check``
on its byte range as it goes; ``verify`` reads and checks them all.  A handler without
``objects`` owns every object under its records' ``location`` (copied, and verified as
readable, without a check); one that stores nothing outside ``quire.json`` owns none.

Handlers always receive batches of entries, never one leaf per call.

Leaf plugins that store arrays build on :class:`ArrayHandler` (subclass) or
:class:`NumpyArrayHandler` (hold one and convert leaves to numpy arrays): quire's zarr v3
array format, chunked by sharding, crc32c on every chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from quire import _progress
from quire._paths import is_chunk
from quire.options import StorageOptions

if TYPE_CHECKING:
    from quire._handlers.arrays import ArrayHandler, NumpyArrayHandler
    from quire.backends import Backend

__all__ = [
    "ArrayHandler",
    "LeafHandler",
    "LoadContext",
    "LoadEntry",
    "NumpyArrayHandler",
    "ObjectProblem",
    "SaveContext",
    "SaveEntry",
    "StoredObject",
    "check_objects",
    "default_objects",
]

KeyPath = tuple[Any, ...]


@dataclass(frozen=True)
class SaveEntry:
    """One leaf to save: its key path, value, storage options and data location.

    ``location`` is the key (relative to the checkpoint root) under which the leaf may
    write data objects; it is unique to this leaf and this save.

    Attributes
    ----------
    path : tuple
        The leaf's key path in the saved tree.
    value : Any
        The leaf (after :meth:`LeafHandler.snapshot`, its host copy).
    storage : StorageOptions
        The leaf's storage options (cast, codecs, chunking, checksums).
    location : str
        Where the leaf's data objects go.
    """

    path: KeyPath
    value: Any
    storage: StorageOptions = field(default_factory=StorageOptions)
    location: str = ""


@dataclass(frozen=True)
class LoadEntry:
    """One leaf to load: its key path, the record its handler wrote, and the target
    (an abstract leaf from the user's abstract tree, or None for "as saved").

    Attributes
    ----------
    path : tuple
        The leaf's key path.
    record : mapping
        The JSON leaf record the handler's ``save`` returned.
    target : Any
        The abstract leaf, or None.
    """

    path: KeyPath
    record: Mapping[str, Any]
    target: Any = None


@dataclass
class SaveContext:
    """What a handler needs to write: the backend, the process layout, a byte budget.

    Attributes
    ----------
    url : str
        The checkpoint's URL (for messages).
    backend : Backend
        The checkpoint root, to write through.
    process_index, process_count : int
        This JAX process and how many there are.
    txid : str
        This save's data prefix (``d/<txid>/``).
    primary : int
        The process that writes shared objects (see :attr:`is_primary`).
    budget : ByteBudget, optional
        Bounds the host bytes held by in-flight writes.
    stats : dict
        ``bytes`` and ``objects`` written, for the caller's report.
    limit : asyncio.Semaphore, optional
        Bounds requests in flight (``Config.max_concurrency``).
    """

    url: str
    backend: Backend
    txid: str
    process_index: int = 0
    process_count: int = 1
    primary: int = 0
    budget: Any = None
    stats: dict[str, int] = field(default_factory=lambda: {"bytes": 0, "objects": 0})
    limit: Any = None  # asyncio.Semaphore bounding requests in flight (Config.max_concurrency)

    @property
    def is_primary(self) -> bool:
        """Whether this process is the primary one (writes what all processes share)."""
        return self.process_index == self.primary


@dataclass
class LoadContext:
    """What a handler needs to read.

    Attributes
    ----------
    url, backend, process_index, process_count
        As for :class:`SaveContext` (``backend`` is read through).
    stats : dict
        ``bytes`` and ``objects`` read, for the caller's report.
    limit : asyncio.Semaphore, optional
        Bounds requests in flight (``Config.max_concurrency``).
    budget : ByteBudget, optional
        Bounds transient host buffers (``Config.byte_budget``).
    """

    url: str
    backend: Backend
    process_index: int = 0
    process_count: int = 1
    stats: dict[str, int] = field(default_factory=lambda: {"bytes": 0, "objects": 0})
    limit: Any = None  # asyncio.Semaphore bounding requests in flight (Config.max_concurrency)
    budget: Any = None  # ByteBudget bounding transient host buffers (Config.byte_budget)


@dataclass(frozen=True)
class StoredObject:
    """Bytes a leaf owns: a byte range of an object, and how to check it.

    Attributes
    ----------
    key : str
        The object's key, relative to the checkpoint root (under ``d/``).
    offset : int
        Where the leaf's bytes start in the object.
    length : int or None
        How many bytes are the leaf's; None for "to the end of the object".  A packed
        layout names ranges of a shared object; the one-object-per-chunk layout names
        whole objects.
    check : callable or None
        ``check(data)`` raises ``ValueError`` (with the reason) when ``data``, the
        range's bytes, is damaged; None when only presence can be checked.  It runs in a
        worker thread.
    size : int or None
        The expected size of the range when known (progress, byte budgets).
    """

    key: str
    offset: int = 0
    length: int | None = None
    check: Callable[[bytes], None] | None = None
    size: int | None = None

    def cut(self, data: bytes) -> bytes:
        """This range of ``data``, the bytes of the whole object.

        Parameters
        ----------
        data : bytes
            The whole object.
        """
        end = None if self.length is None else self.offset + self.length
        return data[self.offset : end]


@dataclass(frozen=True)
class ObjectProblem:
    """One damaged or missing stored object, as ``verify`` reports it.

    Attributes
    ----------
    path : tuple
        The key path of the leaf that owns it.
    key : str
        The object's key (relative to the checkpoint root).
    error : str
        What is wrong with it.
    """

    path: KeyPath
    key: str
    error: str


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


@runtime_checkable
class LeafHandler(Protocol):
    """Saves and loads one kind of leaf; see the module docstring for the call order."""

    id: str
    priority: int

    def handles(self, value: Any) -> bool:
        """Whether this handler saves ``value`` (asked only for classes in ``types``).

        Parameters
        ----------
        value : object
            A leaf of the tree being saved.

        Returns
        -------
        bool
        """
        ...

    def handles_abstract(self, abstract: Any) -> bool:
        """Whether this handler can load into the abstract leaf ``abstract``.

        Parameters
        ----------
        abstract : object
            A leaf of the user's abstract tree (a ``jax.ShapeDtypeStruct``, a type, ...).

        Returns
        -------
        bool
        """
        ...

    def snapshot(self, entries: Sequence[SaveEntry]) -> list[SaveEntry]:
        """Copy the values to host memory for ``save_async``, in the caller's thread.

        Parameters
        ----------
        entries : sequence of SaveEntry
            The leaves this handler will save.

        Returns
        -------
        list of SaveEntry
            The same entries, one per input, whose values the caller may now mutate.
        """
        ...

    async def save(self, entries: Sequence[SaveEntry], ctx: SaveContext) -> list[dict[str, Any]]:
        """Write the leaves' data under their locations (before the commit point).

        Parameters
        ----------
        entries : sequence of SaveEntry
            The leaves to save, with storage options and locations under ``d/<txid>/``.
        ctx : SaveContext
            Backend, process layout, byte budget and concurrency limit.

        Returns
        -------
        list of dict
            One JSON-serialisable leaf record per entry, stored in ``quire.json``.

        Raises
        ------
        Exception
            Any failure; quire re-raises it with the key paths of ``entries``.
        """
        ...

    def check(self, entry: LoadEntry) -> str | None:
        """Why the saved leaf cannot load into ``entry.target`` (None when it can).

        Parameters
        ----------
        entry : LoadEntry
            The saved record and the target.

        Returns
        -------
        str or None
            A short reason (shown in the strict-load diff), or None.
        """
        ...

    async def load(self, entries: Sequence[LoadEntry], ctx: LoadContext) -> list[Any]:
        """Read the leaves back.

        Parameters
        ----------
        entries : sequence of LoadEntry
            The records this handler wrote and their targets.
        ctx : LoadContext
            Backend, process layout, byte budget and concurrency limit.

        Returns
        -------
        list
            One value per entry, as its target asks.

        Raises
        ------
        CorruptCheckpointError
            Data is missing or fails its checksum.
        Exception
            Any other failure; quire re-raises it with the key paths of ``entries``.
        """
        ...

    def metadata(self, records: Sequence[Mapping[str, Any]]) -> list[Any]:
        """Describe saved leaves from their records alone (no data is read).

        Parameters
        ----------
        records : sequence of mapping
            Leaf records this handler wrote.

        Returns
        -------
        list
            One description per record (``quire.LeafMetadata`` for arrays).

        Raises
        ------
        KeyError, TypeError, ValueError
            A malformed record (quire turns these into ``CorruptCheckpointError``).
        """
        ...

    # Optional (verify and cp use the module's defaults without them):
    #   async def objects(self, entries, ctx) -> list[list[StoredObject]]
    #   def verify(self, entries, ctx) -> AsyncIterator[ObjectProblem]


def __getattr__(name: str) -> Any:
    # The array handlers import this module (and jax): loaded on first use.
    if name in ("ArrayHandler", "NumpyArrayHandler"):
        from quire._handlers import arrays

        return getattr(arrays, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
