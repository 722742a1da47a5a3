"""A byte budget bounding the host memory a save or load holds in flight."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator


class ByteBudget:
    """Async counting semaphore over bytes (public as :class:`quire.backends.ByteBudget`).

    A request larger than the whole budget is admitted alone (when nothing else is in
    flight), so one huge shard never deadlocks: the bound is ``limit`` plus one shard.
    Use it from one event loop.

    Parameters
    ----------
    limit : int
        Bytes that may be held at once (at least 1).

    Attributes
    ----------
    used, peak : int
        Bytes held now, and the most ever held at once.
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(1, int(limit))
        self.used = 0
        self.peak = 0
        # Waiters in arrival order: each release wakes only those that now fit, first
        # come first served (so a large request is never starved by small ones, and
        # thousands of waiters cost one wake-up each, not one per release).
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def _fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():  # cancelled while waiting
                self._waiters.popleft()
                continue
            if not self._fits(n):
                return
            self._waiters.popleft()
            self._take(n)
            fut.set_result(None)

    async def acquire(self, n: int) -> None:
        """Wait until ``n`` bytes fit, then hold them (pair with :meth:`release`).

        Parameters
        ----------
        n : int
            A number of bytes.
        """
        if not self._waiters and self._fits(n):
            self._take(n)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted, then cancelled: give it back
                self._give_back(n)
            else:
                self._wake()  # a later waiter may fit now that this one left the queue
            raise

    def _give_back(self, n: int) -> None:
        self.used -= n
        self._wake()

    async def release(self, n: int) -> None:
        """Give back ``n`` bytes held by :meth:`acquire`.

        Parameters
        ----------
        n : int
            A number of bytes.
        """
        self._give_back(n)

    @contextlib.asynccontextmanager
    async def hold(self, n: int) -> AsyncIterator[None]:
        """``async with budget.hold(n):`` holds ``n`` bytes for the block (none for n <= 0).

        Parameters
        ----------
        n : int
            A number of bytes.
        """
        if n <= 0:
            yield
            return
        await self.acquire(n)
        try:
            yield
        finally:
            await self.release(n)
