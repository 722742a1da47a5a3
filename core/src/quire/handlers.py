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

Leaf plugins that store arrays build on :class:`ArrayHandler` (subclass) or
:class:`NumpyArrayHandler` (hold one and convert leaves to numpy arrays): quire's zarr v3
array format, chunked by sharding, crc32c on every chunk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

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
    "SaveContext",
    "SaveEntry",
]

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

    def handles(self, value: Any) -> bool: ...

    def handles_abstract(self, abstract: Any) -> bool: ...

    def snapshot(self, entries: Sequence[SaveEntry]) -> list[SaveEntry]: ...

    async def save(
        self, entries: Sequence[SaveEntry], ctx: SaveContext
    ) -> list[dict[str, Any]]: ...

    def check(self, entry: LoadEntry) -> str | None: ...

    async def load(self, entries: Sequence[LoadEntry], ctx: LoadContext) -> list[Any]: ...

    def metadata(self, records: Sequence[Mapping[str, Any]]) -> list[Any]: ...


def __getattr__(name: str) -> Any:
    # The array handlers import this module (and jax): loaded on first use.
    if name in ("ArrayHandler", "NumpyArrayHandler"):
        from quire._handlers import arrays

        return getattr(arrays, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
