"""zarr v3 array layout: metadata, chunk encoding and region reads.

quire writes zarr v3 arrays itself (metadata + chunk objects), so that each process
writes exactly the chunks it owns, straight from device-shard memory, with no
read-modify-write.  The bytes are plain zarr v3: ``bytes`` (little endian), optional
bytes-to-bytes compressors (zarr's own codec objects), then ``crc32c``; or the whole
chain inside ``sharding_indexed`` when a device shard is split into inner chunks.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from quire import _progress
from quire._dtypes import dtype_name
from quire._io import run_blocking
from quire._tasks import for_each
from quire.backends import Backend, Buffer
from quire.handlers import StoredObject

_crc32c: Any
try:
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - crc32c is a dependency; google-crc32c comes with zarr
    import google_crc32c

    _crc32c = google_crc32c.value


_U64_MAX = 2**64 - 1
MAX_OPEN_CHUNKS = 64  # concurrent chunk reads/writes per array operation


class ChunkError(ValueError):
    """A chunk failed verification (bad checksum, wrong size, missing, undecodable)."""


def _bytes_view(arr: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy)."""
    if not arr.size:
        return memoryview(bytearray())
    return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def crc32c(data: Any) -> int:
    return int(_crc32c(memoryview(data).cast("B")))


def crc_bytes(data: Any) -> bytes:
    return crc32c(data).to_bytes(4, "little")


def _le(arr: np.ndarray) -> np.ndarray:
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and np.little_endian is False):
        return arr.astype(arr.dtype.newbyteorder("<"))
    return arr


def fill_json(dtype: np.dtype[Any]) -> Any:
    if dtype.kind == "b":
        return False
    if dtype.kind == "c":
        return [0.0, 0.0]
    if dtype.kind in "iu":
        return 0
    return 0.0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ArrayLayout:
    """Shape, dtype, chunk grid and codec chain of one stored array."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    chunk_shape: tuple[int, ...]
    inner_shape: tuple[int, ...] | None = None
    compressors: tuple[Any, ...] = ()  # zarr BytesBytesCodec instances
    checksum: bool = True

    # -- geometry ------------------------------------------------------------------
    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(_ceil_div(s, c) if s else 0 for s, c in zip(self.shape, self.chunk_shape))

    @property
    def inner_grid(self) -> tuple[int, ...]:
        assert self.inner_shape is not None
        return tuple(c // i for c, i in zip(self.chunk_shape, self.inner_shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def all_chunks(self) -> Iterator[tuple[int, ...]]:
        return itertools.product(*(range(g) for g in self.grid))

    def chunk_key(self, coords: Sequence[int]) -> str:
        return "/".join(("c", *map(str, coords)))

    def chunk_region(self, coords: Sequence[int]) -> tuple[slice, ...]:
        return tuple(
            slice(i * c, min((i + 1) * c, s))
            for i, c, s in zip(coords, self.chunk_shape, self.shape)
        )

    def chunks_in(self, region: Sequence[slice]) -> Iterator[tuple[int, ...]]:
        ranges = []
        for r, c in zip(region, self.chunk_shape):
            if r.stop <= r.start:
                return iter(())
            ranges.append(range(r.start // c, _ceil_div(r.stop, c)))
        return itertools.product(*ranges)

    @property
    def fast(self) -> bool:
        """Raw bytes (+ crc): chunks can be read straight into their destination."""
        return not self.compressors

    def encoded_size(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape) * self.dtype.itemsize + (4 if self.checksum else 0)

    # -- metadata ------------------------------------------------------------------
    def _chain(self) -> list[dict[str, Any]]:
        chain: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
        chain += [c.to_dict() for c in self.compressors]
        if self.checksum:
            chain.append({"name": "crc32c"})
        return chain

    def codecs_json(self) -> list[dict[str, Any]]:
        if self.inner_shape is None:
            return self._chain()
        index = [{"name": "bytes", "configuration": {"endian": "little"}}]
        if self.checksum:
            index.append({"name": "crc32c"})
        return [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(self.inner_shape),
                    "codecs": self._chain(),
                    "index_codecs": index,
                    "index_location": "end",
                },
            }
        ]

    def zarr_json(self, attributes: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": dtype_name(self.dtype),
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": list(self.chunk_shape)},
            },
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": fill_json(self.dtype),
            "codecs": self.codecs_json(),
            "attributes": attributes or {},
        }

    # -- encoding ------------------------------------------------------------------
    def _spec(self, shape: tuple[int, ...]) -> Any:
        from zarr.core.array_spec import ArrayConfig, ArraySpec
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.dtype import get_data_type_from_native_dtype

        return ArraySpec(
            shape=shape,
            dtype=get_data_type_from_native_dtype(self.dtype),
            fill_value=np.zeros((), self.dtype)[()],
            config=ArrayConfig(order="C", write_empty_chunks=True),
            prototype=default_buffer_prototype(),
        )

    def _encode_one(self, arr: np.ndarray) -> list[Buffer]:
        """Encode one (inner) chunk of exactly its chunk shape; returns buffers."""
        arr = np.ascontiguousarray(_le(arr))
        raw = _bytes_view(arr)
        if not self.compressors:
            return [raw, crc_bytes(raw)] if self.checksum else [raw]
        from zarr.core.buffer.cpu import Buffer as ZBuffer

        spec = self._spec(arr.shape)
        buf = ZBuffer.from_bytes(raw.tobytes())
        for c in self.compressors:
            buf = c._encode_sync(buf, spec)
        data = buf.to_bytes()
        return [data, crc_bytes(data)] if self.checksum else [data]

    def encode_chunk(self, arr: np.ndarray) -> list[Buffer]:
        """Encode a full chunk (already padded to ``chunk_shape``) into buffers to write."""
        assert arr.shape == self.chunk_shape, (arr.shape, self.chunk_shape)
        if self.inner_shape is None:
            return self._encode_one(arr)
        out: list[Buffer] = []
        index = np.empty((*self.inner_grid, 2), dtype="<u8")
        offset = 0
        for coords in itertools.product(*(range(g) for g in self.inner_grid)):
            sl = tuple(slice(i * s, (i + 1) * s) for i, s in zip(coords, self.inner_shape or ()))
            bufs = self._encode_one(arr[sl])
            n = sum(memoryview(b).nbytes for b in bufs)
            index[coords] = (offset, n)
            offset += n
            out += bufs
        ib = index.tobytes()
        out.append(ib)
        if self.checksum:
            out.append(crc_bytes(ib))
        return out

    def _decode_one(self, data: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        mv = memoryview(data).cast("B")
        if self.checksum:
            if mv.nbytes < 4:
                raise ChunkError(f"truncated: {mv.nbytes} bytes")
            body, stored = mv[:-4], bytes(mv[-4:])
            if crc_bytes(body) != stored:
                raise ChunkError("crc32c checksum mismatch")
            mv = body
        if self.compressors:
            from zarr.core.buffer.cpu import Buffer as ZBuffer

            spec = self._spec(shape)
            buf = ZBuffer.from_bytes(mv.tobytes())
            try:
                for c in reversed(self.compressors):
                    buf = c._decode_sync(buf, spec)
            except Exception as e:
                raise ChunkError(f"cannot decode: {e}") from e
            mv = memoryview(buf.to_bytes())
        want = math.prod(shape) * self.dtype.itemsize
        if mv.nbytes != want:
            raise ChunkError(f"size {mv.nbytes} bytes, expected {want}")
        return np.frombuffer(mv, dtype=self.dtype.newbyteorder("<")).reshape(shape)


def pad_to(arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``arr`` zero-padded at the end of each axis to ``shape`` (edge chunks are full-size)."""
    if arr.shape == shape:
        return arr
    out = np.zeros(shape, arr.dtype)
    out[tuple(slice(0, s) for s in arr.shape)] = arr
    return out


