"""URL -> backend: the protocol picks a ``quire.backends`` plugin."""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from typing import Any

from quire._runtime.config import current
from quire._runtime.install import install_hint, provider
from quire._runtime.registry import backends
from quire._store.base import Backend
from quire._store.local import local_path
from quire.errors import PluginError


def protocol_of(url: str) -> str:
    if "://" not in url:
        return "file"
    return url.split("://", 1)[0].lower() or "file"


def normalize(url: str | os.PathLike[str]) -> str:
    """A canonical form of ``url`` (local paths absolute, no trailing slash)."""
    s = os.fspath(url)
    if not isinstance(s, str) or not s:
        raise TypeError(f"checkpoint URL must be a non-empty str or path, got {url!r}")
    if "\x00" in s:
        raise ValueError(f"checkpoint URL {s!r} contains a NUL byte")
    if protocol_of(s) == "file":
        return local_path(s)
    return s.rstrip("/")


def effective_options(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` over the current Context's options for ``url``'s protocol: what
    a backend (and a source plugin) for ``url`` is given."""
    opts = dict(current().storage_options.get(protocol_of(url), {}))
    opts.update(storage_options or {})
    return opts


# url -> the backend that serves it, for the code (and the background work it starts) run
# inside ``mounted``; nothing else sees it.
_mounts: contextvars.ContextVar[dict[str, Backend] | None] = contextvars.ContextVar(
    "quire_mounts", default=None
)


@contextlib.contextmanager
def mounted(url: str, backend: Backend) -> Iterator[None]:
    """Inside the block (this thread / asyncio task and the work it hands to quire's
    background threads), :func:`open_backend` of exactly ``url`` returns ``backend``: the
    load engine reads a step through a backend the caller built (a multi-process local
    tier's restore reader) while every message still names ``url``."""
    token = _mounts.set({**(_mounts.get() or {}), url: backend})
    try:
        yield
    finally:
        _mounts.reset(token)


def open_backend(url: str, storage_options: dict[str, Any] | None = None) -> Backend:
    """The backend for ``url``: its protocol's plugin, else fsspec's generic one."""
    mounts = _mounts.get()
    if mounts and url in mounts:
        return mounts[url]
    proto = protocol_of(url)
    opts = effective_options(url, storage_options)
    if proto in backends.names():
        cls = backends.get(proto, url=url)
        return cls(url, opts)  # type: ignore[no-any-return]
    hint = provider("quire.backends", proto)
    if hint:
        raise PluginError(
            f"no quire backend for {proto}:// URLs ({url}); install {hint} ({install_hint(hint)})"
        )
    import fsspec  # heavy: only the generic fallback needs it

    from quire._store.fsspec_generic import FsspecBackend

    if proto not in fsspec.available_protocols():
        raise PluginError(
            f"no quire backend and no fsspec file system for {proto}:// ({url}); "
            "install a package that provides one"
        )

    return FsspecBackend(url, opts)
