"""Background work of ``quire.Checkpointer``: one task chain, errors kept until the next call.

Split out of ``quire._checkpointer.checkpointer`` (see there for threads and ordering); the methods
here are mixed into ``Checkpointer``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from quire._runtime import exithook as _exit
from quire._runtime import ioloop as _io
from quire._runtime.tasks import settled

log = logging.getLogger("quire")


class _BackgroundTasks:
    """Running coroutines on quire's loop for a Checkpointer, and collecting their errors."""

    if TYPE_CHECKING:
        root: str
        _lock: threading.RLock
        _save_fut: concurrent.futures.Future[Any] | None
        _tail: concurrent.futures.Future[Any] | None
        _pending: set[concurrent.futures.Future[Any]]
        _errors: list[BaseException]

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return _io.submit(coro).result()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        # run_coroutine_threadsafe works from any thread, quire's loop thread included.
        fut = asyncio.run_coroutine_threadsafe(coro, _io.loop())
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._collect)
        return fut

    def _collect(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            if fut not in self._pending:
                return
            self._pending.discard(fut)
            if not fut.cancelled() and fut.exception() is not None:
                self._errors.append(fut.exception())  # type: ignore[arg-type]

    def _raise_background(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            first = errors[0]
            for e in errors[1:]:
                first.add_note(f"another background task failed too: {type(e).__name__}: {e}")
            raise first

    def _schedule(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """Run ``make()`` in the background after every earlier background task."""
        with self._lock:
            prev = self._tail

            async def run() -> None:
                if prev is not None:
                    await settled(prev)  # its error is reported through its own future
                await make()

            self._tail = self._spawn(run())

    def _wait_save(self) -> None:
        fut = self._save_fut
        if fut is not None:
            concurrent.futures.wait([fut])
            self._collect(fut)
        self._raise_background()

    def _drain(self) -> None:
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return
            _, late = concurrent.futures.wait(pending, timeout=_exit.WAIT_NOTICE_S)
            if late:  # say what we wait for (a Ctrl-C'd loop otherwise waits in silence)
                log.warning(
                    "quire.Checkpointer(%r): waiting for %d background save(s)/deletion(s) "
                    "to finish; interrupt again to abandon them (committed steps stay whole)",
                    self.root,
                    len(late),
                )
                concurrent.futures.wait(pending)
            for f in pending:
                self._collect(f)
