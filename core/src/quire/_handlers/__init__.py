"""Leaf-handler selection over the ``quire.leaf_handlers`` registry."""

from __future__ import annotations

import threading
from typing import Any

from quire._registry import leaf_handlers
from quire.errors import PluginError

_lock = threading.Lock()
_instances: dict[str, Any] = {}


def clear_instances() -> None:
    with _lock:
        _instances.clear()


def get(handler_id: str, *, url: str | None = None) -> Any:
    """The handler instance for ``handler_id`` (PluginError naming the package if absent)."""
    with _lock:
        h = _instances.get(handler_id)
    if h is not None:
        return h
    obj = leaf_handlers.get(handler_id, url=url)
    h = obj() if isinstance(obj, type) else obj
    with _lock:
        _instances[handler_id] = h
    return h


def all_handlers() -> list[Any]:
    """Every handler that loads, highest priority first (broken plugins are skipped)."""
    out = []
    for name in leaf_handlers.names():
        try:
            out.append(get(name))
        except PluginError:
            continue
    out.sort(key=lambda h: -int(getattr(h, "priority", 0)))
    return out


def for_value(value: Any) -> Any | None:
    for h in all_handlers():
        if h.handles(value):
            return h
    return None
