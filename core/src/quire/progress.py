"""Progress of save, load, verify, cp, gc and export: a bar, or a callback for loggers.

Library calls are silent unless asked: pass ``progress=True`` (a bar on stderr),
``progress=callback`` (called with a :class:`ProgressEvent`) or a :class:`Progress`, or set
it for a block or a process with ``quire.Context(progress=...)`` / ``quire.configure``.
The ``quire`` command shows a bar by default when stderr is a terminal.

Code that implements another operation (an export, a copy) reports through
:func:`reporting` and :func:`advance`::

    with quire.progress.reporting(progress, "export", url, bytes_total=total):
        for name, array in arrays:
            write(name, array)
            quire.progress.advance(array.nbytes)
"""

from __future__ import annotations

from quire._runtime.progress import Progress, ProgressEvent, advance, current, reporting

__all__ = ["Progress", "ProgressEvent", "advance", "current", "reporting"]
