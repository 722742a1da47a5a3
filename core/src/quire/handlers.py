"""The leaf-handler contract.

A leaf handler saves and loads one kind of leaf (numpy arrays, jax arrays, strings...).
It is found through the ``quire.leaf_handlers`` entry-point group (the name is the
handler id recorded in ``quire.json``) or registered at run time with
:func:`quire.handlers.register_leaf_handler`.

Call order for a save::

    handles(value)                    # choose the handler: most specific `types`, then
                                      # `priority` (docs/writing-a-plugin.md)
    snapshot(entries)                 # save_async only: bytes safe from the caller
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

from quire._handlers.arrays import ArrayHandler, NumpyArrayHandler
from quire._handlers.base import (
    LeafHandler,
    LoadContext,
    LoadEntry,
    ObjectProblem,
    SaveContext,
    SaveEntry,
    StoredObject,
)
from quire._handlers.objects import check_objects, default_objects
from quire._runtime.registry import register_leaf_handler, unregister_leaf_handler

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
    "register_leaf_handler",
    "unregister_leaf_handler",
]
