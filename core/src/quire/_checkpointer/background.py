"""Background work of one Checkpointer root: one task chain, errors kept until asked for.

:class:`BackgroundTasks` runs coroutines on quire's event loop for its owner (a
``quire._checkpointer.steproot.StepRoot``) and keeps what they raise until the owner calls
:meth:`~BackgroundTasks.raise_errors` (its next public call, ``wait`` or ``close``): a
background failure is never dropped.  See ``quire._checkpointer.checkpointer`` for the
threads and their order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from quire._runtime import exithook as _exit
from quire._runtime import ioloop as _io
from quire._runtime.tasks import settled

log = logging.getLogger("quire")


class BackgroundTasks:
    """Coroutines run in the background for one root, and the errors they raised.

    Three kinds: :meth:`spawn` (any task), :meth:`schedule` (a task of the chain: after
    every earlier chained one, never two at once) and :meth:`start_save` (the save in
    flight, which :meth:`wait_save` waits for).

    Parameters
    ----------
    label : str
        What the tasks work for (the root URL), for the message of a long wait.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self._lock = threading.RLock()  # done-callbacks may run in the thread that holds it
        self._save: concurrent.futures.Future[Any] | None = None
        self._tail: concurrent.futures.Future[Any] | None = None  # last chained task
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._errors: list[BaseException] = []

    @staticmethod
    def run(coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on quire's loop and wait for its result (not from the loop's thread)."""
        return _io.submit(coro).result()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Run ``coro`` in the background; its error is kept for :meth:`raise_errors`."""
        # run_coroutine_threadsafe works from any thread, quire's loop thread included.
        fut = asyncio.run_coroutine_threadsafe(coro, _io.loop())
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._collect)
        return fut

    def start_save(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Spawn ``coro`` as the save in flight: the next :meth:`wait_save` waits for it."""
        fut = self.spawn(coro)
        with self._lock:
            self._save = fut
        return fut

    def schedule(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """Run ``make()`` in the background after every earlier scheduled task."""
        with self._lock:
            prev = self._tail

            async def run() -> None:
                if prev is not None:
                    await settled(prev)  # its error is reported through its own future
                await make()

            self._tail = self.spawn(run())

    def _collect(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            if fut not in self._pending:
                return
            self._pending.discard(fut)
            if not fut.cancelled() and fut.exception() is not None:
                self._errors.append(fut.exception())  # type: ignore[arg-type]

    def raise_errors(self) -> None:
        """Raise the first kept error (the others added to it as notes), if any."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            first = errors[0]
            for e in errors[1:]:
                first.add_note(f"another background task failed too: {type(e).__name__}: {e}")
            raise first

    def wait_save(self) -> None:
        """Wait for the save in flight, then raise the kept errors."""
        fut = self._save
        if fut is not None:
            concurrent.futures.wait([fut])
            self._collect(fut)
        self.raise_errors()

    def drain(self) -> None:
        """Wait until no task is left (tasks may start others); errors stay kept."""
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
                    self.label,
                    len(late),
                )
                concurrent.futures.wait(pending)
            for f in pending:
                self._collect(f)
