"""Format v2: the identity of zarr shards read by ranges (``quire.shards``, see
``quire._format.chunkid``).

A load reads a zarr shard by ranges: its shard index (the last ``16 n + 4`` bytes), then
the inner chunks it needs.  The chunk index binds each shard key, besides the CRC-32 of the
whole shard, to :func:`shard_binding`: the crc32c trailer of the shard index and of every
inner chunk.  :class:`ShardChecks` (one per ``PackedReader``) checks each range read of a
shard against it: the shard index when a range holds it (its rows are kept, the most recent
up to ``SHARD_ROWS`` in all), and the trailer of every inner chunk wholly in a range, at
the offset the checked index gives (the index is read first when the caller did not).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from quire._format.chunkid import Ref, ViewBytes, crc_hex, le_hex
from quire._format.crc import U64_MAX, ChunkError, crc32c

if TYPE_CHECKING:
    import numpy as np

SHARD_ROWS = 1 << 19  # checked shard-index rows a reader keeps (40 bytes each: 20 MiB)


def shard_binding(views: Sequence[memoryview], n: int, n_inner: int) -> str | None:
    """The ``quire.shards`` value of a zarr shard (``sharding_indexed``, index at the end,
    ``bytes`` + ``crc32c`` index codecs, inner chains ending with ``crc32c``): the hex of
    its last 4 bytes (the crc32c of the shard index), then of each inner chunk's last 4
    bytes (its own crc32c trailer) in shard-index order.  Taken from those bytes only (no
    pass).  None for a shard this binding cannot describe (an inner chunk missing)."""
    import numpy as np  # heavy: reading a commit record needs none of this module's arrays

    ilen = 16 * n_inner + 4
    if n_inner < 1 or n < ilen:
        return None
    data = ViewBytes(views)
    rows = np.frombuffer(data.take(n - ilen, ilen - 4), dtype="<u8").reshape(-1, 2)
    out = [data.trailer(n)]
    for off, nb in rows.tolist():
        if off == U64_MAX or nb < 4 or off + nb > n - ilen:
            return None
        out.append(data.trailer(off + nb))
    return "".join(out)


def valid_shard_binding(value: object) -> bool:
    if not isinstance(value, str) or len(value) < 16 or len(value) % 8:
        return False
    try:
        int(value, 16)
    except ValueError:
        return False
    return True


def shard_index_span(ref: Ref) -> tuple[int, int]:
    """``(start, end)`` of the shard index (with its crc32c) inside the stored shard."""
    assert ref.shard is not None
    return ref.length - 16 * (len(ref.shard) // 8 - 1) - 4, ref.length


class ShardRows:
    """A checked shard index: inner chunk ``i`` is ``[offsets[i], ends[i])`` of the shard;
    ``order`` sorts them by offset (for the lookup of the inner chunks in a range)."""

    def __init__(self, rows: np.ndarray) -> None:
        self.offsets = rows[:, 0]
        self.ends = rows[:, 0] + rows[:, 1]
        self.order = self.offsets.argsort(kind="stable")
        self.sorted = self.offsets[self.order]

    def __len__(self) -> int:
        return len(self.offsets)

    def inside(self, start: int, n: int) -> list[int]:
        """The inner chunks lying wholly in ``[start, start + n)``."""
        lo, hi = self.sorted.searchsorted([start, start + n], side="left")
        cand = self.order[lo:hi]
        return [int(i) for i in cand[self.ends[cand] <= start + n]]


def shard_rows(ref: Ref, key: str, views: Sequence[memoryview], start: int, n: int) -> ShardRows:
    """The ``(offset, nbytes)`` rows of the shard index in ``views`` (``n`` bytes of the
    shard read from ``start``, covering the whole index), checked against the binding: its
    crc32c trailer is the index's, and its crc32c is right; every row inside the shard."""
    assert ref.shard is not None
    a, b = shard_index_span(ref)
    if start > a or start + n < b or a < 0:
        raise ChunkError(f"{key}: the read does not cover the shard index")
    raw = ViewBytes(views).take(a - start, b - a)
    if le_hex(raw[-4:]) != ref.shard[:8]:
        raise _shard_mismatch(ref, key, "shard index")
    if crc_hex(crc32c(raw[:-4])) != ref.shard[:8]:
        raise ChunkError(f"{key}: crc32c checksum mismatch in shard index")
    import numpy as np  # heavy: see shard_binding

    rows = np.frombuffer(raw[:-4], dtype="<u8").reshape(-1, 2)
    if bool(((rows[:, 0] > a) | (rows[:, 1] < 4) | (rows[:, 1] > a - rows[:, 0])).any()):
        raise ChunkError(f"{key}: an inner chunk lies outside the shard")
    return ShardRows(rows)


