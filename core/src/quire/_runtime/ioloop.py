"""The background event loop and the blocking-I/O thread pool quire runs on."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def io_threads() -> int:
    """Threads for blocking file I/O, checksums and codecs (they release the GIL)."""
    return int(os.environ.get("QUIRE_IO_THREADS", "16"))


def pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                io_threads(), thread_name_prefix="quire-io"
            )
        return _pool


async def run_blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn`` in quire's I/O pool from a coroutine, in a copy of the coroutine's
    context (so the caller's ``quire.Context`` applies there too)."""
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    return await loop.run_in_executor(pool(), ctx.run, functools.partial(fn, *args, **kwargs))


def loop() -> asyncio.AbstractEventLoop:
    """quire's event loop, running forever in a daemon thread."""
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            new = asyncio.new_event_loop()
            ready = threading.Event()

            def _run() -> None:
                asyncio.set_event_loop(new)
                new.call_soon(ready.set)
                new.run_forever()

            global _thread
            _thread = threading.Thread(target=_run, name="quire-loop", daemon=True)
            _thread.start()
            ready.wait()
            _loop = new
        return _loop


_thread: threading.Thread | None = None


def shutdown(timeout: float = 30.0) -> None:
    """Stop quire's background work in order, for an interrupted exit: cancel the
    loop's tasks, stop the loop and join its thread, then let the I/O threads finish the
    call each is in (native code, never killed mid-call) and drop what is queued.  A
    daemon thread left inside native code while the interpreter finalizes can abort it."""
    lp, th = _loop, _thread
    if lp is not None and lp.is_running():

        async def cancel_all() -> None:
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), lp).result(timeout)
        except BaseException:  # best effort: we are exiting
            pass
        lp.call_soon_threadsafe(lp.stop)
        if th is not None:
            th.join(timeout)
    if _pool is not None:
        _pool.shutdown(wait=True, cancel_futures=True)


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Schedule ``coro`` on quire's loop; returns a thread-safe future.

    The coroutine runs in a copy of the caller's :mod:`contextvars` context (the callback
    ``run_coroutine_threadsafe`` schedules captures it, and the task copies it), so the
    ``quire.Context`` in effect at the call applies to the whole operation.
    """
    lp = loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is lp:
        coro.close()
        raise RuntimeError("quire's blocking API was called from quire's own event loop")
    return asyncio.run_coroutine_threadsafe(coro, lp)
