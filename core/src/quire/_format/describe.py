"""What a checkpoint's records say of its arrays: the codec chain of an array leaf, the
built-in array handlers' records read as :class:`ArrayRecord` (no numpy, so that
``quire info`` and ``quire ls`` start at once), and walking a metadata tree for what
``quire info``, ``verify``, ``cp`` and ``ls`` count (arrays, chunks, bytes).  ``quire diff``
works on sources instead (:mod:`quire._sources.diff`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from quire._format.borrow import borrowed_of
from quire._format.chunkindex import parse_index
from quire._format.codecrecord import BYTES_JSON, split
from quire._format.dtypes import ITEMSIZES
from quire._store.base import Backend
from quire.metadata import LeafMetadata


def codec_chain(
    codecs: Sequence[Mapping[str, Any]], checksum: bool, inner_shape: Sequence[int] | None
) -> list[dict[str, Any]]:
    """The codec chain of an array's ``zarr.json``: the array-to-array codecs, ``bytes``
    (little endian), the bytes-to-bytes codecs, ``crc32c`` when checksummed; all that
    inside ``sharding_indexed`` when there are inner chunks.  A leaf record holds the
    three arguments (``codecs``, as :mod:`quire._format.codecrecord` lists them,
    ``checksum``, ``inner_shape``), so the chain is known from ``quire.json`` alone.
    """
    filters, compressors = split([dict(c) for c in codecs])
    chain: list[dict[str, Any]] = [*filters, dict(BYTES_JSON), *compressors]
    if checksum:
        chain.append({"name": "crc32c"})
    if inner_shape is None:
        return chain
    index = [dict(BYTES_JSON)]
    if checksum:
        index.append({"name": "crc32c"})
    return [
        {
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": list(inner_shape),
                "codecs": chain,
                "index_codecs": index,
                "index_location": "end",
            },
        }
    ]


@dataclass(frozen=True)
class ArrayRecord:
    """An array leaf as its record says (a built-in array handler's: ``numpy``, ``jax``,
    ``prng_key``): :class:`quire.metadata.LeafMetadata`'s fields, the dtype by its name, read
    without numpy."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    handler: str
    chunk_shape: tuple[int, ...]
    codecs: tuple[str, ...]
    checksum: bool
    sharding: dict[str, Any] | None
    location: str | None
    codec_chain: tuple[dict[str, Any], ...]
    variable: str | None = None
    filters: tuple[str, ...] = ()
    lossy: tuple[str, ...] = ()


def array_record(rec: Mapping[str, Any]) -> ArrayRecord:
    """A ``numpy`` / ``jax`` leaf's record (checked by the record's schema) as read."""
    shape = tuple(int(n) for n in rec["shape"])
    checksum = bool(rec.get("checksum", True))
    codecs = rec.get("codecs", [])
    filters, compressors = split(codecs)
    return ArrayRecord(
        shape=shape,
        dtype=str(rec["dtype"]),
        nbytes=math.prod(shape) * ITEMSIZES[rec["dtype"]],
        handler=str(rec["handler"]),
        chunk_shape=tuple(int(n) for n in rec.get("chunk_shape", shape)),
        codecs=tuple(str(c.get("name", "?")) for c in compressors),
        checksum=checksum,
        sharding=rec.get("sharding"),
        location=rec.get("location"),
        codec_chain=tuple(codec_chain(codecs, checksum, rec.get("inner_shape"))),
        variable=rec.get("variable"),
        filters=tuple(str(c.get("name", "?")) for c in filters),
        lossy=tuple(str(n) for n in rec.get("lossy", ())),
    )


def key_record(rec: Mapping[str, Any]) -> ArrayRecord:
    """A ``prng_key`` leaf's record: its key data's, with the shape of the keys."""
    a = array_record(rec)
    return replace(a, shape=tuple(int(n) for n in rec.get("key_shape", a.shape)))


#: Python types of the ``scalar`` handler's records by their ``type`` (``numpy``: see below).
SCALAR_TYPES: dict[str, type] = {"bool": bool, "int": int, "float": float, "complex": complex}


def scalar_type(rec: Mapping[str, Any]) -> type | None:
    """The type of a ``scalar`` leaf's value; None for a numpy scalar (its dtype's type:
    numpy's, which only the handler gives)."""
    t = rec.get("type", "")
    return None if t == "numpy" else SCALAR_TYPES.get(t, object)


