"""zarr v3 array layout: ``ArrayLayout`` (metadata, chunk encoding) and its helpers
(split out of ``quire._handlers.zarr_io``, which re-exports what others import from there)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from quire._format.crc import ChunkError, bytes_view, crc_bytes
from quire._format.describe import codec_chain
from quire._format.dtypes import dtype_name
from quire._handlers import chain as _chain
from quire._handlers.codecs import brief
from quire._store.base import Buffer

MAX_OPEN_CHUNKS = 64  # concurrent chunk reads/writes per array operation


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
    compressors: tuple[Any, ...] = ()  # zarr BytesBytesCodec instances, after ``bytes``
    checksum: bool = True
    filters: tuple[Any, ...] = ()  # zarr ArrayArrayCodec instances, before ``bytes``

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
        return not self.compressors and not self.filters

    def encoded_size(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape) * self.dtype.itemsize + (4 if self.checksum else 0)

    # -- metadata ------------------------------------------------------------------
    def record_codecs(self) -> list[dict[str, Any]]:
        """The leaf record's ``codecs`` (:mod:`quire._format.codecrecord`)."""
        return _chain.Chain(self.filters, self.compressors).record()

    def codecs_json(self) -> list[dict[str, Any]]:
        return codec_chain(self.record_codecs(), self.checksum, self.inner_shape)

    def specs(self, shape: tuple[int, ...]) -> list[Any]:
        """The spec of a chunk of ``shape`` before each array-to-array codec, then (last)
        the one ``bytes`` encodes and the bytes-to-bytes codecs get."""
        return _chain.check_specs(self.filters, self._spec(shape))

    def lossy(self) -> tuple[str, ...]:
        """Names of the codecs that may not restore this array bit for bit."""
        if not self.filters and not self.compressors:
            return ()
        specs = self.specs(self.inner_shape or self.chunk_shape)
        return _chain.lossy(_chain.Chain(self.filters, self.compressors), specs)

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

        from quire._format import zarr_dtypes  # noqa: F401 - zarr must know ml_dtypes' types

        return ArraySpec(
            shape=shape,
            dtype=get_data_type_from_native_dtype(self.dtype),
            fill_value=np.zeros((), self.dtype)[()],
            config=ArrayConfig(order="C", write_empty_chunks=True),
            prototype=default_buffer_prototype(),
        )

    def _encode_one(self, arr: np.ndarray) -> list[Buffer]:
        """Encode one (inner) chunk of exactly its chunk shape; returns buffers."""
        spec = None
        if self.filters:
            specs = self.specs(arr.shape)
            arr, spec = _chain.apply_filters(self.filters, arr, specs), specs[-1]
        arr = np.ascontiguousarray(_le(arr))
        raw = bytes_view(arr)
        if not self.compressors:
            return [raw, crc_bytes(raw)] if self.checksum else [raw]
        from zarr.core.buffer.cpu import Buffer as ZBuffer

        spec = self._spec(arr.shape) if spec is None else spec
        buf = ZBuffer.from_array_like(np.frombuffer(raw, np.uint8))
        for c in self.compressors:
            buf = _chain.encode(c, buf, spec)
        data = bytes_view(buf.as_numpy_array())
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
        try:
            specs = self.specs(shape) if self.filters else None
        except Exception as e:  # the record was checked: only a codec's own failure
            raise ChunkError(f"cannot decode: {brief(e)}") from e
        dtype, bshape = self.dtype, shape
        if specs is not None:
            dtype, bshape = specs[-1].dtype.to_native_dtype(), tuple(specs[-1].shape)
        if self.compressors:
            from zarr.core.buffer.cpu import Buffer as ZBuffer

            spec = specs[-1] if specs is not None else self._spec(shape)
            buf = ZBuffer.from_array_like(np.frombuffer(mv, np.uint8))
            try:
                for c in reversed(self.compressors):
                    buf = _chain.decode(c, buf, spec)
            except Exception as e:
                raise ChunkError(f"cannot decode: {brief(e)}") from e
            mv = bytes_view(buf.as_numpy_array())
        want = math.prod(bshape) * dtype.itemsize
        if mv.nbytes != want:
            raise ChunkError(f"size {mv.nbytes} bytes, expected {want}")
        arr = np.frombuffer(mv, dtype=dtype.newbyteorder("<")).reshape(bshape)
        if specs is None:
            return arr
        try:
            return _chain.undo_filters(self.filters, arr, specs)
        except Exception as e:
            raise ChunkError(f"cannot decode: {brief(e)}") from e


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
