"""Upload helpers of :class:`quire.backends.ObjectStoreBackend`: multipart-style part
uploads held in the byte budget, and the retried conditional write a commit makes.

A mixin of :class:`~quire._store.object_backend.ObjectStoreBackend` (published through it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from quire._runtime.tasks import gather_all
from quire._store.base import PreconditionFailed
from quire._store.buffers import byte_slice

if TYPE_CHECKING:
    from quire._runtime.budget import ByteBudget

T = TypeVar("T")


class UploadHelpers:
    """Part uploads and conditional writes (see ``ObjectStoreBackend``)."""

    if TYPE_CHECKING:

        @property
        def budget(self) -> ByteBudget: ...

        async def get(
            self, key: str, start: int | None = None, end: int | None = None
        ) -> bytes: ...
        async def version(self, key: str) -> str | None: ...
        def where(self, key: str | None) -> str: ...
        async def run(self, op: str, key: str | None, attempt: Callable[[int], Awaitable[T]],
                      missing: str = "object", nbytes: int = 0) -> T: ...  # fmt: skip

    async def upload_parts(
        self,
        views: list[memoryview],
        total: int,
        part_size: int,
        send: Callable[[int, list[memoryview]], Awaitable[T]],
    ) -> list[T]:
        """Send ``views`` as concurrent parts of ``part_size`` bytes, each held in the
        budget while in flight: ``send(number, part_views)`` for numbers 1, 2, ...

        Parameters
        ----------
        views, total, part_size : list of memoryview, int, int
            The object's bytes in order, their total size, and bytes per part (the last
            may be shorter).
        send : callable
            ``await send(number, part_views)`` uploads one part (numbered from 1) and
            returns its receipt.

        Returns
        -------
        list
            What each ``send`` returned, in part order.  On the first failure the other
            parts are cancelled and that failure is raised.
        """
        budget = self.budget

        async def one(number: int, a: int, b: int) -> T:
            async with budget.hold(b - a):
                return await send(number, byte_slice(views, a, b))

        starts = range(0, total, part_size)
        return await gather_all(
            [one(i + 1, a, min(a + part_size, total)) for i, a in enumerate(starts)]
        )

    async def holds(self, key: str, data: bytes) -> str | None:
        """The version of ``key`` if it holds exactly ``data``, else None.

        Used after a conditional write lost: an earlier attempt of the same write (whose
        reply was lost) may have made it.  The default compares :meth:`get` with
        ``data`` and reads :meth:`version`; override it where one request gives both.

        Parameters
        ----------
        key, data : str, bytes
            The object key and the bytes the caller wrote.
        """
        try:
            got = await self.get(key)
        except FileNotFoundError:
            return None
        return await self.version(key) if got == data else None

    async def conditional_put(
        self,
        op: str,
        key: str,
        data: bytes,
        write: Callable[[bytes], Awaitable[str]],
        lost: Callable[[BaseException], bool],
        what: str,
        missing: str = "object",
    ) -> str:
        """A retried conditional write (the commit); the new version.

        Parameters
        ----------
        op, key : str
            The operation's name and the key written.
        data : bytes
            The object's bytes.
        write : callable
            ``write(data)`` makes one conditional request and returns the new version.
        lost : callable
            ``lost(e)``: whether ``e`` says the precondition failed.
        what : str
            The message of :class:`PreconditionFailed` after ``where(key)``
            (``"exists"``, ``"changed or vanished ..."``).

        Raises
        ------
        PreconditionFailed
            The precondition failed and ``key`` does not hold ``data``.
        """
        body = bytes(data)

        async def attempt(_n: int) -> str:
            try:
                return await write(body)
            except Exception as e:
                if not lost(e):
                    raise
            # An earlier attempt - ours, or one the HTTP client repeated on its own after
            # a lost reply - may have written it: then the key holds exactly our bytes.
            mine = await self.holds(key, body)
            if mine is not None:
                return mine
            raise PreconditionFailed(f"{self.where(key)} {what}")

        return await self.run(op, key, attempt, missing, nbytes=len(body))
