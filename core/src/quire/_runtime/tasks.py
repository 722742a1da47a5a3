"""Bounded, cancelling fan-out of async work.

``asyncio.gather(*(f(x) for x in items))`` creates every task up front (a record claiming
millions of chunks makes millions of tasks) and lets the others run on after one fails
(a failed load kept reading chunk files for seconds after it raised).  :func:`for_each`
runs at most ``limit`` workers that pull items from an iterator, and cancels the others
when one fails; :func:`gather_cancelling` is ``gather`` that cancels its siblings on the
first error, :func:`gather_all` the same for a sequence of coroutines (public through
``quire.backends``).  :func:`settled` waits for another operation to end without taking on its
outcome; :func:`until_done` lets a cancelled caller wait until work it started has stopped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


async def for_each(items: Iterable[T], fn: Callable[[T], Awaitable[Any]], limit: int) -> None:
    """Await ``fn(item)`` for every item, at most ``limit`` at once; the first error
    cancels the work in flight and is raised once it has stopped."""
    it = iter(items)
    first = list(itertools.islice(it, max(1, limit)))
    if len(first) < max(1, limit):  # the usual case: few items, one task each
        await gather_cancelling(*(fn(x) for x in first))
        return
    it = itertools.chain(first, it)

    async def worker() -> None:
        for item in it:  # one shared iterator: each item goes to one worker
            await fn(item)

    await gather_cancelling(*(worker() for _ in range(max(1, limit))))


async def gather_cancelling(*aws: Awaitable[T]) -> list[T]:
    """Like ``asyncio.gather``, but the first error cancels the other awaitables and is
    raised (not wrapped) once they have stopped."""
    if len(aws) == 1:  # no siblings to cancel: no task either
        return [await aws[0]]
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def gather_all(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coros`` concurrently; on the first failure cancel the rest and raise it.

    Parameters
    ----------
    coros : sequence of coroutine
        The work to run.
    """
    tasks: list[asyncio.Task[T]] = []
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(c) for c in coros]
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None
    return [t.result() for t in tasks]


async def settled(fut: concurrent.futures.Future[Any]) -> None:
    """Wait until ``fut`` (another operation, run before this one) has ended, whatever its
    outcome: its error belongs to its own caller, who reads it from ``fut``.

    Unlike ``try: await asyncio.wrap_future(fut) except BaseException: pass``, a
    cancellation of the waiter propagates (it does not go on as if ``fut`` had ended) and
    leaves ``fut`` running.
    """
    waited = asyncio.wrap_future(fut)
    await asyncio.wait([waited])
    if not waited.cancelled():
        waited.exception()  # read here too: asyncio would log it as never retrieved


async def until_done(fut: asyncio.Future[Any]) -> None:
    """Wait until ``fut`` has ended, whatever its outcome, through any further cancellation
    of the waiter: for a cancelled caller whose work must stop before it may return (a
    read still filling its buffers or holding a descriptor).  Its result or error is left
    to whoever reads ``fut``."""
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            continue
    if not fut.cancelled():
        fut.exception()  # read here too: asyncio would log it as never retrieved
