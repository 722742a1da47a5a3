"""zarr v3 array layout: metadata, chunk encoding and region reads.

quire writes zarr v3 arrays itself (metadata + chunk objects), so that each process
writes exactly the chunks it owns, straight from device-shard memory, with no
read-modify-write.  The bytes are plain zarr v3: optional array-to-array codecs, ``bytes``
(little endian), optional bytes-to-bytes codecs (zarr's own codec objects, numcodecs' through
zarr), then ``crc32c``; or the whole chain inside ``sharding_indexed`` when a device shard is
split into inner chunks (:mod:`quire._handlers.chain`).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from quire._format.crc import U64_MAX, ChunkError, bytes_view, crc_bytes
from quire._handlers.base import StoredObject
from quire._handlers.zarr_layout import (
    MAX_OPEN_CHUNKS,
    ArrayLayout,
    pad_to,
)
from quire._runtime import progress as _progress
from quire._runtime.ioloop import run_blocking
from quire._runtime.tasks import for_each, gather_cancelling
from quire._store.base import NOT_DATA, Backend, Buffer


async def write_chunk(
    backend: Backend, location: str, layout: ArrayLayout, coords: tuple[int, ...], data: np.ndarray
) -> int:
    """Encode and write one chunk (``data`` is the unpadded shard); returns bytes written."""

    def enc() -> list[Buffer]:
        return layout.encode_chunk(pad_to(data, layout.chunk_shape))

    bufs = await run_blocking(enc)
    key = f"{location}/{layout.chunk_key(coords)}"
    bound = getattr(backend, "put_bound", None)  # format v2's pack writer (quire._format.pack)
    if bound is not None and layout.checksum and layout.inner_shape is None:
        # The chunk ends with its crc32c and every reader checks it: the index binds it
        # by that trailer (quire._format.chunkid), so no identity pass over its bytes.
        await bound(key, bufs, trailer=True)
    elif bound is not None and layout.checksum:  # a zarr shard: its trailers bound too
        await bound(key, bufs, shard=math.prod(layout.inner_grid))
    else:
        await backend.put(key, bufs)
    _progress.advance(data.nbytes)
    return sum(memoryview(b).nbytes for b in bufs)


def _intersect(a: Sequence[slice], b: Sequence[slice]) -> tuple[slice, ...] | None:
    out = []
    for x, y in zip(a, b):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if hi <= lo:
            return None
        out.append(slice(lo, hi))
    return tuple(out)


def _shift(region: Sequence[slice], origin: Sequence[int]) -> Any:
    # An empty index would make numpy return a scalar copy of a 0-d array, not a view.
    return tuple(slice(r.start - o, r.stop - o) for r, o in zip(region, origin)) or Ellipsis


_INLINE_CRC = 256 << 10  # bytes


async def _read_raw_into(
    backend: Backend, key: str, layout: ArrayLayout, dest: np.ndarray, offset: int | None = None
) -> None:
    """Read an uncompressed (inner) chunk straight into C-contiguous ``dest`` and verify."""
    body = bytes_view(dest)
    # A whole object is read one byte long, to tell a too-long object; a range of a zarr
    # shard is read exactly (the shard index gave its length).
    tail = bytearray((4 if layout.checksum else 0) + (1 if offset is None else 0))
    views = [body, memoryview(tail)] if tail else [body]
    n = await backend.get_into(key, views, offset or 0)
    want = body.nbytes + (4 if layout.checksum else 0)
    if n < want:
        raise ChunkError(f"truncated: {n} bytes, expected {want}")
    if offset is None and n > want:  # a whole object, not a range of a zarr shard
        raise ChunkError(f"too long: more than {want} bytes")
    if layout.checksum:
        # A small chunk's crc32c costs less than a trip to a worker thread.
        crc = crc_bytes(body) if body.nbytes < _INLINE_CRC else await run_blocking(crc_bytes, body)
        if crc != bytes(tail[:4]):
            raise ChunkError("crc32c checksum mismatch")


async def _read_chunk_region(
    backend: Backend,
    location: str,
    layout: ArrayLayout,
    coords: tuple[int, ...],
    region: tuple[slice, ...],
    out: np.ndarray,
) -> None:
    """Copy the part of chunk ``coords`` that overlaps ``region`` into ``out`` (region-shaped)."""
    key = f"{location}/{layout.chunk_key(coords)}"
    creg = layout.chunk_region(coords)
    ov = _intersect(creg, region)
    if ov is None:
        return
    dest = out[_shift(ov, [r.start for r in region])]
    corigin = [r.start for r in creg]
    try:
        if layout.inner_shape is None:
            full = (
                all((r.stop - r.start) == c for r, c in zip(creg, layout.chunk_shape))
                and ov == creg
            )
            if layout.fast and full and dest.flags.c_contiguous and dest.dtype == layout.dtype:
                await _read_raw_into(backend, key, layout, dest)
                return
            data = await backend.get(key)
            arr = await run_blocking(layout._decode_one, data, layout.chunk_shape)
            dest[...] = arr[_shift(ov, corigin)]
            return
        await _read_sharded(backend, key, layout, corigin, ov, dest)
    except FileNotFoundError as e:
        raise ChunkError("missing chunk object") from e
    except OSError as e:
        # A location that names a directory, a file where a directory should be, a
        # symbolic link or FIFO (refused by the local backend), a name too long: not transient.
        if e.errno in NOT_DATA:
            raise ChunkError(f"not a chunk object ({e.strerror})") from e
        raise


def inner_layout(layout: ArrayLayout) -> ArrayLayout:
    """The layout of one zarr shard of ``layout`` cut into its inner chunks."""
    assert layout.inner_shape is not None
    return replace(
        layout, shape=layout.chunk_shape, chunk_shape=layout.inner_shape, inner_shape=None
    )


def _index_bytes(layout: ArrayLayout) -> int:
    """Size of a zarr shard's index (at its end): 16 bytes per inner chunk, + crc32c."""
    return math.prod(layout.inner_grid) * 16 + (4 if layout.checksum else 0)


