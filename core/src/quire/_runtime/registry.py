"""Entry-point registries: every group read in one pass, loaded lazily one name at a time.

A plugin that fails to import never breaks ``import quire``: the failure is recorded
(``quire plugins`` shows it) and raised as :class:`PluginError` only when that name is
selected.  Two distributions claiming one name is an error naming both, unless the
configuration picks one (``quire.configure(plugins={"quire.backends:s3": "dist"})``).
Objects registered at run time (``quire.handlers.register_leaf_handler``...) take precedence over
entry points of the same name.
"""

from __future__ import annotations

import functools
import itertools
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from quire._runtime.config import GROUPS, current
from quire._runtime.install import FIRST_PARTY_PLUGINS, install_hint, provider
from quire.errors import PluginError

__all__ = [
    "GROUPS",
    "PluginInfo",
    "Registry",
    "clear_caches",
    "register_checkpointable_handler",
    "register_leaf_handler",
    "registries",
    "unregister_checkpointable_handler",
    "unregister_leaf_handler",
]


# Bumped on every change of any registry; selection caches (_handlers) key on it.
_generation = itertools.count(1)
generation = 0


# Run when the leaf handlers change or the caches are cleared: quire._handlers.select registers
# its instance cache here, so that this module never imports it (no import cycle).
_listeners: list[Callable[[], None]] = []


def on_change(fn: Callable[[], None]) -> Callable[[], None]:
    """Call ``fn`` whenever leaf handlers are (un)registered or the caches are cleared."""
    _listeners.append(fn)
    return fn


def _notify() -> None:
    for fn in list(_listeners):
        fn()


def _bump() -> None:
    global generation
    generation = next(_generation)


@dataclass(frozen=True)
class PluginInfo:
    """One row of ``quire plugins``: where a plugin comes from and whether it loads."""

    group: str
    name: str
    value: str
    distribution: str
    version: str
    status: str  # "ok", "not loaded", "failed: ...", "conflict: ...", "not chosen: ..."


def canonical(dist: str) -> str:
    """A distribution name as PEP 503 compares them (``Quire_S3`` == ``quire-s3``)."""
    return re.sub(r"[-_.]+", "-", dist).lower()


def _dist(ep: EntryPoint) -> tuple[str, str]:
    d = getattr(ep, "dist", None)
    if d is None:
        return ("<unknown>", "")
    return _dist_name(d)


@functools.lru_cache(maxsize=1024)
def _dist_name(d: Any) -> tuple[str, str]:
    """Name and version of a distribution object (its metadata file is parsed once, not
    on every plugin look-up: a load looks a handler up per leaf kind)."""
    return (d.metadata["Name"] or "<unknown>", d.version or "")


_installed_lock = threading.Lock()
_installed: Any = None  # every group's installed entry points, read in one pass


def installed(group: str) -> list[EntryPoint]:
    """The entry points installed in ``group``.  Every group comes from one snapshot of
    the installed distributions (:func:`importlib.metadata.entry_points` reads each one's
    metadata: one pass, ~15 ms in a large environment, where each registry used to make
    its own); :func:`clear_caches` and ``Registry.clear_cache`` take a new one."""
    global _installed
    with _installed_lock:
        if _installed is None:
            _installed = entry_points()
        snapshot = _installed
    return list(snapshot.select(group=group))


def _forget_installed() -> None:
    global _installed
    with _installed_lock:
        _installed = None


