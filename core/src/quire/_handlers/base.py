"""The leaf-handler contract: :class:`LeafHandler`, the entries and contexts handlers
receive, and :class:`StoredObject` / :class:`ObjectProblem`.  Published, with the call order
of a save, a load, a verify and a copy, by :mod:`quire.handlers`; this module imports nothing
of quire's implementation."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from quire.options import StorageOptions

if TYPE_CHECKING:
    from quire._store.base import Backend

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
        The leaf (after :meth:`LeafHandler.snapshot`, its snapshot).
    storage : StorageOptions
        The leaf's storage options (cast, codecs, chunking, checksums).
    location : str
        Where the leaf's data objects go.
    writers : Any, optional
        For array leaves of a multi-process save with replica-parallel writes: the
        chunk grid and the chunks this process writes (set by the save before
        :meth:`LeafHandler.snapshot`); None: each shard is written by its replica 0.
    """

    path: KeyPath
    value: Any
    storage: StorageOptions = field(default_factory=StorageOptions)
    location: str = ""
    writers: Any = None


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
    casting : str
        Which casts to the target's dtype the load may make, in numpy's terms
        (``"no"``, ``"equiv"``, ``"safe"``, ``"same_kind"``, ``"unsafe"``); the default
        ``"same_kind"`` also refuses an integer narrowed past one of its values.  A handler
        that casts refuses the others with :class:`~quire.errors.LossyCastError`.
    """

    path: KeyPath
    record: Mapping[str, Any]
    target: Any = None
    casting: str = "same_kind"


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
        """Make the values safe from the caller for ``save_async``, in the caller's thread
        (host copies, or anything the caller's next step cannot change or free).

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
            One description per record (``quire.metadata.LeafMetadata`` for arrays).

        Raises
        ------
        KeyError, TypeError, ValueError
            A malformed record (quire turns these into ``CorruptCheckpointError``).
        """
        ...

    # Optional (verify and cp use the module's defaults without them):
    #   async def objects(self, entries, ctx) -> list[list[StoredObject]]
    #   def verify(self, entries, ctx) -> AsyncIterator[ObjectProblem]
