"""How an object-store backend's requests run: its clients and each attempt's deadline.

* :class:`ClientCache`: one client (file system, connection pool) per option set on quire's
  event loop, closed at exit; a private one on any other loop; each with its request slots;
* :class:`BackendClient`: the part of an ``ObjectStoreBackend`` that holds its client,
  request slots and upload budget on the event loop it runs on;
* :func:`bounded`: one attempt of a request, in a slot and under its deadline (a request
  made inside another's attempt shares that one's slot); :class:`AttemptTimeout` when it
  does not end in time.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from quire._runtime import ioloop as _io
from quire._runtime.budget import ByteBudget

T = TypeVar("T")


class AttemptTimeout(TimeoutError):
    """One attempt of a request did not end within its deadline (it was abandoned).

    Parameters
    ----------
    limit : float
        The attempt's deadline, in seconds.
    """

    def __init__(self, limit: float) -> None:
        super().__init__(f"no complete reply within {limit:.1f}s (request_timeout)")
        self.limit = limit


# Set inside an attempt of ObjectStoreBackend.run (a nested request takes no slot).
_in_attempt: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "quire_in_attempt", default=False
)


async def bounded(
    attempt: Callable[[int], Awaitable[T]], n: int, limit: float, slots: asyncio.Semaphore
) -> T:
    """``await attempt(n)`` in one of ``slots`` and within ``limit`` seconds.

    The slot is taken before the deadline starts (waiting behind other requests for a
    pooled connection is not a slow server).  A request made inside another's attempt (the
    read-back of a conditional write) runs in that one's slot, under both deadlines.

    Raises
    ------
    AttemptTimeout
        The attempt did not end in time (or the client's own timeout fired).
    """
    if _in_attempt.get():
        return await _timed(attempt, n, limit)
    async with slots:
        return await _timed(attempt, n, limit)


async def _timed(attempt: Callable[[int], Awaitable[T]], n: int, limit: float) -> T:
    token = _in_attempt.set(True)
    try:
        async with asyncio.timeout(limit):
            return await attempt(n)
    except TimeoutError as e:
        # Ours, or the client's own timeout: both mean "no answer in time".
        raise AttemptTimeout(limit) from e
    finally:
        _in_attempt.reset(token)


class ClientCache:
    """Clients by option set: shared on quire's event loop, private elsewhere.

    Every save and load runs on quire's loop; building a client costs ~0.2 s and a pool of
    warm connections is what makes many small requests fast, so one client per distinct
    option set (``token``) lives there for the process, closed at exit.  Changes to the
    environment or to fsspec's config after the first use of an option set are not seen
    by its client.  On any other loop each backend gets its own, closed by ``close()``.

    Each client comes with a semaphore of request slots, shared by every backend using
    it: a request waits for a slot *before* its deadline starts, so waiting behind other
    requests for one of the client's pooled connections never counts as a timeout.
    """

    def __init__(
        self,
        factory: Callable[[dict[str, Any]], Any],
        close: Callable[[Any], Coroutine[Any, Any, None]],
    ) -> None:
        self._factory = factory
        self._close = close
        self._shared: dict[str, tuple[asyncio.AbstractEventLoop, Any, asyncio.Semaphore]] = {}
        atexit.register(self.close_shared)

    def get(
        self, options: dict[str, Any], token: str, slots: int
    ) -> tuple[Any, asyncio.Semaphore, bool]:
        """``(client, request slots, private)`` for the running loop.

        Parameters
        ----------
        options, token : dict, str
            The client's options and their identity.
        slots : int
            Requests the client may have in flight (at most its connection pool's size).
        """
        loop = asyncio.get_running_loop()
        if loop is not getattr(_io, "_loop", None):
            return self._factory(options), asyncio.Semaphore(slots), True
        hit = self._shared.get(token)
        if hit is None or hit[0] is not loop:
            hit = (loop, self._factory(options), asyncio.Semaphore(slots))
            self._shared[token] = hit
        return hit[1], hit[2], False

    async def release(self, client: Any, private: bool) -> None:
        if private:
            await self._close(client)

    def in_use(self, count: Callable[[Any], int]) -> list[tuple[str, int]]:
        """``(token, count(client))`` of each shared client for which ``count`` is not 0.

        Parameters
        ----------
        count : callable
            ``count(client)``: the client's pooled connections checked out now.
        """
        found = [(token, count(client)) for token, (_, client, _) in list(self._shared.items())]
        return [(token, n) for token, n in found if n]

    def close_shared(self) -> None:
        for loop, client, _slots in list(self._shared.values()):
            if loop.is_running() and not loop.is_closed():
                fut = asyncio.run_coroutine_threadsafe(self._close(client), loop)
                with contextlib.suppress(Exception):  # broad: at exit, closing is best effort
                    fut.result(timeout=2)
        self._shared.clear()


class BackendClient:
    """One backend's client on the event loop it runs on: the client of its option set
    (shared on quire's loop, private elsewhere) with that client's request slots, and the
    backend's own upload budget; taken anew when the loop changes.

    Parameters
    ----------
    cache : ClientCache
        The clients of the backend's class.
    options, token : dict, str
        The client's options and their identity.
    slots : int
        Requests one client may have in flight.
    budget : int
        Bytes the backend's uploads may hold at once.
    """

    def __init__(
        self, cache: ClientCache, options: dict[str, Any], token: str, slots: int, budget: int
    ) -> None:
        self._cache = cache
        self._options = options
        self._token = token
        self._max_slots = slots
        self._budget_bytes = budget
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None
        self._slots: asyncio.Semaphore | None = None
        self._private = False
        self._budget: ByteBudget | None = None

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._client, self._slots, self._private = self._cache.get(
                self._options, self._token, self._max_slots
            )
            self._loop = loop
            self._budget = ByteBudget(self._budget_bytes)

    @property
    def client(self) -> Any:
        """The client on the running loop (taken on first use)."""
        self._bind()
        return self._client

    @property
    def slots(self) -> asyncio.Semaphore:
        """The client's request slots on the running loop."""
        self._bind()
        assert self._slots is not None
        return self._slots

    @property
    def budget(self) -> ByteBudget:
        """The upload budget on the running loop."""
        self._bind()
        assert self._budget is not None
        return self._budget

    @property
    def existing(self) -> Any:
        """The client taken on the loop last used, or None (takes none)."""
        return self._client

    async def close(self) -> None:
        """Release the client (a private one is closed; a shared one stays for others)."""
        if self._client is not None:
            await self._cache.release(self._client, self._private)
        self._client = self._loop = None
