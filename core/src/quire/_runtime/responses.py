"""``AsyncResponse`` and ``chain``: background operations on quire's loop, in call order
per URL (split out of ``quire._api``, which re-exports them)."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from quire._runtime import exithook as _exit
from quire._runtime import ioloop as _io
from quire._runtime.tasks import settled

T = TypeVar("T")

_inflight_lock = threading.Lock()
_inflight: dict[str, concurrent.futures.Future[Any]] = {}


class AsyncResponse(Generic[T]):
    """The handle of a background save or load.

    ``result(timeout=None)`` waits and returns the value (or raises the error);
    ``done()`` says whether it finished.

    Parameters
    ----------
    future : concurrent.futures.Future
        The work's future (quire makes these; users receive them from ``*_async``).
    description : str
        What the work is, for messages (``"save s3://b/ckpt"``).
    """

    def __init__(self, future: concurrent.futures.Future[T], description: str = "") -> None:
        self._future = future
        self._description = description
        self._observed = False  # whether the caller asked for the outcome

    def result(self, timeout: float | None = None) -> T:
        """Wait for completion and return the operation's result.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait; None waits as long as it takes.

        Returns
        -------
        The operation's result (None for saves).

        Raises
        ------
        TimeoutError
            Not done within ``timeout`` (the operation goes on).
        Exception
            Whatever the operation raised, re-raised here.
        """
        self._observed = True
        return self._future.result(timeout)

    def done(self) -> bool:
        """Whether the operation has finished (successfully or not).

        Returns
        -------
        bool
        """
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The operation's error, or None if it succeeded (waits like :meth:`result`).

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait; None waits as long as it takes.

        Returns
        -------
        BaseException or None

        Raises
        ------
        TimeoutError
            Not done within ``timeout``.
        """
        self._observed = True
        return self._future.exception(timeout)

    def __del__(self) -> None:
        try:
            _exit.report_unobserved(self)
        except Exception:  # broad: a finalizer never raises (the report is a warning)
            pass

    def add_done_callback(self, fn: Any) -> None:
        """Call ``fn(response)`` once the operation finishes (at once if it has).

        Parameters
        ----------
        fn : callable
            Called with this :class:`AsyncResponse`, in quire's event-loop thread.
        """
        self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<AsyncResponse {self._description} {state}>"


def chain(u: str, make: Callable[[], Awaitable[T]], description: str) -> AsyncResponse[T]:
    """Run ``make()`` on quire's loop after the previous write-operation on ``u`` ends.

    Writes to one URL from one process thus apply in call order, one at a time.
    """
    with _inflight_lock:
        prev = _inflight.get(u)

        async def run() -> T:
            if prev is not None and not prev.done():
                await settled(prev)  # its error belongs to its own caller
            return await make()

        fut = _io.submit(run())
        _inflight[u] = fut

    def _done(f: concurrent.futures.Future[Any]) -> None:
        with _inflight_lock:
            if _inflight.get(u) is f:
                del _inflight[u]

    fut.add_done_callback(_done)
    resp = AsyncResponse(fut, description)
    _exit.track(resp)  # finished at interpreter exit even if never awaited
    return resp
