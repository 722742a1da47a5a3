"""acme-quire-plugin: one of each kind of quire plugin.

* ``AcmeBackend`` — ``acme://bucket/prefix`` URLs, stored in the process's memory in
  namespaces chosen by the ``service`` storage option (a stand-in for a storage service).
* ``xor_codec`` / ``XorCodec`` — a zarr v3 bytes-to-bytes codec (XOR with a key byte).
* ``round_codec`` / ``RoundCodec`` — a zarr v3 array-to-array codec, lossy: floats rounded to
  a number of decimals (it declares ``lossy = True``, so ``quire info`` marks it).
* ``MoneyHandler`` — a leaf handler for the ``Money`` class, stored inline in quire.json.
* ``TapeHandler`` — a leaf handler for the ``Tape`` class, stored as one data object per
  leaf with a crc32 trailer; it tells ``quire verify`` and ``quire cp`` how to check it.
* ``RandomHandler`` — a checkpointable handler for ``random.Random``, a type this package
  does not own: the generator's state is written as a file under the unit's sub-prefix.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, ClassVar

import numpy as np
from zarr.abc.codec import ArrayArrayCodec, BytesBytesCodec
from zarr.core.buffer import Buffer as ZarrBuffer
from zarr.core.buffer import NDBuffer

from quire.backends import Backend, Buffer, Capabilities, PreconditionFailed
from quire.handlers import LoadContext, LoadEntry, SaveContext, SaveEntry, StoredObject

__all__ = [
    "AcmeBackend",
    "Money",
    "MoneyHandler",
    "RandomHandler",
    "RoundCodec",
    "Tape",
    "TapeHandler",
    "XorCodec",
    "round_codec",
    "xor_codec",
]


# -- backend ------------------------------------------------------------------------------
_services: dict[str, dict[str, tuple[bytes, str]]] = {}  # service -> key -> (data, version)
_lock = threading.Lock()
_versions = itertools.count(1)


class AcmeBackend(Backend):
    """``acme://bucket/prefix``; storage option ``service`` names the namespace."""

    capabilities = Capabilities(atomic_create=True, atomic_replace=True)

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(url, storage_options)
        with _lock:
            self._store = _services.setdefault(str(self.storage_options.get("service", "")), {})
        self._root = url.split("://", 1)[1].strip("/")

    def _k(self, key: str) -> str:
        return f"{self._root}/{key}"

    def _put(self, key: str, data: bytes) -> str:
        v = str(next(_versions))
        self._store[self._k(key)] = (data, v)
        return v

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        with _lock:
            hit = self._store.get(self._k(key))
        if hit is None:
            raise FileNotFoundError(f"acme://{self._k(key)}")
        return hit[0][start:end]

    async def size(self, key: str) -> int:
        return len(await self.get(key))

    async def exists(self, key: str) -> bool:
        with _lock:
            return self._k(key) in self._store

    async def version(self, key: str) -> str | None:
        with _lock:
            hit = self._store.get(self._k(key))
        return None if hit is None else hit[1]

    async def list(self, prefix: str = "") -> list[str]:
        base = self._k(prefix.strip("/")) if prefix.strip("/") else self._root
        n = len(self._root) + 1
        with _lock:
            keys = [k for k in self._store if k == base or k.startswith(base + "/")]
        return sorted(k[n:] for k in keys if k != self._root)

    async def put(self, key: str, data: Sequence[Buffer]) -> None:
        blob = b"".join(bytes(memoryview(d).cast("B")) for d in data)
        with _lock:
            self._put(key, blob)

    async def put_if_absent(self, key: str, data: bytes) -> str:
        with _lock:
            if self._k(key) in self._store:
                raise PreconditionFailed(f"acme://{self._k(key)} exists")
            return self._put(key, bytes(data))

    async def replace_if_match(self, key: str, data: bytes, version: str) -> str:
        with _lock:
            hit = self._store.get(self._k(key))
            if hit is None or hit[1] != version:
                raise PreconditionFailed(f"acme://{self._k(key)} changed or vanished")
            return self._put(key, bytes(data))

    async def delete(self, keys: Sequence[str]) -> None:
        with _lock:
            for k in keys:
                self._store.pop(self._k(k), None)