def inner_chunks_for(shape: tuple[int, ...], itemsize: int, target: int) -> tuple[int, ...] | None:
    """An inner chunk shape dividing ``shape`` with at most ``target`` bytes, split along
    leading axes first (so inner chunks of a C-contiguous shard stay contiguous), or None
    when the shard is small enough or no reasonable divisor exists."""
    nbytes = math.prod(shape) * itemsize
    if not shape or nbytes <= target:
        return None
    inner = list(shape)
    for ax in range(len(shape)):
        row = math.prod(inner[ax + 1 :]) * itemsize
        if row * 1 > target and ax + 1 < len(shape):
            inner[ax] = 1
            continue
        best = 1
        for d in range(1, shape[ax] + 1):
            if shape[ax] % d == 0 and d * row <= target:
                best = d
        inner[ax] = best
        break
    size = math.prod(inner) * itemsize
    if size * 64 < target or inner == list(shape):
        return None  # only tiny divisors: one big chunk beats thousands of tiny ones
    return tuple(inner)


async def write_chunk(
    backend: Backend, location: str, layout: ArrayLayout, coords: tuple[int, ...], data: np.ndarray
) -> int:
    """Encode and write one chunk (``data`` is the unpadded shard); returns bytes written."""

    def enc() -> list[Buffer]:
        return layout.encode_chunk(pad_to(data, layout.chunk_shape))

    bufs = await run_blocking(enc)
    await backend.put(f"{location}/{layout.chunk_key(coords)}", bufs)
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


async def _read_raw_into(
    backend: Backend, key: str, layout: ArrayLayout, dest: np.ndarray, offset: int | None = None
) -> None:
    """Read an uncompressed (inner) chunk straight into C-contiguous ``dest`` and verify."""
    body = _bytes_view(dest)
    tail = bytearray(5 if layout.checksum else 1)
    n = await backend.get_into(key, [body, memoryview(tail)], offset or 0)
    want = body.nbytes + (4 if layout.checksum else 0)
    if n < want:
        raise ChunkError(f"truncated: {n} bytes, expected {want}")
    if offset is None and n > want:  # a whole object, not a range of a zarr shard
        raise ChunkError(f"too long: more than {want} bytes")
    if layout.checksum:
        crc = await run_blocking(crc_bytes, body)
        if crc != bytes(tail[:4]):
            raise ChunkError("crc32c checksum mismatch")


_NOT_DATA = {errno.EISDIR, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG}


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
        # symbolic link (refused by the local backend) or a name too long: not transient.
        if e.errno in _NOT_DATA:
            raise ChunkError(f"not a chunk object ({e.strerror})") from e
        raise


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
    if off == _U64_MAX and nb == _U64_MAX:
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
    sub = ArrayLayout(
        layout.chunk_shape, layout.dtype, inner, None, layout.compressors, layout.checksum
    )
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
    sub = ArrayLayout(
        layout.chunk_shape, layout.dtype, inner, None, layout.compressors, layout.checksum
    )

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

    await asyncio.gather(*(one(ic) for ic in sub.chunks_in(local)))


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