class Registry:
    """The plugins of one entry-point group, plus run-time registrations."""

    def __init__(self, group: str) -> None:
        self.group = group
        self._lock = threading.RLock()
        self._eps: dict[str, list[EntryPoint]] | None = None
        # Keyed by the chosen entry point, so a different configured choice loads anew.
        self._loaded: dict[tuple[str, str, str], Any] = {}
        self._failed: dict[tuple[str, str, str], tuple[str, BaseException]] = {}
        self._runtime: dict[str, Any] = {}

    def _scan(self) -> dict[str, list[EntryPoint]]:
        with self._lock:
            if self._eps is None:
                found: dict[str, list[EntryPoint]] = {}
                seen: set[tuple[str, str, str]] = set()
                for ep in installed(self.group):
                    ident = (ep.name, ep.value, canonical(_dist(ep)[0]))
                    if ident in seen:  # same distribution visible twice on sys.path
                        continue
                    seen.add(ident)
                    found.setdefault(ep.name, []).append(ep)
                for eps in found.values():  # deterministic messages, whatever sys.path order
                    eps.sort(key=lambda ep: (canonical(_dist(ep)[0]), ep.value))
                self._eps = found
            return self._eps

    def clear_cache(self) -> None:
        """Forget the scanned entry points and everything loaded (not run-time objects)."""
        _forget_installed()
        with self._lock:
            self._eps = None
            self._loaded.clear()
            self._failed.clear()
        _bump()

    def names(self) -> list[str]:
        """Every name: installed entry points and run-time registrations."""
        return sorted(set(self._scan()) | set(self._runtime))

    def entry_points(self, name: str) -> list[EntryPoint]:
        """The entry points installed under ``name`` (several when distributions collide)."""
        return list(self._scan().get(name, ()))

    def register(self, name: str, obj: Any) -> None:
        """Register ``obj`` as ``name`` at run time (it wins over an entry point)."""
        with self._lock:
            self._runtime[name] = obj
        _bump()

    def unregister(self, name: str) -> None:
        with self._lock:
            self._runtime.pop(name, None)
        _bump()

    def is_runtime(self, name: str) -> bool:
        return name in self._runtime

    def _choose(self, name: str, eps: list[EntryPoint]) -> EntryPoint:
        if len(eps) == 1:
            return eps[0]
        key = f"{self.group}:{name}"
        choice = current().plugins.get(key)
        if choice is not None:
            for ep in eps:
                if canonical(_dist(ep)[0]) == canonical(choice) or ep.value == choice:
                    return ep
        dists = " and ".join(f"{_dist(ep)[0]} ({ep.value})" for ep in eps)
        bad = f" (the configured choice {choice!r} is neither)" if choice is not None else ""
        raise PluginError(
            f"{self.group} plugin {name!r} is provided by {dists}{bad}; pick one with "
            f"quire.configure(plugins={{'{key}': '<distribution>'}}) "
            "(or quire.Context(plugins=...)), or uninstall one of them",
            group=self.group,
            name=name,
        )

    def _missing(self, name: str, where: str) -> PluginError:
        hint = provider(self.group, name)
        if hint:
            fix = f"install {hint} ({install_hint(hint)})"
        else:
            have = ", ".join(self.names()) or "none"
            fix = f"install the package that provides it (installed: {have})"
        return PluginError(
            f"no {self.group} plugin named {name!r}{where}; {fix}", group=self.group, name=name
        )

    def get(self, name: str, *, url: str | None = None) -> Any:
        """The plugin object called ``name``; raises :class:`PluginError` with a fix."""
        where = f" (needed for {url})" if url else ""
        with self._lock:
            if name in self._runtime:
                return self._runtime[name]
            eps = self._scan().get(name)
            if not eps:
                raise self._missing(name, where)
            ep = self._choose(name, eps)
            dist = _dist(ep)[0]
            ident = (ep.name, ep.value, dist)
            if ident in self._loaded:
                return self._loaded[ident]
            failed = self._failed.get(ident)
            if failed is None:
                try:
                    obj = ep.load()
                except Exception as e:
                    failed = (f"{type(e).__name__}: {e}", e)
                    self._failed[ident] = failed
                else:
                    self._loaded[ident] = obj
                    return obj
        raise PluginError(
            f"{self.group} plugin {name!r}{where} from {dist} ({ep.value}) failed to import: "
            f"{failed[0]}; reinstall or fix {dist}",
            group=self.group,
            name=name,
        ) from failed[1]

    def chosen(self, name: str) -> str | None:
        """The value (``module:attr``) of the entry point :meth:`get` would load for
        ``name``, without loading it; None for a run-time registration, a name nothing
        provides, or a conflict :meth:`get` would refuse."""
        with self._lock:
            if name in self._runtime:
                return None
            eps = self._scan().get(name)
        if not eps:
            return None
        try:
            return self._choose(name, eps).value
        except PluginError:
            return None

    def distribution(self, name: str) -> str | None:
        """The distribution that provides ``name`` here (None if none or run-time only)."""
        eps = self._scan().get(name)
        if not eps or name in self._runtime:
            return None
        try:
            return _dist(self._choose(name, eps))[0]
        except PluginError:
            return None

    def creation_error(self, name: str, what: str, error: BaseException) -> PluginError:
        """The error for a plugin that loaded but could not be created (instantiated, or its
        factory called): it names the plugin, its distribution and the fix."""
        dist = self.distribution(name) or "the package that provides it"
        return PluginError(
            f"{what} {name!r} from {dist} cannot be created ({type(error).__name__}: {error}); "
            f"reinstall or fix {dist}",
            group=self.group,
            name=name,
        )

    def report(self, *, load: bool = True) -> list[PluginInfo]:
        """One row per entry point (and run-time registration) with its status.

        With ``load``, every chosen plugin is imported so that import errors show as
        ``failed: <error>``.
        """
        out = []
        for name, eps in sorted(self._scan().items()):
            chosen: EntryPoint | None = None
            conflict = None
            try:
                chosen = self._choose(name, eps)
            except PluginError:
                conflict = "conflict: provided by " + " and ".join(_dist(o)[0] for o in eps)
                conflict += f"; choose with quire.configure(plugins={{'{self.group}:{name}': ...}})"
            for ep in eps:
                dist, ver = _dist(ep)
                if conflict is not None:
                    status = conflict
                elif ep is not chosen:
                    status = "not chosen: plugins=" + repr(
                        {f"{self.group}:{name}": current().plugins.get(f"{self.group}:{name}")}
                    )
                elif name in self._runtime:
                    status = "overridden at run time"
                elif not load:
                    status = "not loaded"
                else:
                    try:
                        self.get(name)
                        status = "ok"
                    except PluginError as e:
                        cause = e.__cause__
                        status = (
                            f"failed: {type(cause).__name__}: {cause}" if cause else f"failed: {e}"
                        )
                out.append(PluginInfo(self.group, name, ep.value, dist, ver, status))
        with self._lock:
            runtime = sorted(self._runtime.items())
        for name, obj in runtime:
            out.append(PluginInfo(self.group, name, repr(obj), "(run-time)", "", "ok"))
        return out


