"""Sources: open any checkpoint read-only as a lazy tree (``quire.open``).

A source format is a :class:`Source` subclass registered under the ``quire.sources``
entry-point group, the name being its format id::

    [project.entry-points."quire.sources"]
    orbax = "quire_orbax:OrbaxSource"

``quire.open(url)`` asks each installed source's :meth:`Source.detect` (``quire`` first, then
the others by name) and opens the URL with the first that recognises it.  ``.tree`` holds
the saved structure (dicts, lists, tuples) with a :class:`LazyArray` per array leaf and plain
values for inline leaves (scalars, strings, None); nothing is read until a LazyArray (or a
slice of one) is read, by :meth:`LazyArray.read`, :func:`quire.load` with a ``transform``, or
:func:`quire.export`.

Call order (the contract a plugin implements)::

    cls.detect(url, storage_options)    # cheap, may read one small object; never raises
                                        # for "not mine" (return False)
    src = cls.open(url, storage_options)  # reads headers / metadata, builds .tree
    await lazy.reader.read_region(region)*  # any number, concurrently, on quire's loop
    src.close()                         # optional

``detect`` and ``open`` are called from an ordinary thread, never from quire's event loop,
and may block.
"""

from __future__ import annotations

import abc
import os
from typing import Any, ClassVar

from quire._lazy import LazyArray, LazyValue, Region, RegionReader
from quire.errors import CheckpointNotFoundError, PluginError, QuireError

__all__ = [
    "LazyArray",
    "LazyValue",
    "Region",
    "RegionReader",
    "Source",
    "available",
    "open",
]


class Source(abc.ABC):
    """A checkpoint opened read-only as a lazy tree.

    Attributes
    ----------
    format : str (class attribute)
        The format id (the entry-point name), e.g. ``"safetensors"``.
    url : str
        What was opened.
    tree : pytree
        Nested dicts / lists / tuples; array leaves are :class:`LazyArray`, inline leaves
        plain values.
    metadata : dict
        Format-specific metadata (JSON-like), e.g. safetensors' ``__metadata__``.
    """

    format: ClassVar[str]
    url: str
    tree: Any
    metadata: dict[str, Any]

    @classmethod
    @abc.abstractmethod
    def detect(cls, url: str, storage_options: dict[str, Any]) -> bool:
        """Whether ``url`` is in this format (cheap; may read one small object).

        Parameters
        ----------
        url : str
            A normalised URL (a local path or any fsspec URL).
        storage_options : dict
            fsspec options for the backend.

        Returns
        -------
        bool
        """

    @classmethod
    @abc.abstractmethod
    def open(cls, url: str, storage_options: dict[str, Any]) -> Source:
        """Open ``url`` (reads headers / metadata only).

        Parameters
        ----------
        url : str
            A URL that :meth:`detect` accepted.
        storage_options : dict
            fsspec options for the backend.

        Returns
        -------
        Source
            With :attr:`tree` of :class:`LazyArray` leaves and :attr:`metadata`.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release clients or files (optional)."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def leaves(self) -> list[tuple[str, Any]]:
        """``("/"-joined key path, leaf)`` for every leaf of :attr:`tree`, in tree order."""
        from quire._format.tree import keystr, walk

        root = walk(self.tree, _is_source_leaf, what=f"source {self.url}")
        return [(keystr(n.path), n.value) for n in root.leaves()]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.format} {self.url}>"


def _is_source_leaf(x: Any) -> bool:
    return isinstance(x, LazyValue) or not isinstance(x, dict | list | tuple)


def available() -> list[str]:
    """Format ids of the installed sources (``quire`` first)."""
    from quire._runtime.registry import sources

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
    from quire._runtime.registry import sources
    from quire._store.url import effective_options, normalize

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


def _root_hint(url: str, storage_options: dict[str, Any]) -> str:
    """What ``url`` is instead of a checkpoint (a Checkpointer root naming its steps, a
    folder of checkpoints), as ``quire.load`` says; "" when nothing is known."""
    from quire._format.root import root_hint
    from quire._runtime import ioloop as _io
    from quire._store.url import open_backend

    try:
        return _io.submit(root_hint(open_backend(url, dict(storage_options)))).result()
    except Exception:  # only for the message
        return ""


def _orbax_hint() -> str:
    from quire._runtime.install import install_hint

    return install_hint("quire-orbax")


def _open_with(cls: Any, url: str, storage_options: dict[str, Any]) -> Source:
    src = cls.open(url, dict(storage_options))
    if not isinstance(src, Source):
        raise PluginError(f"quire.sources plugin {cls!r} returned {src!r}, not a Source")
    return src
