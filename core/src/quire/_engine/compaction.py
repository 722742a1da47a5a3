"""Compaction of mostly-dead packs in an incremental root, done by the save that would
keep them alive (``docs/format.md``, "Deleting and gc").

A committed step's bytes never move: records and the packs they point into are
immutable.  What keeps a mostly-dead pack alive is each new step borrowing its few live
chunks again.  So, at the end of an incremental save (every chunk written, borrowed or
carried; before the chunk index is written), :func:`compact` looks at every pack the
step borrows from: when the bytes it borrows are less than ``below`` of the pack's size,
it reads those chunks back from the pack (protected by the save's lease), checks each
against its binding, and writes them into a fresh pack of its own.  The new step then
points into that pack no more; the old pack dies whole once the older steps that point
into it are deleted, and the gc removes it.

Every pack a step points into thus holds at least ``below`` of its bytes for that step
(its own packs all of theirs), which bounds what a root stores (see the docs).  The moved
chunks go into packs of their own, apart from the step's changed chunks: they are the
ones that did not change, so the next step borrows those packs whole.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from quire._format.borrow import UP
from quire._format.chunkcheck import check_stored
from quire._format.chunkid import Ref
from quire._format.crc import ChunkError
from quire._format.pack import PackWriter
from quire._store.base import Backend
from quire.errors import CorruptCheckpointError

log = logging.getLogger("quire")

#: Chunks of one pack read in one ranged request when the gap between them is at most
#: GAP bytes and the request at most WINDOW bytes.
GAP = 1 << 20
WINDOW = 32 << 20
#: Ranged reads in flight at once.
READS = 4


async def compact(
    sink: PackWriter, root: Backend, sizes: dict[str, int], below: float, where: str
) -> int:
    """Move out of ``sink``'s borrowed packs the chunks of every pack the step borrows
    less than ``below`` of (``sizes``: root-relative pack -> bytes, filled in from the
    backend where missing); the bytes moved.  ``where`` names the step in errors."""
    if below <= 0 or not sink.borrowed:
        return 0
    victims: list[str] = []
    for target, n in sorted(sink.borrowed.items()):
        rel = target[len(UP) :]
        if rel not in sizes:
            sizes[rel] = await root.size(rel)
        if n < below * sizes[rel]:
            victims.append(target)
    if not victims:
        return 0
    keys: dict[str, list[str]] = {t: [] for t in victims}
    for k, v in sink.refs.items():
        if isinstance(v, list) and v[0] in keys:
            keys[v[0]].append(k)
    windows = [w for t in victims for w in _windows(sink, t, keys[t])]
    sink.fresh_pack()
    sem = asyncio.Semaphore(READS)
    moved = 0

    async def one(target: str, ks: Sequence[str]) -> None:
        nonlocal moved
        rel = target[len(UP) :]
        start = sink.refs[ks[0]][1]
        end = max(sink.refs[k][1] + sink.refs[k][2] for k in ks)
        async with sem:
            data = memoryview(await root.get(rel, start, end))
        for k in ks:
            _, off, n = sink.refs[k]
            view = data[off - start : off - start + n]
            crc, trailer = sink.binds[k]
            ref = Ref(target, off, n, crc, trailer=trailer, shard=sink.shards.get(k))
            try:
                check_stored(ref, k, view)
            except ChunkError as e:
                raise CorruptCheckpointError(
                    f"{where}: moving {k} out of the mostly-dead pack {root.url}/{rel} "
                    f"found its bytes damaged ({e}); the earlier steps that use that pack "
                    f"are damaged too: check them with `quire verify`, delete them, and "
                    "save again"
                ) from e
            await sink.own(k, [view])
            moved += n

    await asyncio.gather(*(one(t, ks) for t, ks in windows))
    log.info("%s: compacted %d bytes out of %d mostly-dead pack(s)", where, moved, len(victims))
    return moved


def _windows(sink: PackWriter, target: str, keys: list[str]) -> list[tuple[str, list[str]]]:
    """``keys`` (all in ``target``) grouped into ranged reads, in pack order."""
    keys = sorted(keys, key=lambda k: sink.refs[k][1])
    out: list[tuple[str, list[str]]] = []
    start = end = -1
    for k in keys:
        _, off, n = sink.refs[k]
        if out and off - end <= GAP and off + n - start <= WINDOW:
            out[-1][1].append(k)
            end = max(end, off + n)
        else:
            out.append((target, [k]))
            start, end = off, off + n
    return out
