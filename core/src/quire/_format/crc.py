"""Checksums quire binds stored bytes with, and the error a failed check raises.

crc32c is zarr's ``crc32c`` codec (every chunk ends with the crc32c of the bytes before it,
little endian) and the commit record's checksum; the chunk index and the shard checks
compare the same values.  Lowest of the format modules: it imports nothing of quire.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

_crc32c: Any
try:
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - crc32c is a dependency; google-crc32c comes with zarr
    import google_crc32c

    _crc32c = google_crc32c.value

U64_MAX = 2**64 - 1  # zarr's "empty inner chunk" marker in a shard index


class ChunkError(ValueError):
    """A chunk failed verification (bad checksum, wrong size, missing, undecodable)."""


def bytes_view(arr: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy)."""
    if not arr.size:
        return memoryview(bytearray())
    return memoryview(arr.reshape(-1).view("u1"))  # type: ignore[arg-type]


def crc32c(data: Any) -> int:
    """crc32c of a bytes-like object (any buffer; no copy)."""
    return int(_crc32c(memoryview(data).cast("B")))


def crc_bytes(data: Any) -> bytes:
    """crc32c of ``data`` as zarr's ``crc32c`` codec stores it: 4 bytes, little endian."""
    return crc32c(data).to_bytes(4, "little")
