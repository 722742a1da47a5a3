"""Leaf-handler selection over the ``quire.leaf_handlers`` registry.

Candidates are the handlers of the current ``quire.Context`` (``leaf_handlers=``), then
run-time registrations, then installed entry points.  For a leaf of class ``C`` they are
ranked by

1. specificity: a handler that declares ``types`` (a tuple of classes) ranks by the
   position in ``C.__mro__`` of the first of them that ``C`` subclasses (``C`` itself
   first, ``object`` last); a handler without ``types`` ranks like ``object``.  A handler
   whose ``types`` do not match ``C`` is never asked;
2. ``priority`` (higher first);
3. where it comes from (Context, then run time, then installed) and then its id,

and the first whose ``handles(value)`` is true wins.  The ranking depends only on the
class, so it is computed once per class and registry state.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from quire._format.tree import keystr
from quire._runtime import registry as _registry
from quire._runtime.config import current
from quire._runtime.registry import leaf_handlers
from quire.errors import PluginError, QuireError

__all__ = ["all_handlers", "clear_instances", "context_handler", "for_value", "get", "ranked"]

_lock = threading.Lock()
# Handler instances, keyed by (id, the loaded plugin object): a configured plugin choice
# that loads another object gets its own instance.
_instances: dict[tuple[str, int], tuple[Any, Any]] = {}
_ranked: dict[tuple[int, tuple[int, ...], type], tuple[tuple[Any, ...], list[Any]]] = {}


@_registry.on_change
def clear_instances() -> None:
    with _lock:
        _instances.clear()
        _ranked.clear()


def _context_handlers() -> tuple[Any, ...]:
    return current().leaf_handlers


def _instance(handler_id: str, obj: Any) -> Any:
    key = (handler_id, id(obj))
    with _lock:
        hit = _instances.get(key)
        if hit is not None and hit[0] is obj:
            return hit[1]
        try:
            h = obj() if isinstance(obj, type) else obj
        except Exception as e:  # e.g. the plugin imports its framework when instantiated
            raise leaf_handlers.creation_error(handler_id, "leaf handler", e) from e
        _instances[key] = (obj, h)  # obj kept alive, so its id is not reused meanwhile
        return h


def context_handler(handler_id: str) -> Any | None:
    """The current ``quire.Context``'s handler called ``handler_id``, if it has one."""
    for h in _context_handlers():
        if h.id == handler_id:
            return h
    return None


def get(handler_id: str, *, url: str | None = None) -> Any:
    """The handler instance for ``handler_id`` (PluginError naming the package if absent)."""
    h = context_handler(handler_id)
    if h is not None:
        return h
    return _instance(handler_id, leaf_handlers.get(handler_id, url=url))


def all_handlers() -> list[tuple[int, Any]]:
    """(source rank, handler) for every handler in effect that loads; broken plugins are
    skipped here (``quire plugins`` reports them, using one by id raises)."""
    out: list[tuple[int, Any]] = [(0, h) for h in _context_handlers()]
    seen = {h.id for _, h in out}
    for name in leaf_handlers.names():
        if name in seen:
            continue
        try:
            h = get(name)
        except PluginError:
            continue
        out.append((1 if leaf_handlers.is_runtime(name) else 2, h))
    return out


def _specificity(h: Any, mro: tuple[type, ...]) -> int | None:
    types = getattr(h, "types", None)
    if types is None:
        return len(mro)  # generic: after every handler that names a class of the leaf
    if isinstance(types, type):
        types = (types,)
    ranks = [i for i, c in enumerate(mro) if any(c is t for t in types)]
    return min(ranks) if ranks else None


def ranked(cls: type) -> list[Any]:
    """The handlers that may take a leaf of class ``cls``, best first."""
    ctx = _context_handlers()
    key = (_registry.generation, tuple(id(h) for h in ctx), cls)
    with _lock:
        hit = _ranked.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], ctx)):
        return hit[1]
    mro = cls.__mro__
    scored = []
    for source, h in all_handlers():
        spec = _specificity(h, mro)
        if spec is not None:
            scored.append(((spec, -int(getattr(h, "priority", 0)), source, h.id), h))
    scored.sort(key=lambda s: s[0])
    out = [h for _, h in scored]
    with _lock:
        if len(_ranked) > 4096:  # many throwaway Contexts: start over rather than grow
            _ranked.clear()
        _ranked[key] = (ctx, out)
    return out


def for_value(value: Any) -> Any | None:
    """The handler that saves ``value`` (None when no handler takes it)."""
    for h in ranked(type(value)):
        if h.handles(value):
            return h
    return None


@contextlib.contextmanager
def failures_named(h: Any, entries: Sequence[Any], url: str, doing: str) -> Iterator[None]:
    """Run a handler's batch call, re-raising a third-party handler's failure with the key
    paths of ``entries`` in it (:func:`wrap_failure`); quire's own errors pass unchanged."""
    try:
        yield
    except Exception as e:
        wrapped = wrap_failure(h, e, [keystr(x.path) for x in entries], url, doing)
        if wrapped is e:
            raise
        raise wrapped from e


def wrap_failure(h: Any, e: Exception, paths: list[str], url: str, doing: str) -> Exception:
    """A third-party handler's own exception, re-typed with the leaves' key paths.

    quire's errors and quire's own handlers pass through unchanged; otherwise the result
    has the same type as ``e`` when that type takes a message (so ``except ValueError``
    still works), else is a :class:`~quire.errors.QuireError`.  Raise it ``from e``.
    """
    if isinstance(e, QuireError) or type(h).__module__.startswith("quire."):
        return e
    shown = ", ".join(repr(p) for p in paths[:5]) + (", ..." if len(paths) > 5 else "")
    what = f"leaf {shown}" if len(paths) == 1 else f"one of {len(paths)} leaves ({shown})"
    msg = (
        f"{url}: leaf handler {getattr(h, 'id', h)!r} failed {doing} {what}: "
        f"{type(e).__name__}: {e}"
    )
    try:
        wrapped = type(e)(msg)
    except Exception:  # broad: a type not built from a message: QuireError, raised from e
        return QuireError(msg)
    return wrapped if wrapped.args == (msg,) else QuireError(msg)
