"""Engine side of checkpointable units: handler choice, save and load of one unit."""

from __future__ import annotations

import copy as _copy
from typing import Any

from quire._handlers.json_unit import JsonHandler
from quire._handlers.units import Checkpointable, UnitIO
from quire._runtime import ioloop as _io
from quire._runtime.registry import checkpointables as _registry
from quire.errors import PluginError, QuireError

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


def snapshot(handler: Any, obj: Any) -> Any:
    """For save_async: a private copy, so the caller may mutate the object afterwards."""
    if handler is not None and hasattr(handler, "snapshot"):
        return handler.snapshot(obj)
    try:
        return _copy.deepcopy(obj)
    except Exception:
        return obj


async def save_unit(
    hid: str, obj: Any, backend: Any, prefix: str, url: str, ctx: Any
) -> dict[str, Any]:
    h = get(hid, url=url)
    io = UnitIO(backend, prefix, url)
    if isinstance(h, JsonHandler) or getattr(h, "inline", False):
        return {"kind": "json", "value": h.save(obj, io)}
    if not ctx.is_primary:
        return {"kind": "handler", "handler": hid, "location": prefix, "record": None}
    try:
        if h is None:
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
