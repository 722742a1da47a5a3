"""What ``quire.metadata`` returns: the tree of leaf descriptions, read from quire.json only."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

__all__ = ["CheckpointMetadata", "LeafMetadata"]


@dataclass(frozen=True)
class LeafMetadata:
    """An array leaf as stored: shape, dtype, size, and how it is laid out.

    Attributes
    ----------
    shape : tuple of int
        The array's shape (typed PRNG keys: the keys' shape, without the key data's axis).
    dtype : numpy.dtype
        The stored dtype; for typed PRNG keys (handler ``"prng_key"``, an NNX ``RngKey``'s
        value) JAX's key dtype, e.g. ``key<fry>``, as ``jax.random.key(0).dtype``.
    nbytes : int
        ``prod(shape) * dtype.itemsize``.
    handler : str
        The leaf handler that wrote it (``"numpy"``, ``"jax"``, ``"prng_key"``, ...).
    chunk_shape : tuple of int
        The zarr chunk (one per saved device shard).
    codecs : tuple of str
        The bytes-to-bytes codecs, in order (after ``bytes``; quire's ``crc32c`` aside).
    checksum : bool
        Whether every chunk carries a crc32c.
    sharding : dict, optional
        The saved sharding (mesh axes and spec), for ``jax`` leaves.
    location : str, optional
        The array's directory under the checkpoint root.
    codec_chain : tuple of dict
        The whole codec chain as the array's ``zarr.json`` holds it (``{"name",
        "configuration"}`` objects): the ``filters``, ``bytes``, the ``codecs``, then
        ``crc32c`` when checksummed; or one ``sharding_indexed`` holding that chain (its ``"codecs"``) when the
        array has inner chunks.  Empty where the leaf's handler does not say.
    filters : tuple of str
        The array-to-array codecs, in order (before ``bytes``).
    lossy : tuple of str
        The codecs of the chain that may not restore the array bit for bit (a
        quantizer, ``numcodecs.bitround``, an ``astype`` to a narrower type...): what a
        load gives back is then close to what was saved, not equal.  Empty when exact.
    variable : str, optional
        The class of the Flax NNX ``Variable`` that held the leaf (``"Param"``,
        ``"BatchStat"``, ``"RngKey"``, ``"OptState"``, ...), where it was one.
    """

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    nbytes: int
    handler: str = "numpy"
    chunk_shape: tuple[int, ...] = ()
    codecs: tuple[str, ...] = ()
    checksum: bool = True
    sharding: dict[str, Any] | None = None
    location: str | None = None
    codec_chain: tuple[dict[str, Any], ...] = ()
    variable: str | None = None
    filters: tuple[str, ...] = ()
    lossy: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckpointMetadata:
    """A committed checkpoint's description.

    Attributes
    ----------
    tree : pytree
        The saved tree's structure: array leaves as :class:`LeafMetadata`, inline leaves
        (scalars, strings, bytes, None) as their value's type.  None when the checkpoint
        has no ``"pytree"`` unit (only other checkpointables).
    custom : dict
        The user metadata passed to ``save``.
    created : datetime.datetime
        Commit time (UTC).
    format_version : int
        On-disk format version.
    units : dict
        Every unit's name and kind (``"pytree"``, ``"json"`` or a checkpointable handler id).
    """

    tree: Any
    custom: dict[str, Any]
    created: datetime.datetime
    format_version: int
    url: str = ""
    library_version: str = ""
    process_count: int = 1
    txids: tuple[str, ...] = ()
    units: dict[str, str] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict, repr=False)
