"""Every chunk accounted for before a commit (DESIGN.md "Commit protocol", step 5).

A record is published only when every object its array leaves need is where a load will
look for it: each leaf's ``zarr.json`` and every chunk of its grid (a zarr shard, with
its inner chunks inside, is one chunk of the outer grid; the pieces of a replica-split
shard are chunks of the finer grid the record holds).  A load resolves a zarr key
through the chunk indexes the record names (format v2) and reads any key no index holds
as an object (format v1, ``layout="chunks"``, and data that is not packed), so the check
does the same, once for the whole record:

1. what each leaf needs, asked of its handler (``quire._handlers.owned``, the place
   ``verify`` and ``cp`` learn it), an array leaf's as its chunk grid (a bitmap: the
   check holds one byte per chunk, never one key);
2. every index object the record names, read and checked against its entry (size,
   crc32c), its keys marked off - a key that points into an earlier step's pack (a
   borrowed range of an incremental root) counts as the index holds it;
3. for what is still unaccounted for, a listing of the txids it lives under;
4. anything left is missing (or an index the record names could not be read, which a
   load would fail on too): :class:`quire.errors.IncompleteCheckpointError`, naming the
   URL, the first incomplete leaf's key path, the chunk (its zarr key and grid index),
   how many are missing in all, and the fix; nothing is published.

Zero-size arrays need only their ``zarr.json``; inline leaves (scalars, strings) and
checkpointable units (whose objects are whatever their location holds) need nothing.
quire writes every chunk of an array, fill-valued ones included (zarr's
``write_empty_chunks`` is on), so no chunk is absent by design.

The cost is one pass over the record's indexes on the primary: reading and parsing each
(the only read of the other processes' indexes on the save path: each shared its own size
and crc32c, ``quire._engine.record_parts``, and each index read is checked against them)
and one dictionary look-up per key (docs/commit-protocol.md has the figures).
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from quire._format.chunkid import crc_hex
from quire._format.crc import crc32c
from quire._format.record import PYTREE
from quire._format.tree import KeyPath, Node, from_json, keystr
from quire._handlers import select as _selection
from quire._handlers.arrayplan import layout_from_record
from quire._handlers.arrays import ArrayHandler
from quire._handlers.owned import leaf_objects
from quire._store.base import Backend
from quire.errors import IncompleteCheckpointError

__all__ = ["check", "record_parts"]

READS = 16  # index objects read at once (each parsed, marked and dropped)
_META = "/zarr.json"


@functools.lru_cache(maxsize=64)
def _coordinates(n: int) -> dict[str, int]:
    """``{"0": 0, ..., str(n - 1): n - 1}``: a chunk coordinate as zarr's key writes it
    (decimal, no sign, no leading zero), looked up, so that no other spelling of a number
    counts as the chunk a load asks for."""
    return {str(i): i for i in range(n)}


@dataclass
class _Grid:
    """What an array leaf needs: its ``zarr.json`` and every chunk of ``grid``."""

    where: str  # the leaf's key path, as messages name it
    location: str
    grid: tuple[int, ...]
    seen: bytearray = field(init=False)  # one byte per chunk, C order
    axes: tuple[dict[str, int], ...] = field(init=False)  # coordinate spellings per axis
    meta: bool = False

    def __post_init__(self) -> None:
        self.seen = bytearray(math.prod(self.grid))
        self.axes = tuple(_coordinates(n) for n in self.grid)

    def flat(self, rest: str) -> int | None:
        """The C-order index of the chunk whose key ends ``rest`` (``"3/0/1"``), or None
        when that is no chunk key of this grid (:meth:`_Needs.mark` inlines ranks 1, 2)."""
        parts = rest.split("/")
        if len(parts) != len(self.axes):
            return None
        flat = 0
        for p, coords, n in zip(parts, self.axes, self.grid):
            i = coords.get(p)
            if i is None:
                return None
            flat = flat * n + i
        return flat

    def count(self) -> int:
        return self.seen.count(0) + (not self.meta)

    def chunk_key(self, flat: int) -> str:
        coords = _unravel(flat, self.grid)
        return "/".join((self.location, "c", *map(str, coords)))


def _unravel(flat: int, grid: Sequence[int]) -> tuple[int, ...]:
    out = []
    for g in reversed(grid):
        flat, i = divmod(flat, g)
        out.append(i)
    return tuple(reversed(out))


class _Needs:
    """What a record's leaves need, and what has been found of it so far."""

    def __init__(self) -> None:
        self.arrays: dict[str, _Grid] = {}  # location -> grid
        self.others: dict[str, str] = {}  # zarr key -> key path (handlers' own objects)
        self.order: list[tuple[str, str]] = []  # (location or key, kind) in tree order

    def add_array(self, where: str, location: str, grid: tuple[int, ...]) -> None:
        self.arrays[location] = _Grid(where, location, grid)
        self.order.append((location, "array"))

    def add_object(self, where: str, key: str) -> None:
        if key not in self.others:
            self.others[key] = where
            self.order.append((key, "object"))

    def mark(self, keys: Iterable[str]) -> None:
        """Mark found every key of ``keys`` that some leaf needs: a chunk key (the common
        case, ranks 1 and 2 inline here: the loop runs once per chunk of the record, and
        a method call would be a third of its cost), else :meth:`_mark_other`."""
        arrays = self.arrays
        for k in keys:
            loc, sep, rest = k.rpartition("/c/")
            g = arrays.get(loc) if sep else None
            if g is not None:
                axes = g.axes
                if len(axes) == 1:
                    flat = axes[0].get(rest)
                elif len(axes) == 2:
                    a, _, b = rest.partition("/")
                    i, j = axes[0].get(a), axes[1].get(b)
                    flat = None if i is None or j is None else i * g.grid[1] + j
                else:
                    flat = g.flat(rest)
                if flat is not None:
                    g.seen[flat] = 1
                    continue
            self._mark_other(k)

    def _mark_other(self, k: str) -> None:
        """A ``zarr.json``, the chunk of a 0-d array (``<loc>/c``), a handler's object."""
        if k.endswith(_META):
            g = self.arrays.get(k[: -len(_META)])
            if g is not None:
                g.meta = True
                return
        elif k.endswith("/c"):
            g = self.arrays.get(k[:-2])
            if g is not None and not g.grid:
                g.seen[0] = 1
                return
        self.others.pop(k, None)

    def txids(self) -> set[str]:
        """The txids under which something is still unaccounted for."""
        out = {g.location.split("/")[1] for g in self.arrays.values() if g.count()}
        return out | {k.split("/")[1] for k in self.others if k.count("/") > 1}

    def first(self) -> tuple[str, str, str, tuple[int, ...] | None, int] | None:
        """The first thing missing, in tree order - ``(key path, zarr key, what it is,
        its grid index or None)`` - and how many are missing in all; None when nothing is."""
        count = 0
        first: tuple[str, str, str, tuple[int, ...] | None] | None = None
        for ident, kind in self.order:
            if kind == "array":
                g = self.arrays[ident]
                n = g.count()
                if n and first is None:
                    at = g.seen.find(0)
                    if not g.meta or at < 0:
                        first = (g.where, f"{g.location}{_META}", "its zarr.json", None)
                    else:
                        coords = _unravel(at, g.grid)
                        first = (g.where, g.chunk_key(at), f"chunk {coords} of its grid", coords)
                count += n
            elif ident in self.others:
                count += 1
                if first is None:
                    first = (self.others[ident], ident, "an object its handler names", None)
        return None if first is None else (*first, count)


