"""quire's one interpreter-exit hook: finish background writes, report unawaited errors.

A script that calls ``quire.save_async`` (or ``partial.save_async``, or a Checkpointer's
async save) and then simply ends must not lose the save: quire's event loop runs in a
daemon thread, which the interpreter would stop mid-write.  So one hook, registered with
``threading._register_atexit`` (it runs before the interpreter stops its threads, and
after the hook of ``concurrent.futures.thread`` that makes thread pools refuse new
work, because hooks run last-registered first), does, in order:

1. closes the objects registered open (each open Checkpointer waits for its own work),
2. waits for every write still in flight (naming what it waits for, so that a long
   wait — or a Ctrl-C during it — is never silent),
3. logs the error of every write whose result nobody asked for.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # its exit hook must be registered before ours
import logging
import threading
import time
import weakref
from typing import Any

log = logging.getLogger("quire")

_lock = threading.Lock()
_open: weakref.WeakSet[Any] = weakref.WeakSet()  # objects to close at exit (Checkpointers)
_writes: weakref.WeakSet[Any] = weakref.WeakSet()  # AsyncResponse of writes
_running: set[Any] = set()  # those still in flight, held strongly
WAIT_NOTICE_S = 1.0  # say what exit waits for once it has waited this long


def close_at_exit(obj: Any) -> None:
    """Call ``obj.close()`` at exit, before in-flight writes are waited for, unless
    :func:`closed` is called first (held weakly: a dropped object is not closed)."""
    with _lock:
        _open.add(obj)


def closed(obj: Any) -> None:
    """``obj`` was closed: exit need not close it."""
    with _lock:
        _open.discard(obj)


def track(response: Any) -> None:
    """Have exit wait for this write's ``AsyncResponse`` and log its unobserved error.

    The response is held strongly while the write runs (a caller that drops it must not
    cancel the save), then weakly: once nobody holds it, its error is logged."""
    with _lock:
        _writes.add(response)
        _running.add(response)
    ref = weakref.ref(response)

    def done(_f: Any) -> None:
        r = ref()
        if r is not None:
            with _lock:
                _running.discard(r)

    response._future.add_done_callback(done)


def report_unobserved(response: Any) -> None:
    """Log the error of a finished write nobody asked for (once)."""
    if getattr(response, "_observed", True) or not response._future.done():
        return
    response._observed = True
    err = None if response._future.cancelled() else response._future.exception()
    if err is not None:
        log.error(
            "quire: %s failed and nobody awaited its result: %s: %s",
            response._description or "a background write",
            type(err).__name__,
            err,
        )


def _at_exit() -> None:
    try:
        _finish()
    except KeyboardInterrupt:
        with _lock:
            n = sum(1 for w in _running if not w.done())
        log.warning(
            "quire: interrupted; abandoning %d unfinished background write(s) and stopping "
            "quire's threads (every committed checkpoint stays whole)",
            n,
        )
        from quire._runtime import ioloop as _io

        _io.shutdown()


def _finish() -> None:
    with _lock:
        still_open = list(_open)
    for obj in still_open:
        try:
            obj.close()
        except BaseException as e:  # keep going: the other writes must still finish
            log.error("quire: %r: background work failed at exit: %r", obj, e)
    with _lock:
        writes = list(_writes) + [w for w in _running if w not in _writes]
    pending = [w for w in writes if not w._future.done()]
    if pending:
        _, not_done = concurrent.futures.wait([w._future for w in pending], timeout=WAIT_NOTICE_S)
        if not_done:
            what = ", ".join(w._description or "a write" for w in pending if not w.done())
            log.warning(
                "quire: waiting at exit for %d unfinished background write(s) to commit "
                "(%s); interrupt again to abandon them (the previous checkpoint stays whole)",
                len(not_done),
                what,
            )
            t0 = time.monotonic()
            concurrent.futures.wait(not_done)
            log.info("quire: background writes finished after %.1f s", time.monotonic() - t0)
    for w in writes:
        report_unobserved(w)


_register = getattr(threading, "_register_atexit", None)
if _register is None:  # pragma: no cover - CPython always has it
    import atexit

    _register = atexit.register
_register(_at_exit)