#: The built-in handlers (the values of their entry points) and how their records read:
#: arrays as :class:`ArrayRecord`, inline leaves as their value's type (None: ask the
#: handler).
BUILT_IN: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "quire._handlers.arrays:NumpyArrayHandler": array_record,
    "quire._handlers.jax_arrays:JaxArrayHandler": array_record,
    "quire._handlers.jax_arrays:PRNGKeyHandler": key_record,
    "quire._handlers.inline:ScalarHandler": scalar_type,
    "quire._handlers.inline:StringHandler": lambda rec: str,
    "quire._handlers.inline:BytesHandler": lambda rec: bytes,
    "quire._handlers.inline:NoneHandler": lambda rec: type(None),
}

ARRAYS = (LeafMetadata, ArrayRecord)  # the array leaves of a metadata tree


def walk(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, leaf) for every leaf of a metadata tree (dicts, lists, tuples)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from walk(v, (*path, str(k)))
    elif isinstance(node, list | tuple):
        for i, v in enumerate(node):
            yield from walk(v, (*path, f"[{i}]"))
    else:
        yield path, node


def keystr(path: tuple[str, ...]) -> str:
    out = ""
    for p in path:
        out += p if p.startswith("[") else (f".{p}" if out else p)
    return out or "<root>"


def chain_text(chain: Sequence[Mapping[str, Any]], lossy: Sequence[str] = ()) -> str:
    """A codec chain (:attr:`LeafMetadata.codec_chain`) as ``quire info`` shows it: each codec
    in order with its configuration, ``bytes{endian=little}, zstd{level=3, checksum=false},
    crc32c``; a sharding codec with its inner chain in parentheses,
    ``sharding_indexed{chunk_shape=[8], ...}(bytes{endian=little}, crc32c)``; a codec named
    in ``lossy`` (:attr:`LeafMetadata.lossy`) marked ``(lossy)``."""
    out = []
    for c in chain:
        name = str(c.get("name", "?"))
        config = c.get("configuration")
        config = dict(config) if isinstance(config, Mapping) else {}
        inner = config.pop("codecs", None) if name == "sharding_indexed" else None
        text = name
        if config:
            text += "{" + ", ".join(f"{k}={_config_value(v)}" for k, v in config.items()) + "}"
        if isinstance(inner, list):
            text += f"({chain_text(inner, lossy)})"
        if name in lossy:
            text += " (lossy)"
        out.append(text)
    return ", ".join(out)


def _config_value(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(isinstance(x, Mapping) and "name" in x for x in v):
        return f"[{chain_text(v)}]"  # a list of codecs (the sharding codec's index_codecs)
    return json.dumps(v)


def array_bytes(tree: Any) -> int:
    """Bytes of every array leaf of a metadata tree."""
    return sum(v.nbytes for _, v in walk(tree) if isinstance(v, ARRAYS))


def n_chunks(leaf: LeafMetadata | ArrayRecord) -> int:
    """Stored chunks (objects) of an array leaf."""
    if not math.prod(leaf.shape) or leaf.handler == "prng_key":
        return 0 if not math.prod(leaf.shape) else max(1, _grid(leaf))
    return _grid(leaf)


def _grid(leaf: LeafMetadata | ArrayRecord) -> int:
    cs = leaf.chunk_shape or leaf.shape
    return math.prod(-(-s // max(1, c)) for s, c in zip(leaf.shape, cs)) if leaf.shape else 1


@dataclass(frozen=True)
class Counts:
    """What verify and cp both report: arrays, their chunks and bytes."""

    arrays: int
    chunks: int
    nbytes: int


def counts(tree: Any) -> Counts:
    leaves = [v for _, v in walk(tree) if isinstance(v, ARRAYS)]
    return Counts(len(leaves), sum(n_chunks(v) for v in leaves), sum(v.nbytes for v in leaves))


async def ownership(backend: Backend, url: str, doc: Mapping[str, Any]) -> tuple[int, int]:
    """(owned, borrowed) bytes of a format-v2 checkpoint's packed objects: what its own
    packs hold for it and what it points at in packs of earlier steps (an incremental
    step, ``quire._format.borrow``).  Reads the chunk indexes when something is borrowed."""
    entries = doc.get("indexes") or []
    borrowed = sum(borrowed_of(entries).values())
    if not borrowed:
        return -1, 0
    total = 0
    for e in entries:
        refs = parse_index(await backend.get(e["object"]), e, url)
        total += sum(r.length for r in refs.values() if r.target is not None)
    return total - borrowed, borrowed