# -- codec --------------------------------------------------------------------------------
@dataclass(frozen=True)
class XorCodec(BytesBytesCodec):
    """XOR every byte with ``key`` (a toy: it shows the codec contract, not compression)."""

    is_fixed_size = True
    key: int = 0x5A

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> XorCodec:
        return cls(**dict(data.get("configuration") or {}))

    def to_dict(self) -> dict[str, Any]:
        return {"name": "acme-xor", "configuration": {"key": self.key}}

    def _xor(self, buf: ZarrBuffer) -> ZarrBuffer:
        arr = np.frombuffer(buf.as_numpy_array().tobytes(), np.uint8) ^ np.uint8(self.key)
        return type(buf).from_bytes(arr.tobytes())

    def _encode_sync(self, chunk_bytes: ZarrBuffer, chunk_spec: Any) -> ZarrBuffer:
        return self._xor(chunk_bytes)

    def _decode_sync(self, chunk_bytes: ZarrBuffer, chunk_spec: Any) -> ZarrBuffer:
        return self._xor(chunk_bytes)

    async def _encode_single(self, chunk_bytes: ZarrBuffer, chunk_spec: Any) -> ZarrBuffer:
        return await asyncio.to_thread(self._encode_sync, chunk_bytes, chunk_spec)

    async def _decode_single(self, chunk_bytes: ZarrBuffer, chunk_spec: Any) -> ZarrBuffer:
        return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)

    def compute_encoded_size(self, input_byte_length: int, chunk_spec: Any) -> int:
        return input_byte_length


def xor_codec(key: int = 0x5A, **_: Any) -> XorCodec:
    """The ``acme-xor`` codec factory (quire.codecs entry point)."""
    if not isinstance(key, int) or not 0 <= key <= 255:
        raise ValueError(f"acme-xor: key must be a byte, got {key!r}")
    from zarr.registry import register_codec

    register_codec("acme-xor", XorCodec)  # zarr read its entry points before we were installed
    return XorCodec(key=key)


@dataclass(frozen=True)
class RoundCodec(ArrayArrayCodec):
    """Round floating-point chunks to ``decimals`` decimal places (computed in float64).

    Lossy: a load gives back each value within ``0.5 * 10**-decimals`` (plus the rounding
    of the result to the array's own dtype), not the value saved.  It implements only
    zarr's async methods; quire runs them on its worker threads.
    """

    is_fixed_size = True
    lossy: ClassVar[bool] = True  # quire records it and `quire info` marks it
    decimals: int = 2

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoundCodec:
        return cls(**dict(data.get("configuration") or {}))

    def to_dict(self) -> dict[str, Any]:
        return {"name": "acme-round", "configuration": {"decimals": self.decimals}}

    def validate(self, *, shape: Any, dtype: Any, chunk_grid: Any) -> None:
        native = np.dtype(dtype.to_native_dtype())
        if native.kind != "f":
            raise TypeError(f"acme-round rounds float16/32/64 arrays, not {native}")

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: Any) -> NDBuffer:
        a = chunk_array.as_numpy_array()
        rounded = np.round(a.astype(np.float64), self.decimals).astype(a.dtype)
        return type(chunk_array).from_numpy_array(rounded)

    async def _decode_single(self, chunk_array: NDBuffer, chunk_spec: Any) -> NDBuffer:
        return chunk_array  # the rounded values are the values

    def compute_encoded_size(self, input_byte_length: int, chunk_spec: Any) -> int:
        return input_byte_length


def round_codec(decimals: int = 2, **_: Any) -> RoundCodec:
    """The ``acme-round`` codec factory (quire.codecs entry point)."""
    if not isinstance(decimals, int) or not 0 <= decimals <= 15:
        raise ValueError(f"acme-round: decimals must be an int from 0 to 15, got {decimals!r}")
    from zarr.registry import register_codec

    register_codec("acme-round", RoundCodec)  # as xor_codec does
    return RoundCodec(decimals=decimals)


# -- leaf handler -------------------------------------------------------------------------
@dataclass(frozen=True)
class Money:
    amount: Decimal
    currency: str


