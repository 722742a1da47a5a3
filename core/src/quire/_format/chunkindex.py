"""Format version 2: the chunk index and the backend view that reads chunks out of packs.

Each process that saves writes, next to its pack objects, one **chunk index** object
``d/<txid>/%packs/p<process>.index.json`` in fsspec's reference-filesystem form::

    {"version": 1,
     "refs": {"<zarr key>": ["d/<txid>/%packs/p<process>-<seq>", offset, length]
                            | "<inline UTF-8 text>"},
     "quire": {"format": 3, "txid": "<txid>", "process": <int>,
               "crc32": {"<zarr key>": "<8 hex digits>"},
               "crc32c": {"<zarr key>": "<8 hex digits>"},
               "shards": {"<zarr shard key>": "<8 hex digits x (1 + inner chunks)>"}}}

Zarr keys are relative to the checkpoint root (``d/<txid>/pytree/params/w/c/0/1``,
``.../zarr.json``); targets are relative too, so a copied checkpoint needs no rewrite and
``fsspec.filesystem("reference", fo=index, remote_protocol="dir",
remote_options={"path": <checkpoint root>, ...})`` serves it to zarr with no quire code.

Every key is in exactly one of two maps that bind it to its stored bytes, in an index
whose size and crc32c are in the commit record (``quire._format.chunkid``): ``quire.crc32c`` holds
the crc32c trailer of a chunk whose codec chain ends with ``crc32c`` (compared with the
chunk's last 4 bytes; the decoder's crc32c check binds the rest, so identity costs no
pass of its own), ``quire.crc32`` the CRC-32 (zlib's polynomial) of the exact bytes of
every other key (zarr shards, chunks without a crc32c, ``zarr.json``).  A chunk swapped
with another (of the same array or of another array), moved to another offset, or copied
in from another checkpoint fails it.  Index format 2 has ``quire.crc32`` only (what quire
wrote before the trailer binding; still read); format 3 adds ``quire.crc32c`` and is
written when some key is trailer-bound (an older quire refuses it as an unknown index
version).  ``quire.shards`` (any format; older quire ignores it) also binds each zarr shard
by its shard index's and inner chunks' crc32c trailers, which :class:`PackedReader` checks
on the range reads a load makes of a shard.

The commit record names the index objects (``"indexes"``: txid, process, object, size,
crc32c), never the chunks: a loader reads the index of its own process first and the
others only for chunks it did not find there.
"""

from __future__ import annotations

import asyncio
import builtins
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from quire._format.borrow import BorrowingView, check_borrowed, parent_url
from quire._format.chunkcheck import check_read
from quire._format.chunkid import FORMATS, TRAILER_FORMAT, Ref, crc_hex
from quire._format.crc import ChunkError, crc32c
from quire._format.paths import is_safe_location
from quire._format.shardid import ShardChecks, valid_shard_binding
from quire._store.base import Backend
from quire._store.url import open_backend
from quire._store.wrapped import Wrapped
from quire.errors import CorruptCheckpointError

PACK_DIR = "%packs"  # never produced by key escaping ('%' is always followed by two hex digits)
MAX_INDEX_BYTES = 1 << 31


def pack_dir(txid: str) -> str:
    return f"d/{txid}/{PACK_DIR}"


def pack_key(txid: str, process: int, seq: int) -> str:
    return f"{pack_dir(txid)}/p{process:05d}-{seq:05d}"


def is_pack_key(key: object) -> bool:
    """Whether ``key`` names a pack object ``d/<txid>/%packs/<name>``.  An index usually
    points at packs of its own txid only; one written by a finalize that rewrote packs
    also points at kept packs of the older versions (see ``quire._engine.packrewrite``)."""
    if not isinstance(key, str) or not is_safe_location(key):
        return False
    parts = key.split("/")
    return len(parts) == 4 and parts[2] == PACK_DIR and parts[1].isalnum()


def index_key(txid: str, process: int) -> str:
    return f"{pack_dir(txid)}/p{process:05d}.index.json"


