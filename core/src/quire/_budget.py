"""A byte budget bounding the host memory a save or load holds in flight."""

from __future__ import annotations

import asyncio
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
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        """Wait until ``n`` bytes fit, then hold them (pair with :meth:`release`).

        Parameters
        ----------
        n : int
            A number of bytes.
        """
        async with self._cond:
            await self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n
            self.peak = max(self.peak, self.used)

    async def release(self, n: int) -> None:
        """Give back ``n`` bytes held by :meth:`acquire`.

        Parameters
        ----------
        n : int
            A number of bytes.
        """
        async with self._cond:
            self.used -= n
            self._cond.notify_all()

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
