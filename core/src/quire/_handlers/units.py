"""The checkpointable-unit contract: the :class:`Checkpointable` and
:class:`CheckpointableHandler` protocols and the :class:`UnitIO` a handler writes through.
Published, with the call order of a save and a load, by :mod:`quire.checkpointables`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from quire._format.crc import crc_bytes
from quire._format.paths import escape_path
from quire._runtime import ioloop as _io
from quire.errors import CorruptCheckpointError

if TYPE_CHECKING:
    from quire._store.base import Backend

PYTREE = "pytree"


class UnitIO:
    """Blocking byte access under one unit's sub-prefix (``d/<txid>/<unit>/``).

    Handlers run in quire's I/O threads, so these calls may block.

    Attributes
    ----------
    url : str
        The checkpoint's URL (for messages).
    prefix : str
        Where the unit's objects lie in the checkpoint: ``d/<txid>/<unit>``, or for a
        per-process unit ``d/<txid>/<unit>/p<process, 5 digits>``.
    process : int or None
        For a per-process unit, the JAX process whose state this ``io`` writes or reads
        (this process); None for a whole unit, whose one state the primary writes and
        every process reads.
    """

    def __init__(self, backend: Backend, prefix: str, url: str, process: int | None = None) -> None:
        self.backend = backend
        self.prefix = prefix
        self.url = url
        self.process = process
        self.written: list[str] = []

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{escape_path(tuple(name.split('/')))}"

    def _run(self, coro: Any) -> Any:
        return _io.submit(coro).result()

    def write(self, name: str, data: bytes) -> None:
        """Store ``data`` as ``name`` (with a crc32c appended and checked on read).

        Parameters
        ----------
        name : str
            The object's name under the unit's prefix (``/`` separates folders).
        data : bytes
            Its content.
        """
        key = self._key(name)
        self._run(self.backend.put(key, [data, crc_bytes(data)]))
        self.written.append(name)

    def read(self, name: str) -> bytes:
        """The bytes stored as ``name``.

        Parameters
        ----------
        name : str
            As given to :meth:`write`.

        Raises
        ------
        CorruptCheckpointError
            The bytes fail their crc32c.
        """
        raw = self._run(self.backend.get(self._key(name)))
        body, crc = raw[:-4], raw[-4:]
        if len(raw) < 4 or crc_bytes(body) != crc:
            raise CorruptCheckpointError(
                f"{self.url}: object {self._key(name)!r} fails its checksum; the checkpoint is damaged"
            )
        return bytes(body)

    def write_json(self, name: str, value: Any) -> None:
        """Store ``value`` as JSON (no NaN or infinity) under ``name``.

        Parameters
        ----------
        name : str
            As for :meth:`write`.
        value : Any
            JSON data.
        """
        self.write(name, json.dumps(value, allow_nan=False).encode())

    def read_json(self, name: str) -> Any:
        """The JSON value stored by :meth:`write_json`.

        Parameters
        ----------
        name : str
            As given to :meth:`write_json`.
        """
        return json.loads(self.read(name))


@runtime_checkable
class Checkpointable(Protocol):
    """An object that saves and restores itself (e.g. a data iterator's position).

    ``quire_save`` writes through ``io`` and returns a small JSON record;
    ``quire_restore`` reads it back and returns the restored object (often ``self``,
    restored in place).  When loading, pass the object (or anything with
    ``quire_restore``) as the unit's target.

    An async save (``save_checkpointables_async``, ``Checkpointer.save_checkpointables``)
    captures the unit's state at the call, in the caller's thread, before it returns:

    * with an optional ``quire_snapshot()`` method, it calls that and later (in quire's I/O
      threads) ``quire_save`` of what it returned: a new object holding the state at the
      call, never ``self``;
    * without one, it calls ``quire_save`` at once with an ``io`` that keeps the bytes in
      memory, and writes them later.

    If neither works, the call raises :class:`quire.errors.SnapshotError` and saves nothing.
    A blocking save calls ``quire_save`` of the object itself.

    **Per process.**  By default a unit is *whole*: with several JAX processes only the
    primary's ``quire_save`` runs, and every process restores that one state.  A class
    attribute ``quire_per_process = True`` declares a state of each process's own (a data
    iterator at its own position): every process then captures and writes its own object
    (``io.prefix`` ends in ``p<process>``, ``io.process`` is its index), the commit record
    keeps one record per process, and at load each process's ``quire_restore`` reads its
    own.  A load by another number of processes than saved raises
    :class:`quire.errors.TreeMismatchError` naming the unit.
    """

    def quire_save(self, io: UnitIO) -> Any:
        """Write this object's state through ``io`` (before the commit point).

        Parameters
        ----------
        io : UnitIO
            Reads and writes objects under the unit's own prefix in the checkpoint.

        Returns
        -------
        object
            A small JSON-serialisable record, stored in ``quire.json``.
        """
        ...

    def quire_restore(self, io: UnitIO, record: Any) -> Any:
        """Restore the state written by :meth:`quire_save`.

        Parameters
        ----------
        io : UnitIO
            Reads and writes objects under the unit's own prefix in the checkpoint.
        record : object
            The record ``quire_save`` returned.

        Returns
        -------
        object
            The restored object (often ``self``).
        """
        ...


@runtime_checkable
class CheckpointableHandler(Protocol):
    """Saves and loads objects of types you do not own, as a named unit.

    An async save captures the unit at the call: with an optional ``snapshot(obj)`` method
    the handler returns a new object holding ``obj``'s state at the call (in the caller's
    thread), and ``save`` later writes that; without one, ``save(obj, io)`` runs at the call
    into memory and only its bytes are written later.  If neither works, the call raises
    :class:`quire.errors.SnapshotError` and saves nothing.

    **Per process.**  A handler whose objects hold a state of each JAX process's own (a data
    iterator at its own position) declares a class attribute ``per_process = True``.  With
    several processes, each then runs ``snapshot`` / ``save`` for its own object under its
    own folder (``io.prefix`` ends in ``p<process>``, ``io.process`` is its index), the
    primary puts every process's record into the commit record, and ``load`` runs in each
    process with that process's ``io`` and record.  A load by another number of processes
    than saved raises :class:`quire.errors.TreeMismatchError` naming the unit, before
    ``load`` is called.  Without the attribute a unit is whole: only the primary's ``save``
    runs, and every process's ``load`` reads that one state.
    """

    id: str

    def handles(self, obj: Any) -> bool:
        """Whether this handler saves the unit ``obj``.

        Parameters
        ----------
        obj : object
            A unit given to ``save_checkpointables``.

        Returns
        -------
        bool
        """
        ...

    def save(self, obj: Any, io: UnitIO) -> Any:
        """Write ``obj`` through ``io`` (before the commit point).

        Parameters
        ----------
        obj : object
            The unit.
        io : UnitIO
            Reads and writes objects under the unit's own prefix in the checkpoint.

        Returns
        -------
        object
            A small JSON-serialisable record, stored in ``quire.json``.
        """
        ...

    def load(self, io: UnitIO, record: Any, target: Any) -> Any:
        """Read the unit back.

        Parameters
        ----------
        io : UnitIO
            Reads and writes objects under the unit's own prefix in the checkpoint.
        record : object
            The record :meth:`save` returned.
        target : object or None
            The caller's target for this unit (None: as saved).

        Returns
        -------
        object
            The loaded unit.
        """
        ...


def as_mapping(units: Any) -> Mapping[str, Any]:
    if not isinstance(units, Mapping) or not all(isinstance(k, str) and k for k in units):
        raise TypeError("checkpointables must be a dict of {non-empty str name: object}")
    return units
