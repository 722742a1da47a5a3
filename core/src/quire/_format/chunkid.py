"""Format v2: how the chunk index binds each stored object to its key (chunk identity).

Every key of a chunk index (``quire._format.chunkindex``) is bound to the exact bytes stored for
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
of array chunks must decode them through ``quire._handlers.zarr_io`` or call ``quire._format.chunkcheck.check_stored``):

* loads, by every array handler (numpy, jax, prng_key; quire-torch through numpy), whole
  or resharded, and ``quire.open`` regions: ``_zarr.read_region`` -> ``_read_raw_into``
  (raw chunks read into place) or ``_decode_one`` (compressed chunks, partial chunks);
* ``quire verify``: ``handlers.check_objects`` runs ``_zarr.chunk_checker`` on each chunk;
* ``quire cp`` (packs copied as objects) and a finalize's pack rewrite, which need not
  decode: ``quire._format.chunkcheck.check_stored``, the crc32c of the message against the trailer and the
  index, one pass as for a CRC-32 (then ``chunk_checker``, as before).

``PackedReader`` (``quire._format.packedreader``) compares the trailer (``quire._format.chunkcheck.check_read``) on every
whole-object read; the tests in ``core/tests/test_chunkid.py`` forge a chunk whose trailer
still matches and check that each of these paths refuses it.

**Zarr shards** (``quire.shards``, any index format, supplementary to their CRC-32): a load
reads a shard by ranges (its shard index, then the inner chunks it needs), so the CRC-32 of
the whole shard is checked only by whole-object readers (verify, cp, a finalize's copy).
For range reads the index also holds, per shard key, :func:`~quire._format.shardid.shard_binding`: the hex of the
shard's last 4 bytes (the crc32c of the shard index) and of each inner chunk's own crc32c
trailer, in shard-index order.  ``PackedReader`` checks every range read of a shard key:
a range holding the shard index is compared with the first value and its crc32c checked
(:func:`~quire._format.shardid.shard_rows`, rows kept per key); every inner chunk wholly inside a range is
compared, at the offset those rows give, with its value (:func:`~quire._format.shardid.check_shard_range`; the
reader reads the shard index itself first when a caller did not), and the decoder's crc32c
check of the inner chunk (``_zarr._read_sharded``, zarr's sharding codec) binds the rest.
The shard index's trailer alone binds nothing: it covers offsets and lengths only, the same
for all raw shards of an array.  With the inner trailers, a shard swapped (same array or
another), moved or imported fails at its first inner chunk whose bytes differ; a forged
inner chunk with an intact trailer fails its crc32c.  Indexes without the map (written
before it) keep loading, their shards unbound on range reads; ``checksum=False`` shards
have no trailers and keep the CRC-32 only.  ``core/tests/test_shard_identity.py``.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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


class ViewBytes:
    """Random access to a few bytes of a sequence of views (one logical byte string)."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.views = [v.cast("B") for v in views if v.nbytes]
        self.starts, pos = [], 0
        for v in self.views:
            self.starts.append(pos)
            pos += v.nbytes

    def take(self, pos: int, k: int) -> bytes:
        """Bytes ``[pos, pos + k)`` (fewer at the end of the views)."""
        out = bytearray()
        i = bisect.bisect_right(self.starts, pos) - 1
        while len(out) < k and 0 <= i < len(self.views):
            v, s = self.views[i], self.starts[i]
            out += v[pos + len(out) - s : pos + k - s]
            i += 1
        return bytes(out)

    def trailer(self, end: int) -> str:
        """The 4 bytes before ``end`` as the index writes a crc32c trailer."""
        return le_hex(self.take(end - 4, 4))


def le_hex(four: bytes) -> str:
    """A crc32c trailer (4 bytes, little-endian) as the index writes it: 8 hex digits."""
    return crc_hex(int.from_bytes(four, "little"))


def trailer_hex(views: Sequence[memoryview], n: int | None = None) -> str | None:
    """The last 4 of the first ``n`` bytes of ``views`` (all when None) as the index
    writes a crc32c trailer; None when there are fewer than 4."""
    total = sum(v.nbytes for v in views) if n is None else n
    return ViewBytes(views).trailer(total) if total >= 4 else None


def index_bytes(
    txid: str,
    process: int,
    refs: Mapping[str, Any],
    binds: Mapping[str, tuple[str, bool]],
    shards: Mapping[str, str] | None = None,
    hashes: Mapping[str, str] | None = None,
    borrowed: Mapping[str, int] | None = None,
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
    if hashes:  # an incremental step: each chunk's xxh3-128 (quire._engine.incremental)
        meta["xxh3"] = dict(hashes)
    if borrowed:  # and the packs of earlier steps it points into (quire._format.borrow)
        meta["borrowed"] = dict(sorted(borrowed.items()))
    doc = {"version": 1, "refs": dict(refs), "quire": meta}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
