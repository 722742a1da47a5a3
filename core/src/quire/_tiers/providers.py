"""Where a multi-process local tier's restore reads an owner's objects (``restore_reader``).

A :class:`Provider` is one place: this process's own root, a peer holder over the peer link
(byte ranges, through a :class:`Holder` shared by every owner that peer holds), or the
persistent tier.  A :class:`Holder` is one peer process as one load sees it: at most
:data:`PEER_STREAMS` reads in flight to it, the bytes those reads ask for (the reader sends
a range to the holder with the fewest), and a pool of connections kept open for the whole
load (``link.Pool``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from quire._peers import link
from quire._runtime.ioloop import run_blocking
from quire._store.base import Backend
from quire._tiers import ownership
from quire.errors import PeerError

if TYPE_CHECKING:
    from quire._tiers.peer_copies import PeerCopies

__all__ = [
    "PEER_STREAMS",
    "Holder",
    "Provider",
    "local_provider",
    "peer_provider",
    "persistent_provider",
]

log = logging.getLogger("quire")

_MAX_MARKER = 1 << 24

#: Range reads one process sends one peer at once (its server serves 64 connections); also
#: the connections to it kept open for the load.
PEER_STREAMS = 4


class Provider:
    """One place an owner's objects can be read: this root, a peer, the persistent tier."""

    def __init__(self, name: str, backend: Backend | None = None) -> None:
        self.name = name
        self.backend = backend  # a backend holding the objects (None: a peer)
        self.bytes = 0  # bytes read from it by this load
        self.requests = 0
        self._listing: asyncio.Future[dict[str, int]] | None = None

    def load(self) -> int:
        """Bytes asked of this place and not yet answered (peers; 0 for the others)."""
        return 0

    async def get(self, key: str, start: int | None, end: int | None) -> bytes:
        assert self.backend is not None
        return await self.backend.get(key, start, end)

    async def get_into(self, key: str, buffers: Sequence[memoryview], offset: int) -> int:
        assert self.backend is not None
        return await self.backend.get_into(key, buffers, offset)

    async def _list(self) -> dict[str, int]:
        raise NotImplementedError

    async def listing(self) -> dict[str, int]:
        """The owner's objects here, with their sizes (read once)."""
        if self._listing is None:
            self._listing = asyncio.ensure_future(self._list())
        return await asyncio.shield(self._listing)

    def close(self) -> None:
        """Release what the source keeps open (a peer's connections)."""


class _Local(Provider):
    def __init__(self, backend: Backend, doc: Mapping[str, Any], owner: int) -> None:
        super().__init__("this process's local tier", backend)
        self.doc, self.owner = doc, owner

    async def _list(self) -> dict[str, int]:
        assert self.backend is not None
        got = await ownership.marked(self.backend, self.doc, self.owner)
        if got is None:
            raise FileNotFoundError(f"no marker for process {self.owner}'s objects here")
        return got


