"""The checks a multi-process local tier's restore makes of bytes before using them
(``restore_reader``), so that bytes one holder got wrong are read again from the next one.

The load engine checks every chunk it decodes anyway; a failure there fails the load.  The
restore reader checks first, where another source is left to ask:

* a range of a pack: every chunk the range holds whole, against its owner's chunk index
  (as ``quire._format.chunkcheck.check_stored``: the crc32c of a trailer-bound chunk's
  message and its trailer, else the CRC-32 of its bytes), in the I/O pool, without copies;
* a chunk index: against the commit record's entry (size and crc32c);
* a whole unit object: against its crc32c trailer.

A chunk a range holds only in part (a range inside a zarr shard) is left to the load's own
check.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from quire._engine.copying import _check_unit_object
from quire._format.chunkcheck import check_read, mismatch
from quire._format.chunkid import Ref, crc_hex, trailer_hex
from quire._format.chunkindex import parse_index
from quire._format.crc import ChunkError, crc32c
from quire._runtime.ioloop import run_blocking
from quire._tiers import ownership

__all__ = ["ChunkChecks"]


class ChunkChecks:
    """The checks of one agreed step's reads; ``read_index(owner)`` returns (awaitable)
    that owner's chunk index bytes, already checked (:meth:`check_index`)."""

    def __init__(
        self,
        doc: Mapping[str, Any],
        url: str,
        primary: int,
        read_index: Callable[[int], Awaitable[bytes]],
    ) -> None:
        self.doc, self.url, self.primary = doc, url, primary
        self._read_index = read_index
        self._refs: dict[int, asyncio.Future[dict[str, list[tuple[int, int, str, Ref]]]]] = {}
        self._index_keys = {str(e["object"]): int(e["process"]) for e in doc.get("indexes") or []}

    def index_owner(self, key: str) -> int | None:
        """The owner whose chunk index ``key`` is (None: not an index)."""
        return self._index_keys.get(key)

    def check_index(self, owner: int, data: bytes) -> None:
        entry = ownership.entry_of(self.doc, owner)
        assert entry is not None
        parse_index(data, entry, self.url, self.doc["txids"])

    def check_unit(self, key: str, data: bytes) -> None:
        try:
            _check_unit_object(data)
        except ValueError as e:
            raise ChunkError(f"{key}: {e}") from e

    async def _by_pack(self, owner: int) -> dict[str, list[tuple[int, int, str, Ref]]]:
        entry = ownership.entry_of(self.doc, owner)
        if entry is None:
            return {}
        refs = parse_index(await self._read_index(owner), entry, self.url, self.doc["txids"])
        out: dict[str, list[tuple[int, int, str, Ref]]] = {}
        for key, ref in refs.items():
            if ref.target is not None:
                out.setdefault(ref.target, []).append((ref.offset, ref.length, key, ref))
        for rs in out.values():
            rs.sort(key=lambda r: r[:2])
        return out

    async def check_range(self, pack: str, start: int, views: Sequence[memoryview], n: int) -> int:
        """Check every chunk the bytes ``[start, start + n)`` of ``pack`` (in ``views``)
        hold whole, in the I/O pool; the number checked.  Raises ``ChunkError`` for the
        first that fails."""
        owner = ownership.owner_of(pack, self.primary)
        if owner not in self._refs:
            self._refs[owner] = asyncio.ensure_future(self._by_pack(owner))
        rs = (await asyncio.shield(self._refs[owner])).get(pack, [])
        first = bisect.bisect_left(rs, (start, -1))
        if first == len(rs) or rs[first][0] + rs[first][1] > start + n:
            return 0
        return await run_blocking(_check_chunks, rs[first:], start, views, n)


def _check_chunks(
    rs: Sequence[tuple[int, int, str, Ref]], start: int, views: Sequence[memoryview], n: int
) -> int:
    flat = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
    starts, pos = [], start
    for v in flat:
        starts.append(pos)
        pos += v.nbytes
    end, done = start + n, 0
    for off, length, key, ref in rs:
        if off + length > end:
            break
        _check_chunk(ref, key, _pieces(flat, starts, off, length), length)
        done += 1
    return done


def _pieces(
    flat: Sequence[memoryview], starts: Sequence[int], off: int, length: int
) -> list[memoryview]:
    """The bytes ``[off, off + length)`` of the views, as slices of them (no copy)."""
    out = []
    i = bisect.bisect_right(starts, off) - 1
    pos = off
    while pos < off + length:
        v, s = flat[i], starts[i]
        piece = v[pos - s : off + length - s]
        out.append(piece)
        pos += piece.nbytes
        i += 1
    return out


def _check_chunk(ref: Ref, key: str, views: Sequence[memoryview], n: int) -> None:
    """``chunkcheck.check_stored`` of a chunk held in several views (its bytes, then often
    its 4-byte trailer in a buffer of its own): no copy unless the message itself is split."""
    if not ref.trailer:
        check_read(ref, key, views, n)  # the CRC-32 of the bytes (and a shard's trailers)
        return
    if trailer_hex(views, n) != ref.crc:
        raise mismatch(ref, key)
    body = n - 4
    msg = views[0][:body] if views[0].nbytes >= body else memoryview(_gather(views, body))
    if crc_hex(crc32c(msg)) != ref.crc:
        raise ChunkError(f"{key}: crc32c checksum mismatch")


def _gather(views: Sequence[memoryview], n: int) -> bytes:
    out = bytearray()
    for v in views:
        if len(out) >= n:
            break
        out += v[: n - len(out)]
    return bytes(out)
