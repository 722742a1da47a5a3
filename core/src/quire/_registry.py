"""Entry-point registries: read once per group, loaded lazily one name at a time.

A plugin that fails to import never breaks ``import quire``: the failure is recorded
(``quire plugins`` shows it) and raised as :class:`PluginError` only when that name is
selected.  Two distributions claiming one name is an error naming both, unless the
configuration picks one (``quire.configure(plugins={"quire.backends:s3": "dist"})``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from quire.errors import PluginError

GROUPS = ("quire.backends", "quire.codecs", "quire.leaf_handlers", "quire.checkpointables")

# Where to get first-party plugins that are not installed.
INSTALL_HINTS = {
    ("quire.backends", "s3"): "quire-s3",
    ("quire.backends", "s3a"): "quire-s3",
    ("quire.backends", "gs"): "quire-gcs",
    ("quire.backends", "gcs"): "quire-gcs",
    ("quire.leaf_handlers", "torch"): "quire-torch",
}


@dataclass(frozen=True)
class PluginInfo:
    group: str
    name: str
    value: str
    distribution: str
    version: str
    status: str  # "ok", "not loaded", "failed: ...", "conflict: ..."


def _dist(ep: EntryPoint) -> tuple[str, str]:
    d = getattr(ep, "dist", None)
    if d is None:
        return ("<unknown>", "")
    return (d.metadata["Name"] or "<unknown>", d.version or "")


class Registry:
    """The plugins of one entry-point group, plus run-time registrations."""

    def __init__(self, group: str) -> None:
        self.group = group
        self._lock = threading.RLock()
        self._eps: dict[str, list[EntryPoint]] | None = None
        self._loaded: dict[str, Any] = {}
        self._failed: dict[str, str] = {}
        self._runtime: dict[str, Any] = {}

    def _scan(self) -> dict[str, list[EntryPoint]]:
        with self._lock:
            if self._eps is None:
                found: dict[str, list[EntryPoint]] = {}
                seen: set[tuple[str, str, str]] = set()
                for ep in entry_points(group=self.group):
                    ident = (ep.name, ep.value, _dist(ep)[0])
                    if ident in seen:  # same distribution visible twice on sys.path
                        continue
                    seen.add(ident)
                    found.setdefault(ep.name, []).append(ep)
                self._eps = found
            return self._eps

    def clear_cache(self) -> None:
        with self._lock:
            self._eps = None
            self._loaded.clear()
            self._failed.clear()

    def names(self) -> list[str]:
        return sorted(set(self._scan()) | set(self._runtime))

    def register(self, name: str, obj: Any) -> None:
        with self._lock:
            self._runtime[name] = obj

    def unregister(self, name: str) -> None:
        with self._lock:
            self._runtime.pop(name, None)

    def _choose(self, name: str, eps: list[EntryPoint]) -> EntryPoint:
        if len(eps) == 1:
            return eps[0]
        from quire._config import current

        choice = current().plugins.get(f"{self.group}:{name}")
        if choice is not None:
            for ep in eps:
                if _dist(ep)[0] == choice or ep.value == choice:
                    return ep
        dists = " and ".join(f"{_dist(ep)[0]} ({ep.value})" for ep in eps)
        raise PluginError(
            f"{self.group} plugin {name!r} is provided by {dists}; pick one with "
            f"quire.configure(plugins={{'{self.group}:{name}': '<distribution>'}}) "
            "or uninstall one of them"
        )

    def get(self, name: str, *, url: str | None = None) -> Any:
        """The plugin object called ``name``; raises :class:`PluginError` with a fix."""
        with self._lock:
            if name in self._runtime:
                return self._runtime[name]
            if name in self._loaded:
                return self._loaded[name]
            eps = self._scan().get(name)
            where = f" (needed for {url})" if url else ""
            if not eps:
                hint = INSTALL_HINTS.get((self.group, name))
                fix = (
                    f"install {hint} (pip install {hint})"
                    if hint
                    else (
                        f"install a package that provides it (installed: {', '.join(self.names()) or 'none'})"
                    )
                )
                raise PluginError(f"no {self.group} plugin named {name!r}{where}; {fix}")
            ep = self._choose(name, eps)
            try:
                obj = ep.load()
            except Exception as e:
                self._failed[name] = f"{type(e).__name__}: {e}"
                raise PluginError(
                    f"{self.group} plugin {name!r}{where} from {_dist(ep)[0]} failed to import: "
                    f"{type(e).__name__}: {e}; reinstall or fix that package"
                ) from e
            self._loaded[name] = obj
            return obj

    def report(self, *, load: bool = True) -> list[PluginInfo]:
        out = []
        for name, eps in sorted(self._scan().items()):
            for ep in eps:
                dist, ver = _dist(ep)
                status = "not loaded"
                if len(eps) > 1:
                    status = "conflict: also provided by " + ", ".join(
                        _dist(o)[0] for o in eps if o is not ep
                    )
                elif load:
                    try:
                        self.get(name)
                        status = "ok"
                    except PluginError as e:
                        cause = e.__cause__
                        status = (
                            f"failed: {type(cause).__name__}: {cause}" if cause else f"failed: {e}"
                        )
                out.append(PluginInfo(self.group, name, ep.value, dist, ver, status))
        for name, obj in sorted(self._runtime.items()):
            out.append(PluginInfo(self.group, name, repr(obj), "<runtime>", "", "ok"))
        return out


registries: dict[str, Registry] = {g: Registry(g) for g in GROUPS}
backends = registries["quire.backends"]
codecs = registries["quire.codecs"]
leaf_handlers = registries["quire.leaf_handlers"]
checkpointables = registries["quire.checkpointables"]


def clear_caches() -> None:
    """Forget scanned entry points and loaded plugins (tests use this)."""
    for r in registries.values():
        r.clear_cache()
    from quire import _handlers

    _handlers.clear_instances()
