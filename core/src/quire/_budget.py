"""A byte budget bounding the host memory a save or load holds in flight."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class ByteBudget:
    """Async counting semaphore over bytes.

    A request larger than the whole budget is admitted alone (when nothing else is in
    flight), so one huge shard never deadlocks: the bound is ``limit`` plus one shard.
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(1, int(limit))
        self.used = 0
        self.peak = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n
            self.peak = max(self.peak, self.used)

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def hold(self, n: int) -> AsyncIterator[None]:
        if n <= 0:
            yield
            return
        await self.acquire(n)
        try:
            yield
        finally:
            await self.release(n)