def record_parts(doc: Mapping[str, Any]) -> tuple[list[tuple[str, Any]], list[Any] | None]:
    """The pytree units of a commit record or journal version (``(unit name, tree JSON)``)
    and the chunk-index entries it names (None: none)."""
    trees: list[tuple[str, Any]] = []
    if "units" in doc:
        trees = [(n, u["tree"]) for n, u in doc["units"].items() if u.get("kind") == "pytree"]
    elif doc.get("tree") is not None:  # a partial-save journal version's fragment
        trees = [(PYTREE, doc["tree"])]
    return trees, doc.get("indexes") or None


def _where(unit: str, path: KeyPath) -> str:
    return keystr(path) if unit == PYTREE else f"{unit}:{keystr(path)}"


async def _needs(backend: Backend, url: str, trees: Sequence[tuple[str, Any]]) -> _Needs:
    needs = _Needs()
    plugin: dict[str, list[tuple[str, Node]]] = {}
    for unit, tree in trees:
        for leaf in from_json(tree).leaves():
            rec = leaf.value
            hid = rec.get("handler") if isinstance(rec, dict) else None
            if not isinstance(hid, str) or not isinstance(rec.get("location"), str):
                continue  # inline leaves store nothing
            handler = _selection.get(hid, url=url)
            where = _where(unit, leaf.path)
            if isinstance(handler, ArrayHandler):  # what ArrayHandler.objects names
                layout = layout_from_record(rec, url)
                grid = layout.grid if math.prod(layout.shape) else (0,)
                needs.add_array(where, rec["location"], grid)
            elif getattr(handler, "objects", None) is not None:
                plugin.setdefault(hid, []).append((where, leaf))
            # a handler without ``objects`` owns what its location holds: nothing to miss
    for items in plugin.values():
        got = await leaf_objects(url, backend, [leaf for _, leaf in items])
        for (where, _), (_, objs) in zip(items, got):
            for o in objs:
                needs.add_object(where, o.key)
    return needs


