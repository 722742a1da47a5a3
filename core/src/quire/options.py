"""Per-leaf options: how a leaf is stored (:class:`StorageOptions`), and which casts a load
may make into its target (:data:`CastingSpec`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CastingSpec", "StorageOptions", "StorageSpec"]

CASTINGS = ("no", "equiv", "safe", "same_kind", "unsafe")
"""numpy's casting values (``numpy.can_cast``), which ``casting=`` takes."""


@dataclass(frozen=True)
class StorageOptions:
    """How one array leaf is stored.

    Parameters
    ----------
    dtype : dtype-like, optional
        Cast to this dtype on save (e.g. ``jnp.bfloat16`` to halve a float32 leaf), under
        ``casting``.
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
    casting : str
        Which casts to ``dtype`` the save may make, by the rule of a load's ``casting=``
        (numpy's ``"no"``, ``"equiv"``, ``"safe"``, ``"same_kind"`` or ``"unsafe"``).  The
        default ``"same_kind"`` makes casts within a kind or up the order bool → unsigned
        int → int → float → complex (float32 → bfloat16 or a float8 type: floats are
        rounded, and a value past the narrower type's range becomes inf, or NaN in a type
        without inf, as on load), and narrows an integer (int64 → int8) only when every
        value fits; a cast that loses information (float → int, complex → real, int →
        unsigned, an integer that would wrap) is a :class:`~quire.errors.LossyCastError`
        before anything is committed.  ``"unsafe"`` makes any cast numpy makes.
    """

    dtype: Any = None
    codecs: Sequence[Any] | None = None
    chunk_bytes: int | None = None
    checksum: bool = True
    casting: str = "same_kind"

    def __post_init__(self) -> None:
        if self.chunk_bytes is not None and int(self.chunk_bytes) <= 0:
            raise ValueError(f"StorageOptions.chunk_bytes must be positive, got {self.chunk_bytes}")
        if self.casting not in CASTINGS:
            raise ValueError(
                f"StorageOptions.casting must be one of {', '.join(map(repr, CASTINGS))}, "
                f"not {self.casting!r}"
            )


StorageSpec = StorageOptions | Callable[[tuple[Any, ...], Any], StorageOptions | None] | None

CastingSpec = str | Callable[[tuple[Any, ...], Any], str | None] | None
"""The ``casting=`` of a load: numpy's ``"no"``, ``"equiv"``, ``"safe"``, ``"same_kind"`` (the
default; it also refuses an integer narrowed past one of its values) or ``"unsafe"`` for every
leaf, or a callable of ``(key_path, target_leaf)`` returning one of them, or None for the
default, leaf by leaf."""