registries: dict[str, Registry] = {g: Registry(g) for g in GROUPS}
backends = registries["quire.backends"]
codecs = registries["quire.codecs"]
leaf_handlers = registries["quire.leaf_handlers"]
checkpointables = registries["quire.checkpointables"]
sources = registries["quire.sources"]


def record_hint(err: PluginError, plugins: object) -> PluginError:
    """``err`` completed with what a checkpoint's ``plugins`` map says about the plugin
    that is missing or broken (``{"group:name": distribution}``, untrusted input)."""
    if err.group is None or err.name is None or not isinstance(plugins, dict):
        return err
    claimed = plugins.get(f"{err.group}:{err.name}")
    if not isinstance(claimed, str) or not claimed:
        return err
    # Distributions quire itself vouches for in an install hint: a record's ``plugins`` map is
    # untrusted input, so a name outside them (and not installed here providing that very
    # plugin) is quoted as the record's claim, never suggested as ``pip install X``.
    known = {canonical(p.distribution) for p in FIRST_PARTY_PLUGINS}
    reg = registries.get(err.group)
    if reg is not None:
        known |= {canonical(_dist(ep)[0]) for ep in reg.entry_points(err.name)}
    if canonical(claimed) in known and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", claimed):
        hint = f"This checkpoint was written with {claimed}: {install_hint(claimed)}"
    else:
        hint = (
            f"The checkpoint says it was written with plugin distribution {claimed[:100]!r}; "
            "quire does not know that distribution and suggests nothing to install: find out "
            "where the checkpoint comes from and which package provides "
            f"{err.group} plugin {err.name!r}"
        )
    return PluginError(f"{err}. {hint}", group=err.group, name=err.name)


def clear_caches() -> None:
    """Forget scanned entry points and loaded plugins (tests that install plugins use this)."""
    import importlib

    importlib.invalidate_caches()
    for r in registries.values():
        r.clear_cache()
    _notify()


def _handler_id(handler: Any, kind: str) -> str:
    hid = getattr(handler, "id", None)
    if not isinstance(hid, str) or not hid:
        raise TypeError(f"{handler!r} is not a {kind}: it has no str `id`")
    if not callable(getattr(handler, "handles", None)):
        raise TypeError(f"{handler!r} is not a {kind}: it has no `handles` method")
    return hid


def register_leaf_handler(handler: Any) -> Any:
    """Make a leaf handler available at run time (usable as a class decorator).

    Parameters
    ----------
    handler : LeafHandler instance or class
        Its ``id`` is recorded in checkpoints and used to find it when loading; a class
        is instantiated once, when first used.  It wins over an installed entry point
        with the same id and takes part in handler choice like an installed one (the
        handler whose ``types`` match the leaf's class most specifically wins).

    Returns
    -------
    The ``handler`` argument, unchanged.

    Raises
    ------
    TypeError
        ``handler`` has no str ``id`` or no ``handles`` method.
    """
    leaf_handlers.register(_handler_id(handler, "leaf handler"), handler)
    _notify()
    return handler


def unregister_leaf_handler(handler_id: str) -> None:
    """Undo :func:`register_leaf_handler` (installed entry points come back into effect).

    Parameters
    ----------
    handler_id : str
        The ``id`` of the handler registered at run time.
    """
    leaf_handlers.unregister(handler_id)
    _notify()


def register_checkpointable_handler(handler: Any) -> Any:
    """Make a checkpointable handler (for objects of types you do not own) available.

    Parameters
    ----------
    handler : CheckpointableHandler instance or class
        Its ``id`` is recorded with each unit it saves and used to find it when loading.

    Returns
    -------
    The ``handler`` argument, unchanged.

    Raises
    ------
    TypeError
        ``handler`` has no str ``id`` or no ``handles`` method.
    """
    checkpointables.register(_handler_id(handler, "checkpointable handler"), handler)
    return handler


def unregister_checkpointable_handler(handler_id: str) -> None:
    """Undo :func:`register_checkpointable_handler`.

    Parameters
    ----------
    handler_id : str
        The ``id`` of the handler registered at run time.
    """
    checkpointables.unregister(handler_id)