def _shard_index(layout: ArrayLayout, raw: bytes) -> np.ndarray:
    """The ``(n, 2)`` (offset, nbytes) rows of a shard index, its crc32c checked."""
    if layout.checksum:
        if crc_bytes(raw[:-4]) != raw[-4:]:
            raise ChunkError("crc32c checksum mismatch in shard index")
        raw = raw[:-4]
    return np.frombuffer(raw, dtype="<u8").reshape(-1, 2)


def _inner_span(row: Any, which: Any, limit: int) -> tuple[int, int]:
    """``(offset, nbytes)`` of an inner chunk from its index row, inside ``limit`` bytes."""
    off, nb = (int(v) for v in row)
    if off == U64_MAX and nb == U64_MAX:
        raise ChunkError(f"inner chunk {which} missing from shard")
    if off + nb > limit:
        raise ChunkError(f"inner chunk {which} lies outside the shard")
    return off, nb


def chunk_checker(layout: ArrayLayout) -> Callable[[bytes], None]:
    """``check(data)``: decode-and-verify one stored chunk (or zarr shard) of ``layout``;
    raises :class:`ChunkError` (a ``ValueError``) naming what is wrong."""
    if layout.inner_shape is None:

        def check_chunk(data: bytes) -> None:
            try:
                layout._decode_one(data, layout.chunk_shape)
            except ChunkError:
                raise
            except Exception as e:
                raise ChunkError(f"undecodable: {e}") from e

        return check_chunk

    inner = layout.inner_shape
    sub = inner_layout(layout)
    ilen = _index_bytes(layout)

    def check(data: bytes) -> None:
        if len(data) < ilen:
            raise ChunkError(f"truncated shard: {len(data)} bytes")
        for i, row in enumerate(_shard_index(layout, data[len(data) - ilen :])):
            off, nb = _inner_span(row, i, len(data) - ilen)
            try:
                sub._decode_one(memoryview(data)[off : off + nb], inner)
            except ChunkError as e:
                raise ChunkError(f"inner chunk {i}: {e}") from e
            except Exception as e:
                raise ChunkError(f"inner chunk {i} undecodable: {e}") from e

    return check


