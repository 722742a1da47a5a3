"""The background event loop and the blocking-I/O thread pools quire runs on.

Blocking work (file I/O, checksums, codecs; they release the GIL) runs in ``QUIRE_IO_THREADS``
threads, except the work of an asynchronous save (``save_async``, ``Checkpointer.save``,
``partial.save_async``) after it has returned: that runs in a smaller pool of
``QUIRE_BACKGROUND_THREADS`` threads (default: half the CPU cores, at least one), at the
lowest CPU priority (``QUIRE_BACKGROUND_NICE``, default 19, or ``idle``, where the platform
has per-thread priorities), each using at most ``QUIRE_BACKGROUND_DUTY`` of a CPU (0.5 when
JAX computes on the CPU), so the training steps that run meanwhile keep the machine and the
write takes the CPU time they leave (:func:`in_background`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from quire._runtime.tasks import until_done

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_background_pool: concurrent.futures.ThreadPoolExecutor | None = None
_background: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "quire_background", default=False
)
# JAX's mesh in context (``jax.set_mesh``) of the thread that submitted the work: JAX keeps
# it per thread, so quire's loop would not see it otherwise.
_mesh: contextvars.ContextVar[Any] = contextvars.ContextVar("quire_jax_mesh", default=None)


def caller_mesh() -> Any:
    """The ``jax.sharding.Mesh`` in context where the current operation was called (set by
    ``with jax.set_mesh(mesh):``; carried over by :func:`submit`), or None."""
    got = _mesh.get()
    jax = sys.modules.get("jax")  # not imported yet: no mesh can be in context
    if got is None and jax is not None:
        got = jax.sharding.get_mesh()
    return None if got is None or got.empty else got


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


def background_threads() -> int:
    """Threads for the blocking work of asynchronous saves once they have returned."""
    default = max(1, (os.cpu_count() or 2) // 2)
    return max(1, int(os.environ.get("QUIRE_BACKGROUND_THREADS", str(default))))


def background_nice() -> int | str:
    """How much lower the background threads' CPU priority is: a ``nice`` increment (0-19),
    or ``"idle"`` (Linux's ``SCHED_IDLE``: they run only on a CPU nothing else wants)."""
    raw = os.environ.get("QUIRE_BACKGROUND_NICE", "19").strip().lower()
    if raw == "idle":
        return "idle"
    return min(19, max(0, int(raw)))


def _lower_priority() -> None:
    # Linux schedules threads as tasks: PRIO_PROCESS (or sched_setscheduler) with a thread
    # id sets that thread's priority alone.  Elsewhere (or without the permission) the thread
    # keeps its priority.
    nice = background_nice()
    if nice and sys.platform.startswith("linux"):
        try:
            tid = threading.get_native_id()
            if nice == "idle":
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            else:
                assert isinstance(nice, int)
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
        except OSError:
            pass


def background_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _background_pool
    with _lock:
        if _background_pool is None:
            _background_pool = concurrent.futures.ThreadPoolExecutor(
                background_threads(), thread_name_prefix="quire-bg", initializer=_lower_priority
            )
        return _background_pool


async def in_background(aw: Awaitable[T]) -> T:
    """Await ``aw`` with its blocking work (:func:`run_blocking`, in it and in the tasks it
    starts) in the background pool: the write of an asynchronous save, which the caller's
    training steps run beside."""
    token = _background.set(True)
    try:
        return await aw
    finally:
        _background.reset(token)


async def run_blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn`` in quire's I/O pool (the background pool inside :func:`in_background`) from
    a coroutine, in a copy of the coroutine's context (so the caller's ``quire.Context``
    applies there too)."""
    return await asyncio.wrap_future(_submit(functools.partial(fn, *args, **kwargs)))


def _submit(call: Callable[[], T]) -> concurrent.futures.Future[T]:
    """``call`` submitted to the pool its caller's work runs in (see :func:`run_blocking`)."""
    ctx = contextvars.copy_context()
    if not _background.get():
        return pool().submit(ctx.run, call)
    duty = background_duty()
    if duty < 1.0:
        call = functools.partial(_paced, call, 1.0 / duty - 1.0)
    return background_pool().submit(ctx.run, call)


async def run_to_end(
    fn: Callable[..., T], *args: Any, discard: Callable[[T], object] | None = None
) -> T:
    """:func:`run_blocking` for a short call on local resources (a file descriptor, the
    caller's buffers) whose effects must not outlive the operation that made it.

    A thread cannot be stopped once it runs the call.  With :func:`run_blocking` a
    cancellation (a sibling read failed, the load raised) returns at once while the call
    goes on: a failed load could raise with a read still holding a descriptor and writing
    into its buffers.  Here a call not yet started is cancelled, and one already running
    is waited for before the cancellation propagates; ``discard(result)`` then undoes what
    its result holds (closes a descriptor it opened).  Not for calls that may wait long
    (network, other processes): their cancellation would wait as long."""
    fut = _submit(functools.partial(fn, *args))
    waited = asyncio.wrap_future(fut)
    try:
        return await asyncio.shield(waited)
    except asyncio.CancelledError:
        if not fut.cancel():  # running or done: wait for its end, whatever comes meanwhile
            await until_done(waited)
            if discard is not None and not waited.cancelled() and waited.exception() is None:
                discard(waited.result())
        raise


@functools.cache
def background_duty() -> float:
    """The share of one CPU each background thread may use (``QUIRE_BACKGROUND_DUTY``,
    0 < duty <= 1): after a call that used ``t`` seconds of CPU it rests ``t (1/duty - 1)``.

    ``auto`` (the default): 0.5 when JAX computes on the CPU, where the training steps and
    the write share the same cores and caches, else 1 (the steps run on an accelerator)."""
    raw = os.environ.get("QUIRE_BACKGROUND_DUTY", "auto").strip().lower()
    if raw == "auto":
        import jax

        return 0.5 if jax.default_backend() == "cpu" else 1.0
    return min(1.0, max(0.01, float(raw)))


def _paced(call: Callable[[], T], rest: float) -> T:
    t0 = time.thread_time()  # this thread's user + system time: the write's own work
    try:
        return call()
    finally:
        time.sleep((time.thread_time() - t0) * rest)


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
        except BaseException:  # broad: best effort while the interpreter exits
            pass
        lp.call_soon_threadsafe(lp.stop)
        if th is not None:
            th.join(timeout)
    for ex in (_pool, _background_pool):
        if ex is not None:
            ex.shutdown(wait=True, cancel_futures=True)


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Schedule ``coro`` on quire's loop; returns a thread-safe future.

    The coroutine runs in a copy of the caller's :mod:`contextvars` context (the callback
    ``run_coroutine_threadsafe`` schedules captures it, and the task copies it), so the
    ``quire.Context`` in effect at the call applies to the whole operation; so does JAX's
    mesh in context (:func:`caller_mesh`), which JAX keeps per thread.
    """
    lp = loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is lp:
        coro.close()
        raise RuntimeError("quire's blocking API was called from quire's own event loop")
    if _background.get():
        # A background thread that blocks on a coroutine (a checkpointable handler's
        # UnitIO) must not have that coroutine's blocking work queue behind it in the
        # small background pool, which it may be filling: that work runs in the I/O pool.
        coro = _in_foreground(coro)
    token = _mesh.set(caller_mesh())
    try:
        return asyncio.run_coroutine_threadsafe(coro, lp)
    finally:
        _mesh.reset(token)


async def _in_foreground(aw: Awaitable[T]) -> T:
    token = _background.set(False)
    try:
        return await aw
    finally:
        _background.reset(token)
