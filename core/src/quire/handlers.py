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

Handlers always receive batches of entries, never one leaf per call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from quire.options import StorageOptions

if TYPE_CHECKING:
    from quire.backends import Backend

__all__ = ["LeafHandler", "LoadContext", "LoadEntry", "SaveContext", "SaveEntry"]

KeyPath = tuple[Any, ...]


@dataclass(frozen=True)
class SaveEntry:
    """One leaf to save: its key path, value, storage options and data location.

    ``location`` is the key (relative to the checkpoint root) under which the leaf may
    write data objects; it is unique to this leaf and this save.
    """

    path: KeyPath
    value: Any
    storage: StorageOptions = field(default_factory=StorageOptions)
    location: str = ""


@dataclass(frozen=True)
class LoadEntry:
    """One leaf to load: its key path, the record its handler wrote, and the target
    (an abstract leaf from the user's abstract tree, or None for "as saved")."""

    path: KeyPath
    record: Mapping[str, Any]
    target: Any = None


@dataclass
class SaveContext:
    """What a handler needs to write: the backend, the process layout, a byte budget."""

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
        return self.process_index == self.primary


@dataclass
class LoadContext:
    """What a handler needs to read."""

    url: str
    backend: Backend
    process_index: int = 0
    process_count: int = 1
    stats: dict[str, int] = field(default_factory=lambda: {"bytes": 0, "objects": 0})
    limit: Any = None  # asyncio.Semaphore bounding requests in flight (Config.max_concurrency)
    budget: Any = None  # ByteBudget bounding transient host buffers (Config.byte_budget)


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
