"""The ``grain`` checkpointable handler: a Grain iterator's position, taken with
``get_state()`` at the call and restored with ``set_state()``, one per JAX process."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from quire.checkpointables import UnitIO
from quire.errors import CorruptCheckpointError, MultiProcessError, TreeMismatchError

STATE = "state.json"
DATASET, DATALOADER = "dataset", "dataloader"


@dataclass(frozen=True)
class GrainState:
    """A Grain iterator's state at an async save's call (what the handler writes later).

    Attributes
    ----------
    kind : str
        ``"dataset"`` (a ``grain.DatasetIterator``: ``get_state()`` is a dict) or
        ``"dataloader"`` (a ``grain.DataLoader`` iterator: ``get_state()`` is JSON bytes).
    data : bytes
        The state as JSON text.
    """

    kind: str
    data: bytes


def _from_grain(obj: Any) -> bool:
    # Checked before importing grain, which takes seconds: quire asks every handler about
    # every unit of every save.
    return any(c.__module__.split(".")[0] == "grain" for c in type(obj).__mro__)


def _kind(obj: Any) -> str | None:
    if not _from_grain(obj):
        return None
    import grain

    if isinstance(obj, grain.DatasetIterator):
        return DATASET
    if isinstance(obj, grain.DataLoaderIterator):
        return DATALOADER
    return None


def _one_process(what: str) -> None:
    """A whole unit (saved by one process, before quire-grain declared its state per
    process) holds one position: restoring it into several processes would resume every
    one of them at the same batch."""
    import jax

    n = jax.process_count()
    if n > 1:
        raise MultiProcessError(
            f"{what} holds one Grain iterator position, saved by one JAX process (an earlier "
            f"quire-grain saved it as one whole unit); this run has {n} processes, each with an "
            "iterator of its own. Restore it with one process, or start the iterators afresh; "
            "checkpoints saved now hold one position per process"
        )


class GrainIteratorHandler:
    """Grain iterators as named units of a checkpoint, with no wrapper::

        quire.save_checkpointables(url, {"state": state, "data": it})
        quire.load_checkpointables(url, {"state": abstract, "data": fresh_it})

    The unit's state is the iterator's ``get_state()`` (JSON, in the unit's own checksummed
    object ``state.json``); an async save takes it at the call (:meth:`snapshot`).  Loading
    needs the iterator to restore into as the unit's target (an iterator of the same
    pipeline): its ``set_state()`` is called and it is returned.

    The state is **per process** (``per_process = True``): in a job of several JAX processes
    each saves its own iterator's position (``p<process>/state.json`` under the unit) and
    restores its own; a load by another number of processes raises
    ``quire.TreeMismatchError`` naming the unit.
    """

    id = "grain"
    per_process = True

    def handles(self, obj: Any) -> bool:
        return _kind(obj) is not None

    def snapshot(self, obj: Any) -> GrainState:
        """The iterator's position now (``get_state()``), as JSON bytes.

        Parameters
        ----------
        obj : grain.DatasetIterator or grain.DataLoaderIterator
            The iterator.

        Returns
        -------
        GrainState
        """
        kind = _kind(obj)
        if kind is None:
            raise TypeError(f"not a Grain iterator: {type(obj).__name__}")
        state = obj.get_state()
        if kind == DATALOADER:
            data = bytes(state)
            json.loads(data)  # what load will parse: refused now, not at restore
        else:
            data = json.dumps(state, allow_nan=False, sort_keys=True).encode()
        return GrainState(kind, data)

    def save(self, obj: Any, io: UnitIO) -> Any:
        snap = obj if isinstance(obj, GrainState) else self.snapshot(obj)
        io.write(STATE, snap.data)
        return {"kind": snap.kind, "version": 1}

    def load(self, io: UnitIO, record: Any, target: Any) -> Any:
        where = f"{io.url}: the Grain iterator unit at {io.prefix}"
        kind = record.get("kind") if isinstance(record, dict) else None
        if kind not in (DATASET, DATALOADER) or record.get("version") != 1:
            raise CorruptCheckpointError(
                f"{where} has a malformed record {record!r}; the commit record is damaged"
            )
        got = None if target is None else _kind(target)
        if got != kind:
            want = "a grain.DatasetIterator" if kind == DATASET else "a grain.DataLoader iterator"
            raise TreeMismatchError(
                f"{where} holds {want}'s position; pass the iterator to restore into as the "
                f"unit's target (an iterator of the same pipeline, e.g. iter(dataset)), "
                f"not {type(target).__name__}"
            )
        if io.process is None:
            _one_process(where)
        raw = io.read(STATE)
        try:
            state: Any = json.loads(raw)
        except ValueError as e:
            raise CorruptCheckpointError(f"{where}: {STATE} is not JSON ({e})") from e
        try:
            target.set_state(raw if kind == DATALOADER else state)
        except (ValueError, KeyError, TypeError) as e:
            raise TreeMismatchError(
                f"{where}: the target iterator refused the saved state ({e!r}); restore into "
                "an iterator of the pipeline that was saved (same sources, transformations "
                "and options)"
            ) from e
        start = getattr(target, "start_prefetch", None)
        if start is not None:  # what Grain's own checkpoint handler does after set_state
            start()
        return target
