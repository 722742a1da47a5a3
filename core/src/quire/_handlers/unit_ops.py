"""Engine side of checkpointable units: handler choice, an async save's snapshot step, save
and load of one unit, and the records of per-process units gathered to the primary."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import jax

from quire._format.record import process_dir
from quire._handlers.json_unit import JsonHandler
from quire._handlers.units import Checkpointable, UnitIO
from quire._runtime import ioloop as _io
from quire._runtime.multihost import digest
from quire._runtime.registry import checkpointables as _registry
from quire.errors import (
    MultiProcessError,
    PluginError,
    QuireError,
    SnapshotError,
    TreeMismatchError,
)

if TYPE_CHECKING:
    from quire._runtime.multihost import Coordinator
    from quire._store.base import Backend

_SELF = "self"  # units that implement the Checkpointable protocol themselves


def get(hid: str, *, url: str | None = None) -> Any:
    if hid == _SELF:
        return None
    obj = _registry.get(hid, url=url)
    try:
        return obj() if isinstance(obj, type) else obj
    except Exception as e:
        raise _registry.creation_error(hid, "checkpointable handler", e) from e


def handler_for(obj: Any) -> str | None:
    """The handler id for a unit, or None when the unit is a pytree."""
    if isinstance(obj, Checkpointable) and not isinstance(obj, type):
        return _SELF
    for name in _registry.names():
        try:
            h = get(name)
        except PluginError:
            continue
        if h is not None and h.handles(obj):
            return name
    return None


@dataclass(frozen=True)
class Captured:
    """A unit written at an async save's call (it has no snapshot step): the bytes of the
    objects its save wrote, and the record it returned; put into the checkpoint later."""

    objects: tuple[tuple[str, bytes], ...]
    record: Any


class _CaptureIO(UnitIO):
    """A :class:`UnitIO` that keeps what a unit writes in memory, to be written later."""

    def __init__(self, prefix: str, url: str, process: int | None) -> None:
        super().__init__(cast("Backend", None), prefix, url, process)
        self.objects: dict[str, bytes] = {}

    def write(self, name: str, data: bytes) -> None:
        self._key(name)  # the same escaping (and refusals) as the real write
        self.objects[name] = bytes(data)  # a copy: the caller's buffer may change
        self.written.append(name)

    def read(self, name: str) -> bytes:
        if name in self.objects:
            return self.objects[name]
        raise QuireError(
            f"{self.url}: a unit read {name!r} while it was being written at the call of an "
            "async save; read only what it wrote itself, or give it a snapshot step"
        )


def is_inline(handler: Any) -> bool:
    """Whether the unit's record is its whole value, inline in ``quire.json`` (every
    process saves it, and the processes must agree on it)."""
    return isinstance(handler, JsonHandler) or bool(getattr(handler, "inline", False))


def is_per_process(hid: str, handler: Any, obj: Any, *, url: str, name: str) -> bool:
    """Whether unit ``name`` holds a state per JAX process: its handler's ``per_process``,
    or (a :class:`~quire.checkpointables.Checkpointable`) the object's ``quire_per_process``,
    read from the object given to the save (not from its snapshot)."""
    if handler is None:
        flag = getattr(obj, "quire_per_process", False)
    else:
        flag = getattr(handler, "per_process", False)
    if flag is True and is_inline(handler):
        raise PluginError(
            f"{url}: unit {name!r}: handler {hid!r} declares both inline and per_process; an "
            "inline unit is one value every process agrees on. Drop one of the two",
            group="quire.checkpointables",
            name=hid,
        )
    return flag is True


def capture(
    hid: str,
    handler: Any,
    obj: Any,
    *,
    url: str,
    name: str,
    prefix: str,
    writes: bool,
    process: int | None = None,
) -> Any:
    """An async save's snapshot step for one unit, in the caller's thread, before the call
    returns: what :func:`save_unit` writes later, holding the unit's state at the call.

    1. The unit's own snapshot step: ``handler.snapshot(obj)`` for a handler,
       ``obj.quire_snapshot()`` for a :class:`~quire.checkpointables.Checkpointable`; it must
       return a new object (what ``save`` / ``quire_save`` writes later).
    2. Without one, the unit is written now, into memory (:class:`Captured`): its save runs
       here, and only its bytes are put into the checkpoint in the background.  A process
       that never writes the unit (``writes`` False: not the primary, neither inline nor
       per process) skips it.
    3. Anything else raises :class:`SnapshotError`: never the live object in the background.
    """
    what = f"{url}: unit {name!r}" + ("" if handler is None else f" (handler {hid!r})")
    if handler is None:
        step = getattr(obj, "quire_snapshot", None)
        hook = "quire_snapshot()"
    else:
        step = getattr(handler, "snapshot", None)
        hook = f"{type(handler).__name__}.snapshot(obj)"
    if step is not None:
        try:
            snap = step() if handler is None else step(obj)
        except QuireError:
            raise
        except Exception as e:
            raise SnapshotError(
                f"{what}: its snapshot step {hook} failed at the async save's call ({e!r}); "
                "nothing was saved. Fix the unit's snapshot, or save with the blocking "
                "quire.save_checkpointables"
            ) from e
        if snap is obj:
            raise SnapshotError(
                f"{what}: {hook} returned the object itself; an async save would then write "
                "the live object later, not its state at the call. Return a copy of the state"
            )
        if handler is None and not hasattr(snap, "quire_save"):
            raise SnapshotError(
                f"{what}: quire_snapshot() returned {type(snap).__name__}, which has no "
                "quire_save; return an object whose quire_save writes the state at the call"
            )
        return snap
    if not writes:
        return None  # save_unit never looks at it in this process
    io = _CaptureIO(prefix, url, process)
    try:
        record = obj.quire_save(io) if handler is None else handler.save(obj, io)
        # A copy of the record too (it may be live state); quire.json holds JSON anyway.
        record = json.loads(json.dumps(record, allow_nan=False))
    except Exception as e:
        fix = "quire_snapshot()" if handler is None else f"a snapshot(obj) method on {hid!r}"
        raise SnapshotError(
            f"{what} has no snapshot step, and writing it at the async save's call failed "
            f"({e!r}); nothing was saved. Give it {fix} returning its state at the call, "
            "or save with the blocking quire.save_checkpointables"
        ) from e
    return Captured(tuple(io.objects.items()), record)


def _write_captured(io: UnitIO, captured: Captured) -> Any:
    for name, data in captured.objects:
        io.write(name, data)
    return captured.record


async def save_unit(
    hid: str, obj: Any, backend: Any, prefix: str, url: str, ctx: Any, *, per_process: bool = False
) -> dict[str, Any]:
    """Write one unit (``obj`` as :func:`capture` made it for an async save) and return its
    entry in the commit record.  A per-process unit is written by every process into its
    own folder; its entry holds this process's record only (:func:`gather_records` fills
    in the others' on the primary)."""
    h = get(hid, url=url)
    io = UnitIO(backend, prefix, url)
    if is_inline(h):
        value = obj.record if isinstance(obj, Captured) else h.save(obj, io)
        return {"kind": "json", "value": value}
    if per_process:
        me, n = ctx.process_index, ctx.process_count
        io = UnitIO(backend, f"{prefix}/{process_dir(me)}", url, me)
        records: list[Any] = [None] * n
        records[me] = await _write(hid, h, obj, io, url)
        return {"kind": "handler", "handler": hid, "location": prefix, "processes": n,
                "records": records}  # fmt: skip
    if not ctx.is_primary:
        return {"kind": "handler", "handler": hid, "location": prefix, "record": None}
    record = await _write(hid, h, obj, io, url)
    return {"kind": "handler", "handler": hid, "location": prefix, "record": record}


