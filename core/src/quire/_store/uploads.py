"""Uploads of :class:`quire.backends.ObjectStoreBackend`: multipart-style part uploads held in
the byte budget, and the retried conditional write a commit makes.

:class:`Uploads` is the backend's part that does them, given the budget, the backend's retried
request (``run``), its ``holds`` check and its messages' ``where``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from quire._runtime.budget import ByteBudget
from quire._runtime.tasks import gather_all
from quire._store.base import PreconditionFailed
from quire._store.buffers import byte_slice

T = TypeVar("T")


class Run(Protocol):
    """A request with retries: ``ObjectStoreBackend.run``."""

    def __call__(
        self,
        op: str,
        key: str | None,
        attempt: Callable[[int], Awaitable[T]],
        missing: str = "object",
        nbytes: int = 0,
    ) -> Awaitable[T]: ...


class Uploads:
    """Part uploads and conditional writes of one backend.

    Parameters
    ----------
    budget : callable
        ``budget()``: the byte budget uploads hold, on the running loop.
    run : Run
        The backend's request with retries.
    holds : callable
        ``await holds(key, data)``: the version of ``key`` if it holds exactly ``data``.
    where : callable
        ``where(key)``: ``scheme://bucket/object``, for messages.
    """

    def __init__(
        self,
        budget: Callable[[], ByteBudget],
        run: Run,
        holds: Callable[[str, bytes], Awaitable[str | None]],
        where: Callable[[str | None], str],
    ) -> None:
        self._budget = budget
        self._run = run
        self._holds = holds
        self._where = where

    async def parts(
        self,
        views: list[memoryview],
        total: int,
        part_size: int,
        send: Callable[[int, list[memoryview]], Awaitable[T]],
    ) -> list[T]:
        """``send(number, part_views)`` for parts 1, 2, ... of ``views``, concurrently, each
        held in the budget while in flight; the receipts in part order (the first failure
        cancels the others and is raised)."""
        budget = self._budget()

        async def one(number: int, a: int, b: int) -> T:
            async with budget.hold(b - a):
                return await send(number, byte_slice(views, a, b))

        starts = range(0, total, part_size)
        return await gather_all(
            [one(i + 1, a, min(a + part_size, total)) for i, a in enumerate(starts)]
        )

    async def conditional(
        self,
        op: str,
        key: str,
        data: bytes,
        write: Callable[[bytes], Awaitable[str]],
        lost: Callable[[BaseException], bool],
        what: str,
        missing: str = "object",
    ) -> str:
        """``write(data)`` with retries; a lost precondition is success when ``key`` holds
        exactly ``data`` (an earlier attempt wrote it), else :class:`PreconditionFailed`."""
        body = bytes(data)

        async def attempt(_n: int) -> str:
            try:
                return await write(body)
            except Exception as e:
                if not lost(e):
                    raise
            # An earlier attempt - ours, or one the HTTP client repeated on its own after
            # a lost reply - may have written it: then the key holds exactly our bytes.
            mine = await self._holds(key, body)
            if mine is not None:
                return mine
            raise PreconditionFailed(f"{self._where(key)} {what}")

        return await self._run(op, key, attempt, missing, nbytes=len(body))
