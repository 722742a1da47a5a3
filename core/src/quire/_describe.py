"""A checkpoint as a flat list of leaf descriptions, plus a reader of leaf values.

``quire info``, ``quire verify``/``cp`` summaries and ``quire diff`` work on this small
interface, so that anything that can describe its leaves (a checkpoint today; a
``quire.open`` source later) plugs in by providing a :class:`Tree`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from quire.metadata import CheckpointMetadata, LeafMetadata


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


@dataclass(frozen=True)
class Leaf:
    """One leaf: an array (shape, dtype) or an inline value (its type name)."""

    path: str
    kind: str  # "array" or "inline"
    shape: tuple[int, ...] = ()
    dtype: str = ""
    value: Any = None  # inline leaves: the type name


@dataclass
class Tree:
    """A comparable description: leaves by key path, metadata, and a value reader."""

    url: str
    leaves: dict[str, Leaf]
    custom: dict[str, Any] = field(default_factory=dict)
    read: Callable[[], Any] | None = None  # loads every leaf: {key path: value}


def from_checkpoint(url: str, storage_options: dict[str, Any] | None = None) -> Tree:
    """Describe the checkpoint at ``url`` (reads quire.json; values on demand)."""
    import quire

    m: CheckpointMetadata = quire.metadata(url, storage_options=storage_options)
    leaves: dict[str, Leaf] = {}
    for path, v in walk(m.tree if m.tree is not None else {}):
        k = keystr(path)
        if isinstance(v, LeafMetadata):
            dtype = "prng_key" if v.handler == "prng_key" else v.dtype.name
            leaves[k] = Leaf(k, "array", tuple(v.shape), dtype)
        else:
            leaves[k] = Leaf(k, "inline", value=getattr(v, "__name__", str(v)))

    def read() -> dict[str, Any]:
        tree = quire.load(url, storage_options=storage_options)
        return {keystr(p): val for p, val in walk(tree)}

    return Tree(m.url, leaves, dict(m.custom), read)
