"""Format v2: how the chunk index binds each stored object to its key (chunk identity).

Every key of a chunk index (``quire._chunkindex``) is bound to the exact bytes stored for
it, one of two ways:

* **trailer** (``quire.crc32c``, index format 3): a chunk whose array's codec chain ends
  with zarr's ``crc32c`` codec (quire's plain, non-sharded array chunks) ends with the
  crc32c of the bytes before it.  The index holds that value (8 hex digits: the trailer
  read as a little-endian u32).  A reader compares the chunk's last 4 bytes with it, and
  the decoder's crc32c check (which every path that reads such a chunk runs) binds the
  rest: a chunk passes both only if its bytes before the trailer have the crc32c the index
  names.  No pass over the bytes beyond the one the decoder makes anyway.
* **CRC-32** (``quire.crc32``, index formats 2 and 3): the CRC-32 (zlib's polynomial) of
  the whole stored object, for everything else: zarr shards (their last 4 bytes are the
  crc32c of the shard index only), arrays without a crc32c codec, ``zarr.json`` and other
  inline objects, a third-party handler's objects.  It is not crc32c on purpose: over a
  message followed by its own crc32c, crc32c is one constant (the CRC residue).

Where the crc32c of a trailer-bound chunk read through the index is checked (a new reader
of array chunks must decode them through ``quire._zarr`` or call :func:`check_stored`):

* loads, by every array handler (numpy, jax, prng_key; quire-torch through numpy), whole
  or resharded, and ``quire.open`` regions: ``_zarr.read_region`` -> ``_read_raw_into``
  (raw chunks read into place) or ``_decode_one`` (compressed chunks, partial chunks);
* ``quire verify``: ``handlers.check_objects`` runs ``_zarr.chunk_checker`` on each chunk;
* ``quire cp`` (packs copied as objects) and a finalize's pack rewrite, which need not
  decode: :func:`check_stored`, the crc32c of the message against the trailer and the
  index, one pass as for a CRC-32 (then ``chunk_checker``, as before).

``PackedReader`` (``quire._chunkindex``) compares the trailer (:func:`check_read`) on every
whole-object read; the tests in ``core/tests/test_chunkid.py`` forge a chunk whose trailer
still matches and check that each of these paths refuses it.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from quire._zarr_layout import _U64_MAX, ChunkError, crc32c

try:  # the same CRC-32 as zlib.crc32, several times faster (SIMD); zlib is the fallback
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency; a platform without it
    from zlib import crc32 as _crc32

INDEX_FORMAT = 2  # CRC-32 for every key (what quire wrote before the trailer binding)
TRAILER_FORMAT = 3  # adds quire.crc32c: keys bound by their chunk's own crc32c trailer
FORMATS = (INDEX_FORMAT, TRAILER_FORMAT)


def crc_hex(value: int) -> str:
    return f"{value:08x}"


@dataclass(frozen=True)
class Ref:
    """Where one zarr key's bytes are (a range of a pack, or inline bytes) and what binds
    them to the key: ``crc``, the CRC-32 of the bytes, or (``trailer``) their crc32c
    trailer."""

    target: str | None
    offset: int
    length: int
    crc: str
    inline: bytes | None = None
    trailer: bool = False
    shard: str | None = None  # a zarr shard's trailers (``quire.shards``), see shard_binding


def chunk_crc(views: Sequence[memoryview], n: int | None = None) -> int:
    """CRC-32 (zlib) of the first ``n`` bytes of ``views`` (all when None)."""
    crc = 0
    left = sum(v.nbytes for v in views) if n is None else n
    for v in views:
        if left <= 0:
            break
        part = v.cast("B")[: min(left, v.nbytes)]
        crc = _crc32(part, crc)
        left -= part.nbytes
    return crc


def trailer_hex(views: Sequence[memoryview], n: int | None = None) -> str | None:
    """The last 4 of the first ``n`` bytes of ``views`` (all when None) as the index
    writes a crc32c trailer; None when there are fewer than 4."""
    total = sum(v.nbytes for v in views) if n is None else n
    if total < 4:
        return None
    tail = bytearray()
    end = 0
    for v in views:
        v = v.cast("B")
        start, end = end, end + v.nbytes
        if end > total - 4 and start < total:
            tail += v[max(0, total - 4 - start) : min(v.nbytes, total - start)]
        if end >= total:
            break
    return crc_hex(int.from_bytes(tail, "little"))


def _mismatch(ref: Ref, key: str) -> ChunkError:
    return ChunkError(
        f"{key}: bytes at {ref.target}[{ref.offset}:{ref.offset + ref.length}] do not match "
        "the chunk index (a moved, swapped or foreign chunk)"
    )


def check_read(ref: Ref, key: str, views: Sequence[memoryview], n: int) -> None:
    """The check of a whole object read through the index, for a caller that decodes it
    (a trailer-bound chunk through its crc32c codec): the 4-byte trailer against the index,
    or the CRC-32 of the bytes (and a zarr shard's trailers, :func:`check_shard_range`)."""
    if ref.trailer:
        if trailer_hex(views, n) != ref.crc:
            raise _mismatch(ref, key)
    elif crc_hex(chunk_crc(views, n)) != ref.crc:
        raise _mismatch(ref, key)
    if ref.shard is not None and n == ref.length:
        check_shard_range(ref, key, shard_rows(ref, key, views, 0, n), 0, views, n)


def check_stored(ref: Ref, key: str, data: memoryview) -> None:
    """The check of a whole object for a caller that may not decode it (copies): for a
    trailer-bound chunk the crc32c of its message against its trailer and the index, else
    the CRC-32 of the bytes.  One pass either way."""
    if not ref.trailer:
        check_read(ref, key, [data], data.nbytes)  # a zarr shard's trailers included
        return
    data = data.cast("B")
    if trailer_hex([data]) != ref.crc:
        raise _mismatch(ref, key)
    if crc_hex(crc32c(data[:-4])) != ref.crc:
        raise ChunkError(f"{key}: crc32c checksum mismatch")


def index_bytes(
    txid: str,
    process: int,
    refs: Mapping[str, Any],
    binds: Mapping[str, tuple[str, bool]],
    shards: Mapping[str, str] | None = None,
) -> bytes:
    """The serialized chunk index of ``refs`` (fsspec reference form); ``binds`` gives each
    key's (hex, trailer), ``shards`` the zarr shards' trailers (``quire.shards``, a map
    that every reader of formats 2 and 3 ignores when it does not know it).  Format 2 when
    no key is trailer-bound (older quire reads it)."""
    crcs = {k: h for k, (h, t) in binds.items() if not t}
    trailers = {k: h for k, (h, t) in binds.items() if t}
    meta: dict[str, Any] = {
        "format": TRAILER_FORMAT if trailers else INDEX_FORMAT,
        "txid": txid,
        "process": process,
        "crc32": crcs,
    }
    if trailers:
        meta["crc32c"] = trailers
    if shards:
        meta["shards"] = dict(shards)
    doc = {"version": 1, "refs": dict(refs), "quire": meta}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


# ----------------------------------------------------------------------------- zarr shards
class _Bytes:
    """Random access to a few bytes of a sequence of views (one logical byte string)."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.views = [v.cast("B") for v in views if v.nbytes]
        self.starts, pos = [], 0
        for v in self.views:
            self.starts.append(pos)
            pos += v.nbytes

    def take(self, pos: int, k: int) -> bytes:
        out = bytearray()
        i = bisect.bisect_right(self.starts, pos) - 1
        while len(out) < k and 0 <= i < len(self.views):
            v, s = self.views[i], self.starts[i]
            out += v[pos + len(out) - s : pos + k - s]
            i += 1
        return bytes(out)


def shard_binding(views: Sequence[memoryview], n: int, n_inner: int) -> str | None:
    """The ``quire.shards`` value of a zarr shard (``sharding_indexed``, index at the end,
    ``bytes`` + ``crc32c`` index codecs, inner chains ending with ``crc32c``): the hex of
    its last 4 bytes (the crc32c of the shard index), then of each inner chunk's last 4
    bytes (its own crc32c trailer) in shard-index order.  Taken from those bytes only (no
    pass).  None for a shard this binding cannot describe (an inner chunk missing)."""
    ilen = 16 * n_inner + 4
    if n_inner < 1 or n < ilen:
        return None
    data = _Bytes(views)
    rows = np.frombuffer(data.take(n - ilen, ilen - 4), dtype="<u8").reshape(-1, 2)
    out = [crc_hex(int.from_bytes(data.take(n - 4, 4), "little"))]
    for off, nb in rows.tolist():
        if off == _U64_MAX or nb < 4 or off + nb > n - ilen:
            return None
        out.append(crc_hex(int.from_bytes(data.take(off + nb - 4, 4), "little")))
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


def shard_rows(ref: Ref, key: str, views: Sequence[memoryview], start: int, n: int) -> np.ndarray:
    """The ``(offset, nbytes)`` rows of the shard index in ``views`` (``n`` bytes of the
    shard read from ``start``, covering the whole index), checked against the binding: its
    crc32c trailer is the index's, and its crc32c is right; every row inside the shard."""
    assert ref.shard is not None
    a, b = shard_index_span(ref)
    if start > a or start + n < b or a < 0:
        raise ChunkError(f"{key}: the read does not cover the shard index")
    raw = _Bytes(views).take(a - start, b - a)
    if crc_hex(int.from_bytes(raw[-4:], "little")) != ref.shard[:8]:
        raise _shard_mismatch(ref, key, "shard index")
    if crc_bytes_hex(raw[:-4]) != ref.shard[:8]:
        raise ChunkError(f"{key}: crc32c checksum mismatch in shard index")
    rows = np.frombuffer(raw[:-4], dtype="<u8").reshape(-1, 2)
    if bool(((rows[:, 0] > a) | (rows[:, 1] < 4) | (rows[:, 1] > a - rows[:, 0])).any()):
        raise ChunkError(f"{key}: an inner chunk lies outside the shard")
    return rows


def crc_bytes_hex(data: bytes) -> str:
    return crc_hex(crc32c(data))


def _shard_mismatch(ref: Ref, key: str, what: str) -> ChunkError:
    return ChunkError(
        f"{key}: {what} at {ref.target}[{ref.offset}:{ref.offset + ref.length}] does not "
        "match the chunk index (a moved, swapped or foreign zarr shard)"
    )


def check_shard_range(
    ref: Ref, key: str, rows: np.ndarray, start: int, views: Sequence[memoryview], n: int
) -> None:
    """Compare the crc32c trailer of every inner chunk lying wholly in ``views`` (``n``
    bytes of the shard read from ``start``) with the binding; the decoder's crc32c check
    of each inner chunk binds the rest of it (as for a trailer-bound chunk)."""
    assert ref.shard is not None
    ends = rows[:, 0] + rows[:, 1]
    inside = np.flatnonzero((rows[:, 0] >= start) & (ends <= start + n))
    if not inside.size:
        return
    data = _Bytes(views)
    for i in inside.tolist():
        got = crc_hex(int.from_bytes(data.take(int(ends[i]) - 4 - start, 4), "little"))
        if got != ref.shard[8 * (i + 1) : 8 * (i + 2)]:
            raise _shard_mismatch(ref, key, f"inner chunk {i}")
