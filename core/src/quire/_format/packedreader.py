"""Format v2's read view: :class:`PackedReader`, a backend that serves the zarr keys of a
checkpoint out of its packs through the chunk index (``quire._format.chunkindex``), checking
every object it reads against the index, coalescing adjacent range reads and planning large
read windows (``quire._format.packread``); :func:`reader` builds it for a commit record's
``indexes`` (with borrowed packs read through the root one level up)."""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from quire._format.borrow import BorrowingView, parent_url
from quire._format.chunkcheck import check_read, raise_not_data
from quire._format.chunkid import Ref
from quire._format.chunkindex import ChunkIndex
from quire._format.crc import ChunkError
from quire._format.packread import Windows, expected_refs
from quire._format.shardid import ShardChecks
from quire._runtime.config import current
from quire._runtime.ioloop import run_blocking
from quire._runtime.tasks import until_done
from quire._store.base import Backend
from quire._store.url import open_backend
from quire._store.wrapped import Wrapped


async def _check_async(ref: Ref, key: str, views: Sequence[memoryview], n: int) -> None:
    """The identity check of a whole object read through the index.  A trailer-bound
    chunk is compared by its last 4 bytes: every reader of quire's array chunks decodes
    them through their codec chain, whose crc32c check binds the rest (``_zarr``:
    ``_read_raw_into``, ``_decode_one``, ``chunk_checker``)."""
    if ref.trailer or n < (1 << 16):
        check_read(ref, key, views, n)
    else:  # the CRC releases the GIL: checks of big chunks run in parallel, off the loop
        await run_blocking(check_read, ref, key, views, n)


MAX_COALESCED = 8 << 20  # bytes per coalesced range request (larger ones lose parallelism)


@dataclass
class _Read:
    offset: int
    length: int
    views: builtins.list[memoryview]
    fut: asyncio.Future[int]
    run: builtins.list[_Read] | None = None  # the coalesced request it went out in
    task: asyncio.Task[None] | None = None  # ... and the task sending it