def metadata_checker(layout: ArrayLayout) -> Callable[[bytes], None]:
    """``check(data)`` of an array's ``zarr.json``: JSON, a zarr v3 array of the recorded
    shape (what zarr readers open)."""

    def check(data: bytes) -> None:
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise ChunkError(f"zarr.json is not JSON: {e}") from e
        if not isinstance(doc, dict) or doc.get("zarr_format") != 3:
            raise ChunkError("zarr.json is not zarr v3 array metadata")
        if doc.get("node_type") != "array" or doc.get("shape") != list(layout.shape):
            raise ChunkError(
                f"zarr.json describes shape {doc.get('shape')!r}, the record {list(layout.shape)}"
            )

    return check


def array_objects(layout: ArrayLayout, location: str) -> list[StoredObject]:
    """What an array leaf at ``location`` owns: its ``zarr.json`` and every chunk, checked."""
    out = [StoredObject(f"{location}/zarr.json", check=metadata_checker(layout))]
    if not math.prod(layout.shape):
        return out
    check = chunk_checker(layout)
    size = layout.encoded_size(layout.chunk_shape)
    if layout.inner_shape is not None:
        size += _index_bytes(layout)
    return out + [
        StoredObject(f"{location}/{layout.chunk_key(c)}", check=check, size=size)
        for c in layout.all_chunks()
    ]


async def _read_sharded(
    backend: Backend,
    key: str,
    layout: ArrayLayout,
    corigin: list[int],
    ov: tuple[slice, ...],
    dest: np.ndarray,
) -> None:
    assert layout.inner_shape is not None
    inner = layout.inner_shape
    ng = layout.inner_grid
    ilen = _index_bytes(layout)
    size = await backend.size(key)
    if size < ilen:
        raise ChunkError(f"truncated shard: {size} bytes")
    index = _shard_index(layout, await backend.get(key, size - ilen, size)).reshape((*ng, 2))
    local = tuple(slice(r.start - o, r.stop - o) for r, o in zip(ov, corigin))  # chunk coordinates
    sub = inner_layout(layout)

    async def one(ic: tuple[int, ...]) -> None:
        off, nb = _inner_span(index[ic], ic, size - ilen)
        ireg = sub.chunk_region(ic)
        iov = _intersect(ireg, local)
        assert iov is not None
        d = dest[_shift(iov, [r.start for r in local])]
        if sub.fast and iov == ireg and d.flags.c_contiguous and d.dtype == layout.dtype:
            if nb != sub.encoded_size(inner):
                raise ChunkError(
                    f"inner chunk {ic} has {nb} bytes, expected {sub.encoded_size(inner)}"
                )
            await _read_raw_into(backend, key, sub, d, off)
            return
        data = await backend.get(key, off, off + nb)
        arr = await run_blocking(sub._decode_one, data, inner)
        d[...] = arr[_shift(iov, [r.start for r in ireg])]

    await gather_cancelling(*(one(ic) for ic in sub.chunks_in(local)))


async def read_region(
    backend: Backend,
    location: str,
    layout: ArrayLayout,
    region: tuple[slice, ...],
    out: np.ndarray,
    *,
    sem: asyncio.Semaphore | None = None,
) -> None:
    """Fill ``out`` (shape of ``region``, dtype of the layout) from the stored chunks.

    Raises :class:`ChunkError` (with the chunk key) on any integrity failure.
    """
    if sem is None:
        sem = asyncio.Semaphore(MAX_OPEN_CHUNKS)

    async def one(coords: tuple[int, ...]) -> None:
        async with sem:
            try:
                await _read_chunk_region(backend, location, layout, coords, region, out)
            except ChunkError as e:
                raise ChunkError(f"chunk {location}/{layout.chunk_key(coords)}: {e}") from e

    if math.prod(layout.shape) == 0:
        return
    # Tasks are made lazily, a bounded number at a time: a record claiming millions of
    # chunks costs memory for the workers only, and the first failure stops the rest.
    counted = 0

    def counting() -> Iterator[tuple[int, ...]]:
        nonlocal counted
        for c in layout.chunks_in(region):
            counted += 1
            yield c

    await for_each(counting(), one, MAX_OPEN_CHUNKS)
    _progress.advance(out.nbytes, counted)
