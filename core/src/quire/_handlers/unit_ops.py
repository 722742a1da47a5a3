"""Engine side of checkpointable units: handler choice, an async save's snapshot step, save
and load of one unit."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from quire._handlers.json_unit import JsonHandler
from quire._handlers.units import Checkpointable, UnitIO
from quire._runtime import ioloop as _io
from quire._runtime.registry import checkpointables as _registry
from quire.errors import PluginError, QuireError, SnapshotError

if TYPE_CHECKING:
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

    def __init__(self, prefix: str, url: str) -> None:
        super().__init__(cast("Backend", None), prefix, url)
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


def capture(
    hid: str, handler: Any, obj: Any, *, url: str, name: str, prefix: str, writes: bool
) -> Any:
    """An async save's snapshot step for one unit, in the caller's thread, before the call
    returns: what :func:`save_unit` writes later, holding the unit's state at the call.

    1. The unit's own snapshot step: ``handler.snapshot(obj)`` for a handler,
       ``obj.quire_snapshot()`` for a :class:`~quire.checkpointables.Checkpointable`; it must
       return a new object (what ``save`` / ``quire_save`` writes later).
    2. Without one, the unit is written now, into memory (:class:`Captured`): its save runs
       here, and only its bytes are put into the checkpoint in the background.  A process
       that never writes the unit (``writes`` False: not the primary, not inline) skips it.
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
    io = _CaptureIO(prefix, url)
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
    hid: str, obj: Any, backend: Any, prefix: str, url: str, ctx: Any
) -> dict[str, Any]:
    """Write one unit (``obj`` as :func:`capture` made it for an async save) and return its
    entry in the commit record."""
    h = get(hid, url=url)
    io = UnitIO(backend, prefix, url)
    if is_inline(h):
        value = obj.record if isinstance(obj, Captured) else h.save(obj, io)
        return {"kind": "json", "value": value}
    if not ctx.is_primary:
        return {"kind": "handler", "handler": hid, "location": prefix, "record": None}
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
        raise QuireError(f"{url}: saving unit at {prefix} with handler {hid!r} failed: {e}") from e
    return {"kind": "handler", "handler": hid, "location": prefix, "record": record}


async def load_unit(unit: dict[str, Any], backend: Any, url: str, target: Any) -> Any:
    if unit["kind"] == "json":
        return unit["value"]
    # The unit's location was checked when the record was read (quire._engine.commit.read).
    io = UnitIO(backend, unit["location"], url)
    hid = unit["handler"]
    if hid == _SELF:
        if target is None or not hasattr(target, "quire_restore"):
            raise PluginError(
                f"{url}: this unit was saved by a Checkpointable object; pass an object with a "
                "quire_restore method as its target to load it"
            )
        return await _io.run_blocking(target.quire_restore, io, unit.get("record"))
    h = get(hid, url=url)
    return await _io.run_blocking(h.load, io, unit.get("record"), target)