def index_entry(
    txid: str, process: int, key: str, data: bytes, borrowed: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """The commit record's description of one index object; ``borrowed`` (an incremental
    step: ``quire._format.borrow``) the packs of earlier steps it points into, with the
    bytes it borrows from each (None: read from ``data``)."""
    if borrowed is None and b'"borrowed"' in data:
        try:
            borrowed = json.loads(data)["quire"].get("borrowed")
        except (ValueError, KeyError, TypeError):
            borrowed = None
    out: dict[str, Any] = {
        "txid": txid,
        "process": process,
        "object": key,
        "size": len(data),
        "crc32c": crc_hex(crc32c(data)),
    }
    if borrowed:
        out["borrowed"] = dict(sorted(borrowed.items()))
    return out


def check_entries(entries: Any, url: str) -> list[dict[str, Any]]:
    """Validate a record's ``indexes`` list; ``CorruptCheckpointError`` naming the defect."""
    if not isinstance(entries, list):
        raise CorruptCheckpointError(
            f"{url}/quire.json: 'indexes' is not a list; the commit record is damaged"
        )
    for e in entries:
        ok = (
            isinstance(e, dict)
            and isinstance(e.get("txid"), str)
            and e["txid"].isalnum()
            and type(e.get("process")) is int
            and e["process"] >= 0
            and type(e.get("size")) is int
            and 0 <= e["size"] <= MAX_INDEX_BYTES
            and isinstance(e.get("crc32c"), str)
            and e.get("object") == index_key(e["txid"], e["process"])
            and ("borrowed" not in e or check_borrowed(e["borrowed"]))
        )
        if not ok:
            raise CorruptCheckpointError(
                f"{url}/quire.json: malformed chunk-index entry {str(e)[:200]!r}; "
                "the commit record is damaged (restore it from a copy)"
            )
    return list(entries)


def parse_index(data: bytes, entry: Mapping[str, Any], url: str) -> dict[str, Ref]:
    """The refs of one index object, checked against its record entry."""
    where = f"{url}/{entry['object']}"
    if len(data) != entry["size"] or crc_hex(crc32c(data)) != entry["crc32c"]:
        raise ChunkError(
            f"chunk index {entry['object']} has {len(data)} bytes / crc32c "
            f"{crc_hex(crc32c(data))}, the commit record says {entry['size']} / {entry['crc32c']}"
        )
    try:
        doc = json.loads(data)
        refs, meta = doc["refs"], doc["quire"]
        fmt = meta.get("format")
        if doc.get("version") != 1 or fmt not in FORMATS:
            raise ValueError(
                f"unknown index version {fmt!r}: this quire reads index formats "
                f"{', '.join(map(str, FORMATS))}; upgrade quire to read it"
            )
        crcs = meta["crc32"]
        trailers = meta["crc32c"] if fmt == TRAILER_FORMAT else {}
        if fmt != TRAILER_FORMAT and "crc32c" in meta:
            raise ValueError(f"'crc32c' in an index of format {fmt}")
        if meta.get("txid") != entry["txid"] or meta.get("process") != entry["process"]:
            raise ValueError("index of another save or process")
        shards = meta.get("shards", {})
        if not all(isinstance(x, dict) for x in (refs, crcs, trailers, shards)):
            raise TypeError("refs")
    except (ValueError, TypeError, KeyError) as e:
        raise ChunkError(f"chunk index {where} is malformed ({e!r})") from e
    prefix = f"d/{entry['txid']}/"
    # A target outside the checkpoint only as a borrowed pack the record declares.
    borrowed = entry.get("borrowed") or {}
    out: dict[str, Ref] = {}
    for key, v in refs.items():
        crc, tcrc = crcs.get(key), trailers.get(key)
        trailer = tcrc is not None
        bind = tcrc if trailer else crc
        if (
            not key.startswith(prefix)
            or not is_safe_location(key)
            or not isinstance(bind, str)
            or (trailer and (crc is not None or key.endswith("/zarr.json") or isinstance(v, str)))
        ):  # one binding per key; a trailer only for a chunk in a pack
            raise ChunkError(f"chunk index {where}: bad entry for key {key[:200]!r}")
        if isinstance(v, str):
            if key in shards:
                raise ChunkError(f"chunk index {where}: bad shard binding for key {key[:200]!r}")
            out[key] = Ref(None, 0, len(v.encode()), bind, v.encode())
            continue
        if (
            not isinstance(v, list)
            or len(v) != 3
            or not (is_pack_key(v[0]) or v[0] in borrowed)
            or any(type(x) is not int or x < 0 for x in v[1:])
        ):
            raise ChunkError(f"chunk index {where}: bad reference {str(v)[:200]!r} for {key!r}")
        shard = shards.get(key)
        if shard is not None and (
            trailer or not valid_shard_binding(shard) or 16 * (len(shard) // 8 - 1) + 4 > v[2]
        ):  # a zarr shard is CRC-32-bound as a whole, and holds its index
            raise ChunkError(f"chunk index {where}: bad shard binding for key {key[:200]!r}")
        out[key] = Ref(v[0], v[1], v[2], bind, trailer=trailer, shard=shard)
    if not shards.keys() <= out.keys():
        raise ChunkError(f"chunk index {where}: a shard binding for a key it does not hold")
    return out


class ChunkIndex:
    """The refs of a checkpoint's index objects, loaded lazily: own process first."""

    def __init__(
        self, base: Backend, url: str, entries: Sequence[Mapping[str, Any]], process: int = 0
    ) -> None:
        self.base = base
        self.url = url
        self.process = process
        self.by_txid: dict[str, list[Mapping[str, Any]]] = {}
        for e in entries:
            self.by_txid.setdefault(e["txid"], []).append(e)
        self._loads: dict[str, asyncio.Future[dict[str, Ref]]] = {}
        self.loaded: list[str] = []  # index objects read (tests count them)

    async def _load(self, entry: Mapping[str, Any]) -> dict[str, Ref]:
        key = entry["object"]
        fut = self._loads.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._loads[key] = fut
            try:
                data = await self.base.get(key)
                fut.set_result(parse_index(data, entry, self.url))
                self.loaded.append(key)
            except FileNotFoundError as e:
                fut.set_exception(ChunkError(f"chunk index {key} is missing"))
                fut.exception()
                raise ChunkError(f"chunk index {key} is missing") from e
            except BaseException as e:
                fut.set_exception(e)
                fut.exception()
                raise
        return await fut

    def owns(self, key: str) -> bool:
        parts = key.split("/", 2)
        return len(parts) > 2 and parts[0] == "d" and parts[1] in self.by_txid

    async def lookup(self, key: str) -> Ref | None:
        parts = key.split("/", 2)
        entries = self.by_txid.get(parts[1]) if len(parts) > 2 and parts[0] == "d" else None
        if not entries:
            return None
        own = [e for e in entries if e["process"] == self.process]
        rest = [e for e in entries if e["process"] != self.process]
        for group in (own, rest):
            maps = await asyncio.gather(*(self._load(e) for e in group))
            for m in maps:
                ref = m.get(key)
                if ref is not None:
                    return ref
        return None

    async def own_refs(self) -> builtins.list[dict[str, Ref]]:
        """The refs of this process's index objects."""
        own = [e for es in self.by_txid.values() for e in es if e["process"] == self.process]
        return list(await asyncio.gather(*(self._load(e) for e in own)))

    async def all_refs(self) -> dict[str, Ref]:
        out: dict[str, Ref] = {}
        entries = [e for es in self.by_txid.values() for e in es]
        for m in await asyncio.gather(*(self._load(e) for e in entries)):
            out.update(m)
        return out


async def _check_async(ref: Ref, key: str, views: Sequence[memoryview], n: int) -> None:
    """The identity check of a whole object read through the index.  A trailer-bound
    chunk is compared by its last 4 bytes: every reader of quire's array chunks decodes
    them through their codec chain, whose crc32c check binds the rest (``_zarr``:
    ``_read_raw_into``, ``_decode_one``, ``chunk_checker``)."""
    if ref.trailer or n < (1 << 16):
        check_read(ref, key, views, n)
    else:  # the CRC releases the GIL: checks of big chunks run in parallel, off the loop
        from quire._runtime.ioloop import run_blocking

        await run_blocking(check_read, ref, key, views, n)


MAX_COALESCED = 8 << 20  # bytes per coalesced range request (larger ones lose parallelism)


@dataclass
class _Read:
    offset: int
    length: int
    views: builtins.list[memoryview]
    fut: asyncio.Future[int]


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
        from quire._format.packread import Windows, expected_refs
        from quire._runtime.config import current

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
        self._queue.setdefault(target, []).append(
            _Read(offset, sum(v.nbytes for v in views), views, fut)
        )
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._dispatch)
        return await fut

    def _dispatch(self) -> None:
        self._scheduled = False
        queue, self._queue = self._queue, {}
        for target, reads in queue.items():
            reads.sort(key=lambda r: r.offset)
            run: builtins.list[_Read] = []
            for r in reads:
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
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, target: str, run: builtins.list[_Read]) -> None:
        self.requests += 1
        try:
            n = await self.base.get_into(target, [v for r in run for v in r.views], run[0].offset)
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
            assert ref.target is not None
            data = await self.base.get(ref.target, ref.offset + a, ref.offset + b)
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
        return await self.base.get(ref.target, ref.offset + start, ref.offset + end)

    async def size(self, key: str) -> int:
        ref = await self._ref(key)
        return ref.length if ref is not None else await self.base.size(key)

    async def exists(self, key: str) -> bool:
        ref = await self._ref(key)
        return True if ref is not None else await self.base.exists(key)


def reader(
    base: Backend, url: str, entries: Sequence[Mapping[str, Any]] | None, process: int = 0
) -> Backend:
    """``base`` itself for version-1 data, else a :class:`PackedReader` over the entries
    (reading borrowed packs, if the entries declare any, through the root one level up)."""
    if not entries:
        return base
    if any(e.get("borrowed") for e in entries):
        base = BorrowingView(base, open_backend(parent_url(url), base.storage_options))
    return PackedReader(base, ChunkIndex(base, url, entries, process))