async def _write(hid: str, h: Any, obj: Any, io: UnitIO, url: str) -> Any:
    try:
        if isinstance(obj, Captured):
            record = await _io.run_blocking(_write_captured, io, obj)
        elif h is None:
            record = await _io.run_blocking(obj.quire_save, io)
        else:
            record = await _io.run_blocking(h.save, obj, io)
    except QuireError:
        raise
    except Exception as e:
        raise QuireError(
            f"{url}: saving unit at {io.prefix} with handler {hid!r} failed: {e}"
        ) from e
    return record


async def load_unit(
    unit: dict[str, Any], backend: Any, url: str, target: Any, name: str = "?"
) -> Any:
    """Load unit ``name``; a per-process unit's state of this process (its folder and
    record), once its process count is checked against this run's."""
    if unit["kind"] == "json":
        return unit["value"]
    # The unit's location was checked when the record was read (quire._engine.commit.read),
    # its process count and records by the schema.
    io = UnitIO(backend, unit["location"], url)
    record = unit.get("record")
    if "processes" in unit:
        me, n = jax.process_index(), jax.process_count()
        if n != unit["processes"]:
            raise TreeMismatchError(
                f"{url}: unit {name!r} (handler {unit['handler']!r}) holds one state per JAX "
                f"process, saved by {unit['processes']} process(es); this run has {n}, so "
                f"process {me} has no state of its own in it. Restore it with "
                f"{unit['processes']} process(es), or leave {name!r} out of the load (load the "
                "other units by name) and start it afresh",
                mismatched=[name],
            )
        io = UnitIO(backend, f"{unit['location']}/{process_dir(me)}", url, me)
        record = unit["records"][me]
    hid = unit["handler"]
    if hid == _SELF:
        if target is None or not hasattr(target, "quire_restore"):
            raise PluginError(
                f"{url}: this unit was saved by a Checkpointable object; pass an object with a "
                "quire_restore method as its target to load it"
            )
        return await _io.run_blocking(target.quire_restore, io, record)
    h = get(hid, url=url)
    return await _io.run_blocking(h.load, io, record, target)


# ----------------------------------------------------------------------------- per process
def per_process_names(units: Mapping[str, dict[str, Any]]) -> list[str]:
    return [n for n, u in units.items() if u.get("kind") == "handler" and "processes" in u]


def per_process_digests(units: Mapping[str, dict[str, Any]]) -> dict[str, str]:
    """What every process must agree on about its per-process units (not their records)."""
    return {
        n: digest([units[n][k] for k in ("handler", "location", "processes")])
        for n in per_process_names(units)
    }


def own_records(coord: Coordinator, units: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """This process's records of the per-process units, which a process other than the
    primary shares for the primary's commit record (:func:`gather_records`)."""
    return {n: units[n]["records"][coord.index] for n in per_process_names(units)}


def gather_records(
    coord: Coordinator,
    units: dict[str, dict[str, Any]],
    url: str,
    shared: Mapping[int, Any],
) -> dict[str, dict[str, Any]]:
    """The primary, once every process reported its writes done: ``units`` with every
    process's record of each per-process unit (``shared``: process -> its
    :func:`own_records`)."""
    names = per_process_names(units)
    if not names or not coord.active:
        return units
    out = dict(units)
    for n in names:
        records = list(units[n]["records"])
        for i in range(coord.count):
            if i == coord.index:
                continue
            got = shared.get(i)
            if not isinstance(got, Mapping) or n not in got:
                raise MultiProcessError(
                    f"{url}: process {i} reported its writes done without its record of the "
                    f"per-process unit {n!r}; nothing is committed (every process must save "
                    "the same units)"
                )
            records[i] = got[n]
        out[n] = {**units[n], "records": records}
    return out
