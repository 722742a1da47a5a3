"""Checkpointables: named units of a checkpoint beyond the main pytree.

``quire.save_checkpointables(url, {"state": tree, "data": it, "config": {...}})`` stores
each named unit in one checkpoint, committed together.  A unit is one of

* a pytree (the default: arrays, scalars, ... as with ``quire.save``),
* a plain JSON config (dicts / lists of str, int, float, bool, None), stored inline in
  ``quire.json`` by the ``json`` handler,
* an object implementing :class:`Checkpointable` (it saves itself under its own
  sub-prefix), or
* an object for which a :class:`CheckpointableHandler` is registered (entry-point group
  ``quire.checkpointables``, or :func:`quire.checkpointables.register_checkpointable_handler`) — the way to
  checkpoint types you do not own.

``quire.save(url, tree)`` is the single-unit case: the unit is named ``"pytree"``.

Call order of a handler during a save (``save`` in quire's I/O thread pool, after every
array is written, before the commit)::

    handles(obj) -> save(obj, io) -> JSON record      # files go through io.write(...)

An async save (``save_checkpointables_async``, ``Checkpointer.save_checkpointables``)
first captures every unit at the call, in the caller's thread, before it returns::

    handles(obj) -> snapshot(obj) -> snap             # optional; a new object, never obj
                 -> ... later: save(snap, io) -> JSON record
    handles(obj) -> save(obj, memory io)              # no snapshot: written at the call,
                 -> ... later: its bytes are put     #   only the bytes go later

(``quire_snapshot()`` / ``quire_save`` likewise for a :class:`Checkpointable`).  A unit
that can be neither snapshotted nor written at the call raises
:class:`quire.errors.SnapshotError` from the call; the live object is never written later.

During a load::

    load(io, record, target) -> object

With several JAX processes a unit is *whole* by default: every process calls the save, only
the primary's ``save`` runs, and every process's ``load`` reads that one state.  A handler
with ``per_process = True`` (a :class:`Checkpointable` with ``quire_per_process = True``)
holds a state of each process's own (a data iterator at its own position)::

    every process:  handles(obj) -> [snapshot(obj)] -> save(obj, io) -> its JSON record
                    # io.prefix = d/<txid>/<unit>/p<process>, io.process = its index
    the primary:    records of every process -> quire.json -> COMMIT
    every process:  load(io, records[process], target) -> object    # its own folder

A load by another number of processes than saved raises ``quire.TreeMismatchError`` naming
the unit, before ``load`` runs.
"""

from __future__ import annotations

from quire._handlers.json_unit import JsonHandler
from quire._handlers.units import Checkpointable, CheckpointableHandler, UnitIO
from quire._runtime.registry import (
    register_checkpointable_handler,
    unregister_checkpointable_handler,
)

__all__ = [
    "Checkpointable",
    "CheckpointableHandler",
    "JsonHandler",
    "UnitIO",
    "register_checkpointable_handler",
    "unregister_checkpointable_handler",
]