class MoneyHandler:
    """``Money`` leaves, inline in quire.json: ``{"amount": "9.99", "currency": "EUR"}``."""

    id = "acme-money"
    types = (Money,)

    def handles(self, value: Any) -> bool:
        return isinstance(value, Money)

    def handles_abstract(self, abstract: Any) -> bool:
        return abstract is Money or isinstance(abstract, Money)

    def snapshot(self, entries: Sequence[SaveEntry]) -> list[SaveEntry]:
        return list(entries)  # Money is immutable

    async def save(self, entries: Sequence[SaveEntry], ctx: SaveContext) -> list[dict[str, Any]]:
        return [{"amount": str(e.value.amount), "currency": e.value.currency} for e in entries]

    def check(self, entry: LoadEntry) -> str | None:
        t = entry.target
        if t is None or t is Money or isinstance(t, Money):
            return None
        return f"saved Money, target {type(t).__name__}"

    async def load(self, entries: Sequence[LoadEntry], ctx: LoadContext) -> list[Any]:
        return [Money(Decimal(e.record["amount"]), str(e.record["currency"])) for e in entries]

    def metadata(self, records: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [Money for _ in records]


@dataclass(frozen=True)
class Tape:
    data: bytes


def _check_tape(blob: bytes) -> None:
    if len(blob) < 4 or zlib.crc32(blob[:-4]).to_bytes(4, "little") != blob[-4:]:
        raise ValueError("crc32 mismatch")


class TapeHandler:
    """``Tape`` leaves: ``<location>/tape`` holds the bytes and their crc32 (little endian)."""

    id = "acme-tape"
    types = (Tape,)

    def handles(self, value: Any) -> bool:
        return isinstance(value, Tape)

    def handles_abstract(self, abstract: Any) -> bool:
        return abstract is Tape or isinstance(abstract, Tape)

    def snapshot(self, entries: Sequence[SaveEntry]) -> list[SaveEntry]:
        return list(entries)  # Tape is immutable

    async def save(self, entries: Sequence[SaveEntry], ctx: SaveContext) -> list[dict[str, Any]]:
        async def one(e: SaveEntry) -> dict[str, Any]:
            data = e.value.data
            await ctx.backend.put(
                f"{e.location}/tape", [data, zlib.crc32(data).to_bytes(4, "little")]
            )
            return {"location": e.location, "nbytes": len(data)}

        return list(await asyncio.gather(*(one(e) for e in entries)))

    def check(self, entry: LoadEntry) -> str | None:
        return None

    async def load(self, entries: Sequence[LoadEntry], ctx: LoadContext) -> list[Any]:
        async def one(e: LoadEntry) -> Tape:
            blob = await ctx.backend.get(f"{e.record['location']}/tape")
            _check_tape(blob)
            return Tape(blob[:-4])

        return list(await asyncio.gather(*(one(e) for e in entries)))

    def metadata(self, records: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [Tape for _ in records]

    async def objects(
        self, entries: Sequence[LoadEntry], ctx: LoadContext
    ) -> list[list[StoredObject]]:
        """One object per leaf: its bytes plus the 4-byte trailer, checked by crc32."""
        return [
            [
                StoredObject(
                    f"{e.record['location']}/tape",
                    length=int(e.record["nbytes"]) + 4,
                    check=_check_tape,
                )
            ]
            for e in entries
        ]


# -- checkpointable handler -----------------------------------------------------------------
class RandomHandler:
    """``random.Random`` generators: their state in ``state.json`` under the unit's prefix."""

    id = "acme-random"

    def handles(self, obj: Any) -> bool:
        return type(obj) is random.Random

    def save(self, obj: random.Random, io: Any) -> Any:
        version, internal, gauss = obj.getstate()
        io.write_json("state.json", {"internal": list(internal), "gauss": gauss})
        return {"version": version}

    def load(self, io: Any, record: Any, target: Any) -> random.Random:
        state = io.read_json("state.json")
        r = target if isinstance(target, random.Random) else random.Random()
        r.setstate((record["version"], tuple(state["internal"]), state["gauss"]))
        return r
