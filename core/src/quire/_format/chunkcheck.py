"""The identity check of a whole stored object read through a chunk index: a plain chunk's
binding (:mod:`quire._format.chunkid`) and, for a zarr shard, its shard binding
(:mod:`quire._format.shardid`).  Kept apart from both so that neither imports the other.
Also what a read of a key holding no data object at all (a link, a FIFO) becomes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from quire._format.chunkid import Ref, chunk_crc, crc_hex, trailer_hex
from quire._format.crc import ChunkError, crc32c
from quire._format.shardid import check_whole
from quire._store.base import NOT_DATA


def raise_not_data(e: OSError, key: str) -> NoReturn:
    """Raise ``e`` as a :class:`ChunkError` naming ``key`` when it says the key holds no
    data object (``quire._store.base.NOT_DATA``), else ``e`` itself (a storage error)."""
    if isinstance(e, FileNotFoundError) or e.errno not in NOT_DATA:
        raise e
    raise ChunkError(f"{key} is not a data object ({e.strerror})") from e


def mismatch(ref: Ref, key: str) -> ChunkError:
    return ChunkError(
        f"{key}: bytes at {ref.target}[{ref.offset}:{ref.offset + ref.length}] do not match "
        "the chunk index (a moved, swapped or foreign chunk)"
    )


def check_read(ref: Ref, key: str, views: Sequence[memoryview], n: int) -> None:
    """The check of a whole object read through the index, for a caller that decodes it
    (a trailer-bound chunk through its crc32c codec): the 4-byte trailer against the index,
    or the CRC-32 of the bytes (and a zarr shard's trailers, :func:`~quire._format.shardid.check_shard_range`)."""
    if ref.trailer:
        if trailer_hex(views, n) != ref.crc:
            raise mismatch(ref, key)
    elif crc_hex(chunk_crc(views, n)) != ref.crc:
        raise mismatch(ref, key)
    if ref.shard is not None and n == ref.length:
        check_whole(ref, key, views, n)


def check_stored(ref: Ref, key: str, data: memoryview) -> None:
    """The check of a whole object for a caller that may not decode it (copies): for a
    trailer-bound chunk the crc32c of its message against its trailer and the index, else
    the CRC-32 of the bytes.  One pass either way."""
    if not ref.trailer:
        check_read(ref, key, [data], data.nbytes)  # a zarr shard's trailers included
        return
    data = data.cast("B")
    if trailer_hex([data]) != ref.crc:
        raise mismatch(ref, key)
    if crc_hex(crc32c(data[:-4])) != ref.crc:
        raise ChunkError(f"{key}: crc32c checksum mismatch")