class Holder:
    """One peer process for one load: its reads in flight (at most ``streams``), the bytes
    they ask for, and its connections (opened by :meth:`warm` or on first use, kept until
    :meth:`close`)."""

    def __init__(self, copies: PeerCopies, index: int, streams: int = PEER_STREAMS) -> None:
        self.copies, self.index = copies, index
        self.slots = asyncio.Semaphore(streams)
        self.streams = streams
        self.inflight = 0  # bytes asked of it and not yet answered
        self._pool: link.Pool | None = None
        self._warming: asyncio.Future[None] | None = None
        self._closed = False

    def warm(self) -> None:
        """Open its ``streams`` connections now, in the background, so that the load's
        first reads find them open (the load plans its reads meanwhile): one, then, once
        it is open, the others at once (a holder that does not answer holds one of the
        I/O threads, not ``streams``).  Not one of the reads in flight: a read that comes
        first opens its own, and counts: no more than ``streams`` are opened in all when
        the reads' handshakes end first.  A failure here is only logged: the reads meet
        it themselves (and route to the next holder)."""
        if self._warming is None:
            self._warming = asyncio.ensure_future(self._open_ahead())
            self._warming.add_done_callback(self._warmed)

    async def _open_ahead(self) -> None:
        pool = await self.pool()
        if pool.connections >= self.streams:
            return
        await run_blocking(pool.connect, self.copies.timeout)
        if not self._closed:  # counting those the reads opened meanwhile (the record's)
            more = [
                run_blocking(pool.connect, self.copies.timeout)
                for _ in range(self.streams - pool.connections)
            ]
            for got in await asyncio.gather(*more, return_exceptions=True):
                if isinstance(got, BaseException):
                    raise got

    def _warmed(self, task: asyncio.Future[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.debug("process %d: opening connections ahead: %s", self.index, task.exception())

    async def call(self, size: int, fn: Any, path: str, *args: Any) -> Any:
        """``fn(address, path, peer, timeout, *args, pool=...)`` in the I/O pool, as one
        of its reads in flight (``size`` bytes counted while it waits and runs)."""
        self.inflight += size
        try:
            async with self.slots:
                pool = await self.pool()
                return await run_blocking(
                    fn, pool.address, path, pool.peer, self.copies.timeout, *args, pool=pool
                )
        finally:
            self.inflight -= size

    async def record(self, rel: str) -> bytes:
        """The commit record of step ``rel`` as it holds it (unchecked), through its pool."""
        return await self.call(0, link.fetch, f"{rel}/quire.json", _MAX_MARKER)  # type: ignore[no-any-return]

    async def pool(self) -> link.Pool:
        if self._pool is None:
            addr = await run_blocking(self.copies._address, self.index)
            if self._pool is None:
                self._pool = link.Pool(addr, self.copies.peer(self.index), self.streams)
                if self._closed:  # closed meanwhile: what it opens now is closed at once
                    self._pool.close()
        return self._pool

    @property
    def connections(self) -> int:
        """Connections opened to it by this load."""
        return 0 if self._pool is None else self._pool.connections

    def close(self) -> None:
        """Close its idle connections; one still opening (:meth:`warm`) or answering is
        closed when it is done."""
        self._closed = True
        if self._pool is not None:
            self._pool.close()


class _Peer(Provider):
    def __init__(
        self,
        copies: PeerCopies,
        holder: Holder,
        rel: str,
        doc: Mapping[str, Any],
        owner: int,
    ) -> None:
        super().__init__(f"process {holder.index}")
        self.copies, self.holder, self.rel = copies, holder, rel
        self.doc, self.owner = doc, owner

    def load(self) -> int:
        return self.holder.inflight

    async def _fetch(self, key: str, limit: int, span: tuple[int, int] | None) -> bytes:
        a, b = span if span is not None else (None, None)
        size = limit if span is None else span[1] - span[0]
        data = await self.holder.call(size, link.fetch, f"{self.rel}/{key}", limit, a, b)
        self.bytes += len(data)
        self.requests += 1
        return data  # type: ignore[no-any-return]

    async def get(self, key: str, start: int | None, end: int | None) -> bytes:
        if start is None or end is None:
            size = (await self.listing()).get(key)
            if size is None:
                raise FileNotFoundError(f"{key}: not among {self.name}'s objects")
            start, end = start or 0, size if end is None else end
        return await self._fetch(key, max(0, end - start), (start, max(start, end)))

    async def get_into(self, key: str, buffers: Sequence[memoryview], offset: int) -> int:
        size = sum(memoryview(b).nbytes for b in buffers)
        n = await self.holder.call(
            size, link.fetch_into, f"{self.rel}/{key}", list(buffers), offset
        )
        self.bytes += n
        self.requests += 1
        return n  # type: ignore[no-any-return]

    async def _list(self) -> dict[str, int]:
        key = ownership.marker_key(str(self.doc["txids"][0]), self.owner)
        got = ownership.parse_marker(
            await self._fetch(key, _MAX_MARKER, None), self.doc, self.owner
        )
        if got is None:
            raise PeerError(f"{self.name}: its marker for process {self.owner} is malformed")
        return got

    def close(self) -> None:
        self.holder.close()


class _Persistent(Provider):
    def __init__(
        self, backend: Backend, url: str, doc: Mapping[str, Any], owner: int, primary: int
    ) -> None:
        super().__init__(f"the persistent tier {url}", backend)
        self.url, self.doc, self.owner, self.primary = url, doc, owner, primary

    async def get(self, key: str, start: int | None, end: int | None) -> bytes:
        data = await super().get(key, start, end)
        self.bytes += len(data)
        self.requests += 1
        return data

    async def get_into(self, key: str, buffers: Sequence[memoryview], offset: int) -> int:
        n = await super().get_into(key, buffers, offset)
        self.bytes += n
        self.requests += 1
        return n

    async def _list(self) -> dict[str, int]:
        assert self.backend is not None
        return await ownership.owned_sizes(
            self.backend, self.url, self.doc, self.owner, self.primary
        )


def local_provider(backend: Backend, doc: Mapping[str, Any], owner: int) -> Provider:
    return _Local(backend, doc, owner)


def peer_provider(
    copies: PeerCopies,
    holder: int,
    rel: str,
    doc: Mapping[str, Any],
    owner: int,
    slots: Holder | asyncio.Semaphore,
) -> Provider:
    """Owner ``owner``'s objects at process ``holder``; ``slots``: the :class:`Holder`
    shared by every source of that process (a bare semaphore: a holder of its own)."""
    if not isinstance(slots, Holder):
        h = Holder(copies, holder)
        h.slots = slots
        slots = h
    return _Peer(copies, slots, rel, doc, owner)


def is_peer(src: Provider) -> bool:
    return isinstance(src, _Peer)


def is_persistent(src: Provider) -> bool:
    return isinstance(src, _Persistent)


def persistent_provider(
    backend: Backend, url: str, doc: Mapping[str, Any], owner: int, primary: int
) -> Provider:
    return _Persistent(backend, url, doc, owner, primary)
