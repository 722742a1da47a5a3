"""Progress reporting for save, load, verify, cp, gc and export.

One :class:`Progress` object per operation counts bytes and objects (chunks) as the
operation's call sites report them, draws a tqdm bar when asked, and calls a user callback
(a training logger) with a :class:`ProgressEvent`.  The operation's reporter lives in a
:mod:`contextvars` variable, so the low-level code that writes or reads a chunk reports with
one call, :func:`advance`, without a reporter being passed down; quire's background work
runs in a copy of the caller's context (see ``_config``), which carries the reporter along.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from quire._runtime.config import current as config

__all__ = ["Progress", "ProgressEvent", "ProgressSpec", "advance", "reporting"]


@dataclasses.dataclass(frozen=True)
class ProgressEvent:
    """A snapshot of one operation's progress, as passed to a progress callback.

    Attributes
    ----------
    operation : str
        ``"save"``, ``"load"``, ``"verify"``, ``"cp"``, ``"gc"`` or ``"export"``.
    url : str
        The checkpoint (or prefix) the operation works on.
    bytes_done, objects_done : int
        Bytes (array data, before compression) and objects (chunks) done so far.
    bytes_total, objects_total : int or None
        The expected totals, when known in advance.
    elapsed : float
        Seconds since the operation started.
    finished : bool
        True for the last event of the operation (sent once, also after an error).
    """

    operation: str
    url: str
    bytes_done: int
    bytes_total: int | None
    objects_done: int
    objects_total: int | None
    elapsed: float
    finished: bool = False

    @property
    def rate(self) -> float:
        """Bytes per second so far."""
        return self.bytes_done / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta(self) -> float | None:
        """Seconds left at the current rate; None when the total or the rate is unknown."""
        if self.bytes_total is None or self.rate <= 0:
            return None
        return max(0.0, (self.bytes_total - self.bytes_done) / self.rate)


ProgressCallback = Callable[[ProgressEvent], None]
#: What ``progress=`` accepts: False/None (nothing; None means the configured default),
#: True (a bar on stderr), a callable taking a :class:`ProgressEvent`, or a :class:`Progress`.
ProgressSpec = Any


class Progress:
    """Counts one operation's bytes and objects; draws a bar and/or calls a callback.

    Parameters
    ----------
    operation : str
        What is running (shown as the bar's label).
    url : str
        What it runs on.
    bar : bool or file, optional
        Draw a tqdm progress bar (bytes, objects, rate, ETA) on this stream (True: stderr).
    callback : callable, optional
        Called with a :class:`ProgressEvent` at most every ``interval`` seconds, and once
        with ``finished=True`` at the end.
    bytes_total, objects_total : int, optional
        Expected totals (they can be raised later with :meth:`add_total`).
    objects_name : str
        What the objects are, on the bar (``"chunks"`` for verify and cp; default
        ``"objects"``).
    interval : float
        Minimum seconds between two callback calls (default 0.5).

    Examples
    --------
    >>> seen = []
    >>> with Progress("save", "memory://x", callback=seen.append) as p:
    ...     p.advance(1024, objects=1)
    >>> seen[-1].bytes_done, seen[-1].finished
    (1024, True)
    """

    def __init__(
        self,
        operation: str,
        url: str = "",
        *,
        bar: bool | TextIO = False,
        callback: ProgressCallback | None = None,
        bytes_total: int | None = None,
        objects_total: int | None = None,
        interval: float = 0.5,
        objects_name: str = "objects",
    ) -> None:
        self.operation = operation
        self.url = url
        self.callback = callback
        self.bytes_done = 0
        self.objects_done = 0
        self.bytes_total = bytes_total
        self.objects_total = objects_total
        self.interval = interval
        self.objects_name = objects_name
        self._t0 = time.monotonic()
        self._last_cb = 0.0
        self._lock = threading.Lock()
        self._closed = False
        self._bar: Any = None
        if bar:
            from tqdm import tqdm

            stream = sys.stderr if bar is True else bar
            try:  # a terminal that reports no size (a fresh pty) gets 80x24
                cols, rows = os.get_terminal_size(stream.fileno())
            except (OSError, ValueError, AttributeError):
                cols, rows = 0, 0
            self._bar = tqdm(
                total=bytes_total,
                desc=f"{operation}",
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=stream,
                mininterval=0.1,
                ncols=cols if cols >= 40 else 80,
                nrows=rows if rows >= 2 else 24,
                leave=True,
            )
            self._update_postfix()

    # -- feeding -------------------------------------------------------------------
    def add_total(self, nbytes: int = 0, objects: int = 0) -> None:
        """Raise the expected totals (for work discovered as the operation runs).

        Parameters
        ----------
        nbytes : int
            Bytes to add to the byte total.
        objects : int
            Objects to add to the object total (0: unchanged).
        """
        with self._lock:
            self.bytes_total = (self.bytes_total or 0) + nbytes
            if objects:
                self.objects_total = (self.objects_total or 0) + objects
            if self._bar is not None:
                self._bar.total = self.bytes_total
                self._bar.refresh()

    def set_total(self, nbytes: int | None = None, objects: int | None = None) -> None:
        """Set the expected totals (when a better estimate is known).

        Parameters
        ----------
        nbytes : int, optional
            The byte total (None: unchanged).
        objects : int, optional
            The object total (None: unchanged).
        """
        with self._lock:
            if nbytes is not None:
                self.bytes_total = nbytes
                if self._bar is not None:
                    self._bar.total = nbytes
            if objects is not None:
                self.objects_total = objects

    def advance(self, nbytes: int = 0, objects: int = 1) -> None:
        """Count ``nbytes`` bytes and ``objects`` objects as done.

        Parameters
        ----------
        nbytes : int
            Bytes done.
        objects : int
            Objects done.
        """
        with self._lock:
            if self._closed:
                return
            self.bytes_done += nbytes
            self.objects_done += objects
            if self._bar is not None:
                self._update_postfix(refresh=False)
                self._bar.update(nbytes)
            now = time.monotonic()
            call = self.callback is not None and now - self._last_cb >= self.interval
            if call:
                self._last_cb = now
        if call:
            assert self.callback is not None
            self.callback(self.event())

    def _update_postfix(self, refresh: bool = True) -> None:
        tot = "" if self.objects_total is None else f"/{self.objects_total}"
        self._bar.set_postfix_str(f"{self.objects_done}{tot} {self.objects_name}", refresh=refresh)

    def event(self, finished: bool = False) -> ProgressEvent:
        """The current state as a :class:`ProgressEvent`.

        Parameters
        ----------
        finished : bool
            Mark the event as the operation's last.

        Returns
        -------
        ProgressEvent
        """
        return ProgressEvent(
            self.operation,
            self.url,
            self.bytes_done,
            self.bytes_total,
            self.objects_done,
            self.objects_total,
            time.monotonic() - self._t0,
            finished,
        )

    def close(self) -> None:
        """End the display and send the final event (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._bar is not None:
                self._update_postfix(refresh=False)
                self._bar.close()
        if self.callback is not None:
            self.callback(self.event(finished=True))

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<Progress {self.operation} {self.url}: {self.bytes_done} bytes, "
            f"{self.objects_done} objects>"
        )


_current: contextvars.ContextVar[Progress | None] = contextvars.ContextVar(
    "quire_progress", default=None
)


def advance(nbytes: int = 0, objects: int = 1) -> None:
    """Report work done to the running operation's reporter (no-op when there is none).

    Parameters
    ----------
    nbytes, objects : int
        As for :meth:`Progress.advance`.
    """
    p = _current.get()
    if p is not None:
        p.advance(nbytes, objects)


def current() -> Progress | None:
    """The reporter of the operation running in this context, if any."""
    return _current.get()


def make(
    spec: ProgressSpec,
    operation: str,
    url: str,
    *,
    bytes_total: int | None = None,
    objects_total: int | None = None,
    objects_name: str = "objects",
) -> Progress | None:
    """The reporter ``progress=spec`` asks for (None: the configured default), or None."""
    if spec is None:
        spec = config().progress
    if spec is None or spec is False:
        return None
    if isinstance(spec, Progress):
        if bytes_total:
            spec.add_total(bytes_total, objects_total or 0)
        return spec
    if spec is True:
        return Progress(operation, url, bar=True, bytes_total=bytes_total,
                        objects_total=objects_total, objects_name=objects_name)  # fmt: skip
    if callable(spec):
        return Progress(operation, url, callback=spec, bytes_total=bytes_total,
                        objects_total=objects_total, objects_name=objects_name)  # fmt: skip
    raise TypeError(
        f"progress= takes True, False, a callable taking a quire.progress.ProgressEvent or a "
        f"quire.progress.Progress; got {spec!r}"
    )


@contextlib.contextmanager
def reporting(
    spec: ProgressSpec,
    operation: str,
    url: str,
    *,
    bytes_total: int | None = None,
    objects_total: int | None = None,
    objects_name: str = "objects",
) -> Iterator[Progress | None]:
    """Run a block with the reporter ``spec`` asks for in effect; close it at the end.

    For an operation other code runs (e.g. an export)::

        with quire.progress.reporting(progress, "export", url, bytes_total=n) as p:
            ...  # quire.progress.advance(nbytes) per object written

    Parameters
    ----------
    spec : bool, callable or Progress
        What the caller's ``progress=`` argument was (as for :func:`quire.save`).
    operation : str
        The operation's name, shown on the bar and in events (``"export"``).
    url : str
        The URL the operation works on.
    bytes_total, objects_total : int, optional
        The expected totals, if known.

    Yields
    ------
    Progress or None
        The reporter in effect (None when progress is off).
    """
    p = make(spec, operation, url, bytes_total=bytes_total, objects_total=objects_total,
             objects_name=objects_name)  # fmt: skip
    token = _current.set(p)
    try:
        yield p
        if p is not None and p is not spec:
            # Totals given up front are estimates (array bytes, chunk counts); what was
            # actually read or written (encoded, with metadata objects) is the real total.
            p.set_total(p.bytes_done, p.objects_done)
    finally:
        _current.reset(token)
        if p is not None and p is not spec:
            p.close()


async def tracked(p: Progress | None, make_coro: Callable[[], Any], close: bool = True) -> Any:
    """Await ``make_coro()`` with ``p`` as the reporter of the tasks it starts."""
    token = _current.set(p)
    try:
        return await make_coro()
    finally:
        _current.reset(token)
        if p is not None and close:
            p.close()