class PackedReader(Wrapped):
    """A read view of a checkpoint root in which indexed zarr keys resolve into packs.

    Whole-chunk reads are checked against the index (``_check_async``), range reads of a
    zarr shard against its ``quire.shards`` binding (``quire._format.shardid.ShardChecks``); keys
    it does not know are read from the underlying backend unchanged (version-1 data, other
    units).
    """

    def __init__(self, base: Backend, index: ChunkIndex) -> None:
        super().__init__(base)
        self.index = index
        self._queue: dict[str, list[_Read]] = {}
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.requests = 0  # range requests sent to the backend (tests count them)
        self._expect: builtins.list[str] = []
        self._planning: asyncio.Future[Any] | None = None
        self.windows: Any = None  # quire._format.packread.Windows once planned
        self.shards = ShardChecks(self._shard_bytes)  # range reads of zarr shards

    def expect(self, locations: Iterable[str]) -> None:
        """Declare that this load reads every chunk of the arrays at ``locations`` that
        this process's index holds: they are read in large windows (``quire._format.packread``)
        on backends with ``read_part_size`` (object stores).  Only for loads that need
        all of them (a single-process load)."""
        span = getattr(self.base, "read_part_size", 0)
        if isinstance(span, int) and span > 0:
            self._expect = [f"{loc}/" for loc in locations if isinstance(loc, str)]

    async def _windows(self) -> Any:
        if not self._expect:
            return None
        if self._planning is None:
            self._planning = asyncio.ensure_future(self._plan())
        return await asyncio.shield(self._planning)

    async def _plan(self) -> Any:
        windows = Windows(self.base, self.base.read_part_size, current().byte_budget)  # type: ignore[attr-defined]
        for m in await self.index.own_refs():
            windows.plan(expected_refs(m, self._expect))
        self.windows = windows
        return windows

    async def _read(self, target: str, offset: int, views: builtins.list[memoryview]) -> int:
        """Read into ``views`` from ``target`` at ``offset``, coalesced with the reads
        other tasks issue in the same event-loop turn (the caller holds its share of the
        byte budget and of ``max_concurrency``): adjacent ranges of a pack become one
        request, filled straight into every caller's buffers."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        read = _Read(offset, sum(v.nbytes for v in views), views, fut)
        self._queue.setdefault(target, []).append(read)
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._dispatch)
        try:
            return await fut
        except asyncio.CancelledError:
            # The last caller of a request to go stops it, and returns once it has
            # stopped: a failed load's reads have ended (their descriptors closed, no
            # thread filling its buffers) when the load raises.
            task, run = read.task, read.run
            if task is not None and run is not None and all(r.fut.done() for r in run):
                task.cancel()
                await until_done(task)
            raise

    def _dispatch(self) -> None:
        self._scheduled = False
        queue, self._queue = self._queue, {}
        for target, reads in queue.items():
            reads.sort(key=lambda r: r.offset)
            run: builtins.list[_Read] = []
            for r in reads:
                if r.fut.done():  # its caller was cancelled before the request went out
                    continue
                if run and (
                    r.offset != run[-1].offset + run[-1].length
                    or sum(x.length for x in run) + r.length > MAX_COALESCED
                ):
                    self._spawn(target, run)
                    run = []
                run.append(r)
            if run:
                self._spawn(target, run)

    def _spawn(self, target: str, run: builtins.list[_Read]) -> None:
        task = asyncio.ensure_future(self._send(target, run))
        for r in run:
            r.run, r.task = run, task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, target: str, run: builtins.list[_Read]) -> None:
        self.requests += 1
        try:
            try:
                views = [v for r in run for v in r.views]
                n = await self.base.get_into(target, views, run[0].offset)
            except OSError as e:
                raise_not_data(e, target)
        except BaseException as e:
            for r in run:
                if not r.fut.done():
                    r.fut.set_exception(e)
            return
        for r in run:
            got = max(0, min(r.length, n - (r.offset - run[0].offset)))
            if not r.fut.done():
                r.fut.set_result(got)

    async def _ref(self, key: str) -> Ref | None:
        if not self.index.owns(key):
            return None
        return await self.index.lookup(key)

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        ref = await self._ref(key)
        if ref is None:
            return await self.base.get(key, start, end)
        a = 0 if start is None else max(0, min(start, ref.length))
        b = ref.length if end is None else max(a, min(end, ref.length))
        if ref.inline is not None:
            data = ref.inline
        else:
            data = await self._shard_bytes(ref, a, b)
            if len(data) != b - a:
                raise ChunkError(f"{key}: pack {ref.target} is truncated")
            if a > 0 or b < ref.length:
                if ref.shard is not None:
                    await self.shards.check(key, ref, a, [memoryview(data)], len(data))
                return data
        if a == 0 and b == ref.length:
            await _check_async(ref, key, [memoryview(data)], len(data))
        return bytes(data[a:b]) if ref.inline is not None else data

    async def get_into(self, key: str, buffers: Sequence[memoryview], offset: int = 0) -> int:
        ref = await self._ref(key)
        if ref is None:
            return await self.base.get_into(key, buffers, offset)
        if ref.inline is not None or ref.target is None:
            return await super().get_into(key, buffers, offset)
        want = max(0, min(sum(b.nbytes for b in buffers), ref.length - offset))
        views, left = [], want
        for b in buffers:
            if left <= 0:
                break
            v = b.cast("B")[: min(left, b.nbytes)]
            views.append(v)
            left -= v.nbytes
        n = None
        if offset == 0 and want == ref.length and want:
            windows = await self._windows()
            if windows is not None:
                n = await windows.read(key, views)
        if n is None:
            n = await self._read(ref.target, ref.offset + offset, views) if want else 0
        if n < want:
            raise ChunkError(f"{key}: pack {ref.target} is truncated")
        if offset == 0 and n == ref.length:
            await _check_async(ref, key, views, n)
        elif ref.shard is not None and n:
            await self.shards.check(key, ref, offset, views, n)
        return n

    async def _shard_bytes(self, ref: Ref, start: int, end: int) -> bytes:
        assert ref.target is not None
        try:
            return await self.base.get(ref.target, ref.offset + start, ref.offset + end)
        except OSError as e:
            raise_not_data(e, ref.target)

    async def size(self, key: str) -> int:
        ref = await self._ref(key)
        return ref.length if ref is not None else await self.base.size(key)

    async def exists(self, key: str) -> bool:
        ref = await self._ref(key)
        return True if ref is not None else await self.base.exists(key)


def reader(
    base: Backend,
    url: str,
    entries: Sequence[Mapping[str, Any]] | None,
    process: int = 0,
    txids: Collection[str] | None = None,
) -> Backend:
    """``base`` itself for version-1 data, else a :class:`PackedReader` over the entries
    (``txids``: those the commit record lists; the entries' own when None), reading
    borrowed packs, if the entries declare any, through the root one level up."""
    if not entries:
        return base
    if any(e.get("borrowed") for e in entries):
        base = BorrowingView(base, open_backend(parent_url(url), base.storage_options))
    return PackedReader(base, ChunkIndex(base, url, entries, process, txids))
