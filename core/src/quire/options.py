"""Per-leaf options: how a leaf is stored (:class:`StorageOptions`), and which casts a load
may make into its target (:data:`CastingSpec`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CastingSpec", "StorageOptions", "StorageSpec"]


@dataclass(frozen=True)
class StorageOptions:
    """How one array leaf is stored.

    Parameters
    ----------
    dtype : dtype-like, optional
        Cast to this dtype on save (e.g. ``jnp.bfloat16`` to halve a float32 leaf).
    codecs : sequence, optional
        Compressors applied to every chunk, in order: codec ids (``"zstd"``), dicts
        ``{"name": "zstd", "configuration": {"level": 5}}`` or zarr v3 codec objects.
    chunk_bytes : int, optional
        Split each device shard larger than this into inner chunks of at most this many
        bytes, stored in one zarr shard per device shard (the ``sharding_indexed`` codec);
        restores of a sub-region then read only the inner chunks they need.
    checksum : bool
        Append a crc32c to every chunk (default True).  Turning it off removes quire's
        protection against silently corrupted data.
    """

    dtype: Any = None
    codecs: Sequence[Any] | None = None
    chunk_bytes: int | None = None
    checksum: bool = True

    def __post_init__(self) -> None:
        if self.chunk_bytes is not None and int(self.chunk_bytes) <= 0:
            raise ValueError(f"StorageOptions.chunk_bytes must be positive, got {self.chunk_bytes}")


StorageSpec = StorageOptions | Callable[[tuple[Any, ...], Any], StorageOptions | None] | None

CastingSpec = str | Callable[[tuple[Any, ...], Any], str | None] | None
"""The ``casting=`` of a load: numpy's ``"no"``, ``"equiv"``, ``"safe"``, ``"same_kind"`` (the
default; it also refuses an integer narrowed past one of its values) or ``"unsafe"`` for every
leaf, or a callable of ``(key_path, target_leaf)`` returning one of them, or None for the
default, leaf by leaf."""
