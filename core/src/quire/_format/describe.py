"""Walking a checkpoint's metadata tree: what ``quire info``, ``verify``, ``cp`` and ``ls``
count (arrays, chunks, bytes).  ``quire diff`` works on sources instead (:mod:`quire._sources.diff`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from quire._format.borrow import borrowed_of
from quire._format.chunkindex import parse_index
from quire._store.base import Backend
from quire.metadata import LeafMetadata


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
    return sum(v.nbytes for _, v in walk(tree) if isinstance(v, LeafMetadata))


def n_chunks(leaf: LeafMetadata) -> int:
    """Stored chunks (objects) of an array leaf."""
    if not math.prod(leaf.shape) or leaf.handler == "prng_key":
        return 0 if not math.prod(leaf.shape) else max(1, _grid(leaf))
    return _grid(leaf)


def _grid(leaf: LeafMetadata) -> int:
    cs = leaf.chunk_shape or leaf.shape
    return math.prod(-(-s // max(1, c)) for s, c in zip(leaf.shape, cs)) if leaf.shape else 1


@dataclass(frozen=True)
class Counts:
    """What verify and cp both report: arrays, their chunks and bytes."""

    arrays: int
    chunks: int
    nbytes: int


def counts(tree: Any) -> Counts:
    leaves = [v for _, v in walk(tree) if isinstance(v, LeafMetadata)]
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
