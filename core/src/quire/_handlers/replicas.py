"""Replica-parallel writes: which process writes which chunk of a multi-process array.

DESIGN.md "Replicas share the work": each byte of a replicated shard is written once, by
pieces spread over its replicas.  Every process computes the same plan from what every
process knows alike (each array's shape, dtype and global sharding, in tree order), so no
message is exchanged:

1. each shard of a multi-process ``jax.Array`` is split into ``k`` chunk-aligned pieces,
   ``k = min(holders, shard bytes // piece_bytes)`` (``holders``: the processes holding a
   copy of it), by a chunk grid finer than the shard grid along one axis; a shard whose
   axis ``k`` does not divide still splits (the last piece is shorter, padded like any
   edge chunk); a shard too small for two pieces stays one chunk.  A shard becomes at
   most ``PIECES_PER_HOLDER * k`` pieces (up to 2k when an exact divisor avoids padding),
   the bound the record's check derives its chunk limit from
   (``quire._format.bounds.max_chunks``);
2. all pieces of all arrays, largest first, go to the least-loaded of their holders (ties:
   the lowest process), after the primary's load of the process-local values it alone
   writes (numpy arrays, jax arrays on the devices of one process).

A piece is one zarr chunk, so format v1 and v2 store it as any other chunk: in the
writer's pack and chunk index (v2), or as its own object (v1); readers need no change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from quire._format.bounds import PIECES_PER_HOLDER

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Writers:
    """One array's share of a replica-parallel save, as seen by one process.

    Attributes
    ----------
    chunk_shape : tuple of int
        The array's chunk grid (a piece is one chunk).
    mine : tuple of tuple of int
        The coordinates of the chunks this process writes.
    """

    chunk_shape: tuple[int, ...]
    mine: tuple[tuple[int, ...], ...]


def _holders(value: jax.Array) -> dict[Box, set[int]] | None:
    """Each distinct shard's box and the processes holding a copy; None when the shards do
    not form a regular grid (saved then as today: one chunk, by the primary)."""
    shape = tuple(value.shape)
    out: dict[Box, set[int]] = {}
    for dev, idx in value.sharding.devices_indices_map(shape).items():
        box = tuple(slice(*s.indices(n)[:2]) for s, n in zip(idx, shape))
        key = tuple((s.start, s.stop) for s in box)
        out.setdefault(key, set()).add(int(getattr(dev, "process_index", 0)))
    chunk = tuple(value.sharding.shard_shape(shape))
    for key in out:
        for (a, b), c, n in zip(key, chunk, shape):
            if c == 0 or a % c or (b - a != c and b != n):
                return None
    return out


def _split(shard: tuple[int, ...], shape: tuple[int, ...], k: int) -> tuple[int, ...]:
    """The chunk shape cutting a shard of ``shard`` into about ``k`` pieces along one axis.

    Along an axis the array is sharded on, the piece length must divide the shard's (the
    grid must stay regular over every shard); along an axis the shard spans whole, any
    length works and the last piece is the remainder.  The first axis that reaches ``k``
    pieces wins (axis 0 keeps a C-order piece contiguous), else the one with the most.
    """
    best: tuple[int, int, int] | None = None  # (pieces, -axis, length)
    for ax, (s, n) in enumerate(zip(shard, shape)):
        if s < 2:
            continue
        if s == n:
            # an exact divisor between k and 2k pieces avoids padding; else ceil(s / k).
            # The record's check allows PIECES_PER_HOLDER * k pieces (bounds.max_chunks).
            most = min(PIECES_PER_HOLDER * k, s)
            exact = [s // m for m in range(k, most + 1) if s % m == 0]
            length = exact[0] if exact else math.ceil(s / min(k, s))
        else:
            divs = [d for d in range(1, s + 1) if s % d == 0 and s // d <= max(k, 1)]
            length = min(divs)
        pieces = math.ceil(s / length)
        cand = (min(pieces, k), -ax, length)
        if best is None or cand[:2] > best[:2]:
            best = cand
        if pieces >= k:
            break
    if best is None or best[0] < 2:
        return shard
    ax, length = -best[1], best[2]
    return tuple(length if i == ax else s for i, s in enumerate(shard))


def _one_process(value: jax.Array) -> bool:
    """Whether ``value``'s devices all belong to one process (the same answer in every
    process, unlike ``value.is_fully_addressable``)."""
    return len({int(getattr(d, "process_index", 0)) for d in value.sharding.device_set}) == 1


def plan_writers(
    arrays: Sequence[tuple[Any, np.dtype[Any]]],
    *,
    process_index: int,
    primary: int,
    piece_bytes: int,
) -> list[Writers | None]:
    """The replica-parallel plan for ``arrays`` (each a value and its stored dtype), in the
    same order on every process; None for a value saved as before (not a multi-process
    ``jax.Array``, or an irregular sharding).

    Parameters
    ----------
    arrays : sequence of (value, dtype)
        The array leaves of one save, in tree order (identical on every process).
    process_index, primary : int
        This process, and the one that writes process-local values.
    piece_bytes : int
        The floor on a piece's size.
    """
    load: dict[int, int] = {}
    # (-bytes, leaf, chunk coords, holders): sorted, largest first, then in tree order
    units: list[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = []
    shapes: list[tuple[int, ...] | None] = []
    cache: dict[Any, Any] = {}
    for i, (value, dtype) in enumerate(arrays):
        nbytes = math.prod(getattr(value, "shape", ())) * dtype.itemsize
        if not isinstance(value, jax.Array) or _one_process(value):
            # Written by the primary (a jax.Array on one process's devices: the primary's,
            # or refused, arrayplan).  Asked of the sharding, never of is_fully_addressable:
            # that differs between the owner and the others, and the loads would too.
            load[primary] = load.get(primary, 0) + nbytes
            shapes.append(None)
            continue
        shape = tuple(value.shape)
        key = (value.sharding, shape)
        if key not in cache:
            cache[key] = _holders(value)
        holders = cache[key]
        if holders is None or not shape or not nbytes:
            shapes.append(None)
            continue
        shard = tuple(value.sharding.shard_shape(shape))
        nholders = max(len(p) for p in holders.values())
        shard_bytes = math.prod(shard) * dtype.itemsize
        k = max(1, min(nholders, shard_bytes // max(1, piece_bytes)))
        chunk = _split(shard, shape, k) if k > 1 else shard
        chunk = tuple(max(1, c) for c in chunk)
        shapes.append(chunk)
        piece = math.prod(chunk) * dtype.itemsize
        for box, procs in holders.items():
            lo = [a // c for (a, _), c in zip(box, chunk)]
            hi = [math.ceil(b / c) for (_, b), c in zip(box, chunk)]
            for coords in np.ndindex(*(h - lo_ for lo_, h in zip(lo, hi))):
                at = tuple(int(c + o) for c, o in zip(coords, lo))
                units.append((-piece, i, at, tuple(sorted(procs))))
    units.sort()
    mine: dict[int, list[tuple[int, ...]]] = {}
    for (_, i, at, _), who in zip(units, assign([(-u[0], u[3]) for u in units], load)):
        if who == process_index:
            mine.setdefault(i, []).append(at)
    return [
        None if grid is None else Writers(grid, tuple(sorted(mine.get(i, []))))
        for i, grid in enumerate(shapes)
    ]


def assign(units: Sequence[tuple[int, Sequence[int]]], load: dict[int, int]) -> list[int]:
    """The writer of each unit ``(bytes, holders)``, in order: the least-loaded holder
    (ties: the lowest process); ``load`` (bytes per process so far) is updated.

    Parameters
    ----------
    units : sequence of (int, sequence of int)
        Pieces in the order they are placed (largest first gives the LPT bound: no
        process ends more than one piece above the mean of its holders).
    load : dict
        Bytes each process already writes.
    """
    out = []
    for nbytes, holders in units:
        who = min(holders, key=lambda p: (load.get(p, 0), p))
        load[who] = load.get(who, 0) + nbytes
        out.append(who)
    return out


def piece_source(
    value: jax.Array,
    chunk: tuple[int, ...],
    coords: tuple[int, ...],
    stage: Callable[[Any], Any] | None = None,
) -> Callable[[], np.ndarray]:
    """A producer of chunk ``coords``'s data (clipped to the array) from an addressable
    shard of ``value`` that holds it; ``LookupError`` if none does.  ``stage(shard)``,
    if given, is the array the piece is read from (a host staging copy of the shard)."""
    shape = tuple(value.shape)
    region = [(c * n, min((c + 1) * n, s)) for c, n, s in zip(coords, chunk, shape)]
    for s in value.addressable_shards:
        idx = [slice(*x.indices(n)[:2]) for x, n in zip(s.index, shape)]
        if all(x.start <= a and b <= x.stop for x, (a, b) in zip(idx, region)):
            local = tuple(slice(a - x.start, b - x.start) for x, (a, b) in zip(idx, region))
            data = s.data if stage is None else stage(s)
            return lambda: np.asarray(data)[local]
    raise LookupError(f"no addressable shard holds chunk {coords} of an array of shape {shape}")
