"""``quire.open`` / ``quire.sources.available``: which installed source recognises a URL, and
opening it (with the hints a "nothing here" error gives)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from quire._format.root import root_hint
from quire._runtime import ioloop as _io
from quire._runtime.install import install_hint
from quire._runtime.registry import sources
from quire._sources.base import Source
from quire._store.url import effective_options, normalize, open_backend
from quire.errors import CheckpointNotFoundError, PluginError, QuireError


def available() -> list[str]:
    """Format ids of the installed sources (``quire`` first)."""

    names = sources.names()
    return sorted(names, key=lambda n: (n != "quire", n))


def open(
    url: str | os.PathLike[str], *, format: str | None = None, **storage_options: Any
) -> Source:
    """Open ``url`` read-only as a lazy tree, in whichever installed format recognises it.

    Parameters
    ----------
    url : str or path
        A quire checkpoint, a ``.safetensors`` file, an HF model directory, an Orbax
        checkpoint (with quire-orbax installed)... on any fsspec URL.
    format : str, optional
        Skip detection and use this source (a ``quire.sources`` entry-point name).
    **storage_options
        fsspec options for the URL's backend.

    Raises
    ------
    CheckpointNotFoundError
        No installed source recognises ``url``; the message lists the installed formats
        and which package to install for others.
    PluginError
        ``format`` names a source that is not installed or fails to import.
    """

    u = normalize(url)
    # Sources see the options a backend for ``u`` would: the Context's for the protocol too.
    storage_options = effective_options(u, storage_options)
    if format is not None:
        cls = sources.get(format, url=u)
        return _open_with(cls, u, storage_options)
    problems: list[str] = []
    for name in available():
        try:
            cls = sources.get(name)
        except PluginError as e:
            problems.append(f"{name}: {e}")
            continue
        try:
            found = cls.detect(u, dict(storage_options))
        except QuireError:
            raise
        except Exception as e:
            problems.append(f"{name}: detect failed: {type(e).__name__}: {e}")
            continue
        if found:
            return _open_with(cls, u, storage_options)
    have = ", ".join(available()) or "none"
    extra = "; ".join(problems)
    raise CheckpointNotFoundError(
        f"{u}: no installed quire source recognises it (installed formats: {have})"
        + (f"; problems: {extra}" if extra else "")
        + ("." + hint if (hint := _root_hint(u, storage_options)) else "")
        + ". Check the URL"
        + ("" if "orbax" in available() else f"; for Orbax checkpoints {_orbax_hint()}")
        + "; pass format=... to name a format"
    )


def recognised(url: str | os.PathLike[str], **storage_options: Any) -> str | None:
    """The format id of the first installed source (in :func:`open`'s order) that
    recognises ``url``, or None: what :func:`open` would open, without opening it."""
    u = normalize(url)
    storage_options = effective_options(u, storage_options)
    for name in available():
        try:
            cls = sources.get(name)
        except PluginError:
            continue  # a broken plugin: `quire plugins` and quire.open's error name it
        try:
            if cls.detect(u, dict(storage_options)):
                return name
        except QuireError:
            raise
        except Exception:  # broad: as in open(), a detect that fails says "not mine"
            continue
    return None


def _root_hint(url: str, storage_options: dict[str, Any]) -> str:
    """What ``url`` is instead of a checkpoint (a Checkpointer root naming its steps, a
    folder of checkpoints), as ``quire.load`` says; "" when nothing is known."""

    try:
        return _io.submit(root_hint(open_backend(url, dict(storage_options)))).result()
    except Exception:  # broad: only for the message
        return ""


def _orbax_hint() -> str:
    return install_hint("quire-orbax")


def _open_with(cls: Any, url: str, storage_options: dict[str, Any]) -> Source:
    src = cls.open(url, dict(storage_options))
    if not isinstance(src, Source):
        raise PluginError(f"quire.sources plugin {cls!r} returned {src!r}, not a Source")
    return src


@contextlib.contextmanager
def opened(src: Source | str | os.PathLike[str], storage_options: Any = None) -> Iterator[Source]:
    """``src`` itself when it is an open :class:`Source` (left open: the caller owns it), else
    the source at that URL, opened here and closed on exit."""
    if isinstance(src, Source):
        yield src
        return
    with open(src, **(storage_options or {})) as source:
        yield source
