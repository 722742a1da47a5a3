"""Format version 2: the pack writer.

A :class:`PackWriter` is a write view of a checkpoint root handed to leaf handlers in
place of the backend.  Every ``put`` of a zarr key under ``d/<txid>/`` is appended to the
process's current pack object ``d/<txid>/%packs/p<process>-<seq>`` instead of becoming
an object of its own; small text objects (``zarr.json``) go inline into the chunk index.
``finish`` uploads the last pack and writes the process's chunk index (see
``quire._format.chunkindex``) while the last packs complete, returning its description for the
commit record.  Each key is bound in the index (``quire._format.chunkid``) by the CRC-32 of its
bytes, computed here, or — a chunk written with :meth:`PackWriter.put_bound` and
``trailer=True`` (quire's array chunks whose codec chain ends with crc32c) — by its own
crc32c trailer, taken from its last 4 bytes without a pass over the rest.

Backends that declare ``stream_writes`` (local files, S3 multipart, GCS resumable) get
every chunk written straight into its pack at an offset reserved for it: nothing is held,
and packs reach ``pack_bytes``.  A pack that takes no new chunk is closed (completed) in
the background once its last write is in.  On other backends the encoded chunks of a pack are held (by
reference: raw chunks are views of the host arrays) until the pack is uploaded.  A pack is sealed and uploaded when it would
exceed ``pack_bytes`` or when the bytes waiting reach a quarter of the byte budget; at
most two packs upload at once and a ``put`` waits for an upload when more are pending,
so a save holds at most its byte budget plus three quarters of it in pack buffers.
A pack lost with a crashed process is garbage under an uncommitted txid.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from quire._format.borrow import Previous, content_hash, from_root
from quire._format.chunkid import chunk_crc, crc_hex, index_bytes, trailer_hex
from quire._format.chunkindex import index_entry, index_key
from quire._format.chunkindex import pack_key as _pack_key
from quire._format.shardid import shard_binding
from quire._runtime.ioloop import run_blocking
from quire._store.base import Backend, Buffer
from quire._store.wrapped import Wrapped

INLINE_SUFFIX = "/zarr.json"
INLINE_MAX = 64 << 10
MAX_UPLOADS = 2


class PackWriter(Wrapped):
    """Appends the zarr objects one process writes under ``d/<txid>/`` to pack objects."""

    def __init__(
        self,
        base: Backend,
        txid: str,
        process: int,
        pack_bytes: int,
        budget_bytes: int,
    ) -> None:
        super().__init__(base)
        self.txid = txid
        self.process = process
        self.prefix = f"d/{txid}/"
        self.pack_bytes = max(1, pack_bytes)
        self.flush_at = max(1 << 20, min(self.pack_bytes, budget_bytes // 4))
        self.refs: dict[str, Any] = {}
        self.binds: dict[str, tuple[str, bool]] = {}  # key -> (hex, trailer): quire._format.chunkid
        self.shards: dict[str, str] = {}  # zarr shard key -> its trailers (quire.shards)
        self._seq = 0
        self._pending: list[memoryview] = []
        self._pending_bytes = 0
        self._uploads: list[asyncio.Task[None]] = []
        self.packs = 0
        self.bytes = 0
        # Backends that can write an object in place at offsets (local files) stream every
        # chunk straight into its pack: nothing is held, packs reach pack_bytes.
        self._streaming = base.capabilities.stream_writes
        self._writers: list[Any] = []  # open packs: the current one last
        self._writing: dict[int, int] = {}  # id(writer) -> writes in flight
        self._closing: dict[asyncio.Task[None], Any] = {}  # sealed packs being completed
        self._opening: asyncio.Future[Any] | None = None
        self._size = 0
        self._roll = False  # the next streamed chunk opens a new pack (fresh_pack)
        # Incremental saves (quire._format.borrow): every chunk's xxh3-128, and chunks equal
        # to the previous step's at their place point at its bytes instead of being written.
        self.hashes: dict[str, str] | None = None
        self.previous: Previous | None = None
        self._candidate: Previous | None = None  # what may be borrowed, once leased
        self._lease: Callable[[], Awaitable[bool]] | None = None
        self._leasing: asyncio.Future[Previous | None] | None = None
        self.borrowed: dict[str, int] = {}  # borrowed target -> bytes borrowed from it
        self.borrowed_bytes = 0
        self.compacted = 0  # bytes moved out of mostly-dead borrowed packs (own)

    def incremental(
        self,
        previous: Previous | None,
        lease: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        """Hash every chunk into the index, borrowing from ``previous`` where equal.
        ``lease``: called once, before the first borrow (the first chunk found equal, or
        :meth:`resolve`), it says whether ``previous`` may be borrowed from after all (a
        save whose every chunk changed then makes no request for it)."""
        self.hashes = {}
        self._candidate = previous
        self._lease = lease
        self._leasing = None
        if lease is None:
            self.previous = previous

    async def resolve(self) -> Previous | None:
        """What this save borrows from: the candidate once its lease is taken (None when
        there is none, or it is gone)."""
        if self._lease is None:
            return self.previous
        if self._leasing is None:
            self._leasing = asyncio.ensure_future(self._take(self._lease))
        return await asyncio.shield(self._leasing)

    async def _take(self, lease: Callable[[], Awaitable[bool]]) -> Previous | None:
        self.previous = self._candidate if await lease() else None
        return self.previous

    def _borrow(self, key: str, old: str) -> None:
        assert self.previous is not None and self.hashes is not None
        prev = self.previous
        ref = prev.refs[old]
        if isinstance(ref, str):
            self.refs[key] = ref
        else:
            target = from_root(ref[0])
            self.refs[key] = [target, ref[1], ref[2]]
            self.borrowed[target] = self.borrowed.get(target, 0) + ref[2]
            self.borrowed_bytes += ref[2]
        self.binds[key] = prev.binds[old]
        if old in prev.shards:
            self.shards[key] = prev.shards[old]
        if old in prev.hashes:
            self.hashes[key] = prev.hashes[old]

    def carry(self, location: str, old_location: str) -> int:
        """Point every key of the array at ``old_location`` in the previous step at its
        bytes under ``location`` (a leaf that is the very same object as last time:
        nothing read, encoded, hashed or written); the number of keys carried."""
        if self.previous is None:
            return 0
        keys = self.previous.keys_at(old_location)
        for old in keys:
            self._borrow(location + old[len(old_location) :], old)
        return len(keys)

    # -- writes ------------------------------------------------------------------
    async def put(self, key: str, data: Sequence[Buffer]) -> None:
        await self.put_bound(key, data)

    async def put_bound(
        self,
        key: str,
        data: Sequence[Buffer],
        *,
        trailer: bool = False,
        crc: str | None = None,
        shard: int | str | None = None,
    ) -> None:
        """``put``, saying how the index binds ``key``: ``trailer`` when ``data`` ends with
        the crc32c of the bytes before it and every reader decodes it through a chain that
        checks that crc32c (quire's plain array chunks); else the CRC-32 of ``data``,
        ``crc`` when the caller knows it (a finalize copying a checked chunk).  ``shard``:
        ``data`` is a zarr shard with that many inner chunks, all ending with a crc32c (or
        its ``quire.shards`` value, known): its trailers are bound too (range reads)."""
        if not key.startswith(self.prefix):
            await self.base.put(key, data)
            return
        views = [memoryview(b).cast("B") for b in data]
        n = sum(v.nbytes for v in views)
        if self.hashes is not None and not key.endswith(INLINE_SUFFIX):
            digest = (
                await run_blocking(content_hash, views) if n > (1 << 16) else content_hash(views)
            )
            cand = self._candidate
            old = cand.match(key, digest, n) if cand is not None else None
            if old is not None and await self.resolve() is not None:
                self._borrow(key, old)
                return
            self.hashes[key] = digest
        bound = shard_binding(views, n, shard) if isinstance(shard, int) else shard
        if bound is not None and not trailer:
            self.shards[key] = bound
        if trailer:
            crc = trailer_hex(views, n)
            if crc is None:
                raise ValueError(f"{key}: {n} bytes cannot end with a crc32c")
        elif crc is None:
            crc = crc_hex(
                await run_blocking(chunk_crc, views) if n > (1 << 16) else chunk_crc(views)
            )
        bind = (crc, trailer)
        if key.endswith(INLINE_SUFFIX) and n <= INLINE_MAX and not trailer:
            try:
                self.refs[key] = b"".join(views).decode()
                self.binds[key] = bind
                return
            except UnicodeDecodeError:
                pass
        await self._store(key, views, n, bind)

    def fresh_pack(self) -> None:
        """Start a new pack for the next chunks (compaction keeps the chunks it moves
        apart from the step's changed ones: they are the ones likely to stay)."""
        if self._streaming:
            self._roll = True
        else:
            self._seal()

    async def own(self, key: str, views: list[memoryview]) -> None:
        """Write the bytes of the borrowed ``key`` (checked by the caller) into this step's
        own packs: compaction of a mostly-dead borrowed pack.  Its binding, shard trailers
        and hash stay; it is no longer borrowed."""
        ref = self.refs[key]
        assert isinstance(ref, list) and ref[0] in self.borrowed
        n = sum(v.nbytes for v in views)
        assert n == ref[2], (key, n, ref)
        left = self.borrowed[ref[0]] - n
        if left:
            self.borrowed[ref[0]] = left
        else:
            del self.borrowed[ref[0]]
        self.borrowed_bytes -= n
        self.compacted += n
        await self._store(key, views, n, self.binds[key])

    async def _store(
        self, key: str, views: list[memoryview], n: int, bind: tuple[str, bool]
    ) -> None:
        if self._streaming:
            await self._stream(key, views, n, bind)
            return
        while len(self._uploads) >= MAX_UPLOADS:
            await self._wait_one()
        if self._pending and (
            self._pending_bytes + n > self.pack_bytes or self._pending_bytes >= self.flush_at
        ):
            self._seal()
        self.refs[key] = [_pack_key(self.txid, self.process, self._seq), self._pending_bytes, n]
        self.binds[key] = bind
        self._pending += views
        self._pending_bytes += n
        self.bytes += n
        if self._pending_bytes >= self.flush_at:
            self._seal()

    async def _stream(
        self, key: str, views: list[memoryview], n: int, bind: tuple[str, bool]
    ) -> None:
        while self._opening is not None and not self._opening.done():
            await asyncio.shield(self._opening)
        if not self._writers or (self._size and (self._roll or self._size + n > self.pack_bytes)):
            loop = asyncio.get_running_loop()
            self._opening = loop.create_future()
            try:
                if self._writers:
                    self._seq += 1
                    self._sealed(self._writers[-1])
                w = await self.base.stream_writer(_pack_key(self.txid, self.process, self._seq))
                self._writers.append(w)
                self._writing[id(w)] = 0
                self._size = 0
                self._roll = False
                self.packs += 1
            finally:
                self._opening.set_result(None)
        w, offset = self._writers[-1], self._size
        self._size += n  # reserved before the write: concurrent puts get distinct ranges
        self.refs[key] = [_pack_key(self.txid, self.process, self._seq), offset, n]
        self.binds[key] = bind
        self.bytes += n
        self._writing[id(w)] += 1
        try:
            await w.write(views, offset)
        finally:
            self._writing[id(w)] -= 1
            if not self._writers or w is not self._writers[-1]:
                self._sealed(w)

    def _sealed(self, w: Any) -> None:
        """A pack that takes no new chunks is completed (S3: CompleteMultipartUpload) as
        soon as its last write is in, in the background: a save's packs are not all
        completed at its end, only the last one."""
        if self._writing.get(id(w)) == 0 and w in self._writers:
            self._writers.remove(w)
            del self._writing[id(w)]
            self._closing[asyncio.ensure_future(w.close())] = w

    def _seal(self) -> None:
        if not self._pending:
            return
        key = _pack_key(self.txid, self.process, self._seq)
        bufs = self._pending
        self._pending, self._pending_bytes = [], 0
        self._seq += 1
        self.packs += 1
        self._uploads.append(asyncio.ensure_future(self.base.put(key, bufs)))

    async def _wait_one(self) -> None:
        task = self._uploads[0]
        try:
            await asyncio.shield(task)
        finally:
            if task.done() and task in self._uploads:
                self._uploads.remove(task)

    async def close(self) -> None:
        """Upload what is pending and close the streams: every pack is complete."""
        self._seal()
        while self._uploads:
            await self._wait_one()
        writers, self._writers = self._writers, []
        self._closing.update((asyncio.ensure_future(w.close()), w) for w in writers)
        closing, self._closing = self._closing, {}
        for r in await asyncio.gather(*closing, return_exceptions=True):
            if isinstance(r, BaseException):
                raise r

    async def finish(self) -> dict[str, Any] | None:
        """Upload what is pending, then this process's chunk index; returns the commit
        record's entry for it (None when this process wrote nothing: no index object).
        The index goes up while the last packs complete (it is data of an uncommitted
        txid like them; the commit record, written after, is what makes both count)."""
        if not self.refs:
            await self.close()
            return None
        data = index_bytes(
            self.txid,
            self.process,
            self.refs,
            self.binds,
            self.shards,
            self.hashes,
            self.borrowed,
        )
        key = index_key(self.txid, self.process)
        await asyncio.gather(self.close(), self.base.put(key, [data]))
        return index_entry(self.txid, self.process, key, data, self.borrowed)

    async def abort(self) -> None:
        """Stop uploads in flight (the caller removes the txid's data) and let a lease
        being taken land (the caller releases it)."""
        if self._leasing is not None:
            await asyncio.gather(self._leasing, return_exceptions=True)
        self._pending = []
        for t in self._uploads:
            t.cancel()
        await asyncio.gather(*self._uploads, return_exceptions=True)
        self._uploads = []
        writers, self._writers = self._writers, []
        closing, self._closing = self._closing, {}
        for t in closing:
            t.cancel()
        await asyncio.gather(*closing, return_exceptions=True)
        writers += [w for t, w in closing.items() if t.cancelled() or t.exception()]
        await asyncio.gather(*(w.abort() for w in writers), return_exceptions=True)

    # -- reads and the rest go to the backend (Wrapped) ------------------------------
    async def exists(self, key: str) -> bool:
        return key in self.refs or await self.base.exists(key)