def _shard_mismatch(ref: Ref, key: str, what: str) -> ChunkError:
    return ChunkError(
        f"{key}: {what} at {ref.target}[{ref.offset}:{ref.offset + ref.length}] does not "
        "match the chunk index (a moved, swapped or foreign zarr shard)"
    )


def check_shard_range(
    ref: Ref, key: str, rows: ShardRows, start: int, views: Sequence[memoryview], n: int
) -> None:
    """Compare the crc32c trailer of every inner chunk lying wholly in ``views`` (``n``
    bytes of the shard read from ``start``) with the binding; the decoder's crc32c check
    of each inner chunk binds the rest of it (as for a trailer-bound chunk)."""
    assert ref.shard is not None
    inside = rows.inside(start, n)
    if not inside:
        return
    data = ViewBytes(views)
    for i in inside:
        got = data.trailer(int(rows.ends[i]) - start)
        if got != ref.shard[8 * (i + 1) : 8 * (i + 2)]:
            raise _shard_mismatch(ref, key, f"inner chunk {i}")


def check_whole(ref: Ref, key: str, views: Sequence[memoryview], n: int) -> None:
    """The shard binding of a whole shard (verify, cp, finalize: also CRC-32-checked)."""
    check_shard_range(ref, key, shard_rows(ref, key, views, 0, n), 0, views, n)


class ShardChecks:
    """The identity checks of the range reads of zarr shards through one reader;
    ``read(ref, start, end)`` reads bytes ``[start, end)`` of a shard (its index)."""

    def __init__(self, read: Callable[[Ref, int, int], Awaitable[bytes]]) -> None:
        self._read = read
        self._rows: OrderedDict[str, tuple[asyncio.Future[ShardRows], int]] = OrderedDict()
        self._held = 0

    async def check(
        self, key: str, ref: Ref, start: int, views: Sequence[memoryview], n: int
    ) -> None:
        """Check ``n`` bytes of shard ``key`` read from ``start`` into ``views``."""
        a, b = shard_index_span(ref)
        held = self._rows.get(key)
        if start <= a and start + n >= b:
            rows = shard_rows(ref, key, views, start, n)
            if held is None or held[0].done():
                fut = asyncio.get_running_loop().create_future()
                fut.set_result(rows)
                self._keep(key, fut, len(rows))
        else:
            if held is None:
                fut = asyncio.ensure_future(self._index(key, ref))
                self._keep(key, fut, (b - a) // 16)
            else:
                fut = held[0]
                self._rows.move_to_end(key)
            try:
                rows = await asyncio.shield(fut)
            except BaseException:
                if key in self._rows and self._rows[key][0] is fut:
                    self._drop(key)
                raise
        check_shard_range(ref, key, rows, start, views, n)

    async def _index(self, key: str, ref: Ref) -> ShardRows:
        a, b = shard_index_span(ref)
        raw = await self._read(ref, a, b)
        if len(raw) != b - a:
            raise ChunkError(f"{key}: pack {ref.target} is truncated")
        return shard_rows(ref, key, [memoryview(raw)], a, len(raw))

    def _keep(self, key: str, fut: asyncio.Future[ShardRows], rows: int) -> None:
        if key in self._rows:
            self._drop(key)
        self._rows[key] = (fut, rows)
        self._held += rows
        while self._held > SHARD_ROWS and len(self._rows) > 1:
            self._drop(next(iter(self._rows)))

    def _drop(self, key: str) -> None:
        self._held -= self._rows.pop(key)[1]
