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

# LazyValue.read (quire._sources.lazy) reads through the materializer this module installs:
# whoever gets a LazyArray got it through this face (quire.open) or quire.load.
from quire._sources import materialize as _materialize  # noqa: F401
from quire._sources.base import Source
from quire._sources.lazy import LazyArray, LazyValue, Region, RegionReader
from quire._sources.opening import available, open

__all__ = [
    "LazyArray",
    "LazyValue",
    "Region",
    "RegionReader",
    "Source",
    "available",
    "open",
]