def _index_keys(data: bytes, entry: Mapping[str, Any]) -> Iterable[str] | str:
    """The zarr keys one index object holds, or why it cannot be read (as a load would
    refuse it: not the size or crc32c its record entry says, or malformed)."""
    if len(data) != entry.get("size") or crc_hex(crc32c(data)) != entry.get("crc32c"):
        return (
            f"chunk index {entry.get('object')} has {len(data)} bytes / crc32c "
            f"{crc_hex(crc32c(data))}, the record says {entry.get('size')} / {entry.get('crc32c')}"
        )
    try:
        refs = json.loads(data)["refs"]
        if not isinstance(refs, dict):
            raise TypeError("refs")
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        return f"chunk index {entry.get('object')} is malformed ({type(e).__name__})"
    return refs.keys()


async def _mark_indexes(
    backend: Backend, needs: _Needs, indexes: Sequence[Mapping[str, Any]], notes: list[str]
) -> None:
    """Mark what each index object holds, :data:`READS` reads in flight."""
    sem = asyncio.Semaphore(READS)

    async def one(entry: Mapping[str, Any]) -> None:
        async with sem:
            try:
                data = await backend.get(str(entry.get("object")))
            except FileNotFoundError:
                notes.append(f"chunk index {entry.get('object')} is missing")
                return
            got = _index_keys(data, entry)
            del data
            if isinstance(got, str):
                notes.append(got)
            else:
                needs.mark(got)

    await asyncio.gather(*(one(e) for e in indexes))


async def _mark_listed(backend: Backend, needs: _Needs) -> None:
    """Mark the objects stored under the txids of what is still missing (format v1; a
    load reads a key no index holds from the store)."""
    txids = sorted(needs.txids())
    for keys in await asyncio.gather(*(backend.list(f"d/{t}") for t in txids)):
        needs.mark(keys)


async def check(
    backend: Backend,
    url: str,
    key: str,
    trees: Sequence[tuple[str, Any]],
    indexes: Sequence[Mapping[str, Any]] | None,
    indexes_from: Backend | None = None,
) -> None:
    """Refuse to publish ``key`` (``quire.json``, a journal version) at ``url`` unless every
    object the leaves of ``trees`` need is in one of ``indexes`` or stored in ``backend``.

    Parameters
    ----------
    backend : Backend
        The checkpoint's backend (index objects and format-v1 chunks are read from it).
    indexes_from : Backend, optional
        Where to read the index objects instead: one holding the very same bytes (a
        promotion's local step, whose index objects it copied, each checked against the
        record's entry); each is checked against the entry here too.
    url, key : str
        Where the record is to be published, for messages.
    trees : sequence of (str, tree JSON)
        The record's pytree units (:func:`record_parts`).
    indexes : sequence of dict or None
        The chunk-index entries the record names.

    Raises
    ------
    IncompleteCheckpointError
        Naming the first incomplete leaf and its missing chunk; or, every chunk found, an
        index object the record names that is missing or not the one it describes.
    """
    needs = await _needs(backend, url, trees)
    if not needs.arrays and not needs.others:
        return
    notes: list[str] = []
    if indexes:
        await _mark_indexes(indexes_from or backend, needs, indexes, notes)
    if needs.first() is not None:
        await _mark_listed(backend, needs)
    got = needs.first()
    if got is None and notes:  # every chunk found, but a load reads every index it needs
        raise IncompleteCheckpointError(
            f"{url}: refusing to publish {key}: {'; '.join(sorted(notes)[:3])}; a load that reads "
            "it fails (the process it belongs to reads its own first). Nothing was committed; what was there before "
            "is unchanged. A writer lost it - a defect of quire (please report it, with this "
            "message); save again, or for a copy check the source with `quire verify`",
            url=url,
            missing=len(notes),
        )
    if got is None:
        return
    where, missing, what, chunk, count = got
    more = f"; {count - 1} more object(s) are missing" if count > 1 else ""
    why = f" ({'; '.join(sorted(notes)[:3])})" if notes else ""
    raise IncompleteCheckpointError(
        f"{url}: refusing to publish {key}: leaf {where!r} misses {what}, {missing!r}: no "
        f"chunk index of the record holds it and no object stores it{why}{more}. Nothing "
        "was committed; what was there before is unchanged. A writer lost it - a defect of "
        "quire or of the plugin that wrote the leaf (please report it, with this message); "
        "save again, or for a copy check the source with `quire verify`",
        url=url,
        path=where,
        key=missing,
        chunk=chunk,
        missing=count,
    )
