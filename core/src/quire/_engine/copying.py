"""``quire cp``: copy a committed checkpoint between any two backends.

Order (the commit protocol, as for a save):

1. read SRC's commit record ``quire.json`` (nothing else makes a checkpoint);
2. list what it references: each array leaf's ``zarr.json`` and every chunk of its grid,
   every object under each checkpointable unit's location;
3. copy those objects, at most ``max_concurrency`` at a time within ``byte_budget`` bytes,
   checking each chunk's crc32c (and size, and decodability) as it is read - a damaged
   source fails the copy and names the chunk - then ``sync`` DST;
4. COMMIT: ``quire._engine.commit.publish`` writes the very same record at DST (a conditional
   create or, with ``overwrite``, a compare-and-swap over DST's record, after which DST's
   superseded data is deleted).

A crash leaves DST as it was, plus unreferenced objects under ``d/<txid>/`` that
``quire gc`` removes.  Data keeps its txids and locations, so the copy is byte-identical.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Collection
from typing import Any

from quire._engine import commit as _commit
from quire._engine.packcopy import plan_packed
from quire._engine.unborrow import Unborrow
from quire._format import record as _records
from quire._format.borrow import BorrowingView, parent_url
from quire._format.paths import is_chunk, is_safe_location
from quire._format.tree import from_json, keystr
from quire._handlers.arrays import layout_from_record
from quire._handlers.base import StoredObject
from quire._handlers.owned import check_unit_object, leaf_objects
from quire._handlers.zarr_io import chunk_checker
from quire._runtime.budget import ByteBudget
from quire._runtime.config import current
from quire._runtime.ioloop import run_blocking
from quire._store.base import NOT_DATA, Backend
from quire._store.url import normalize, open_backend
from quire.errors import CheckpointExistsError, CorruptCheckpointError

__all__ = ["CopyResult", "copy_checkpoint"]


@dataclasses.dataclass(frozen=True)
class CopyResult:
    """What a copy did: objects and bytes written (the record included), objects verified,
    and the array chunks copied (the unit ``quire verify`` and ``quire info`` count).

    Attributes
    ----------
    src, dst : str
        The source and destination URLs.
    objects, bytes : int
        Objects and bytes written at ``dst``.
    verified : int
        Objects whose bytes were checked on the way.
    seconds : float
        How long the copy took.
    chunks : int
        Array chunks copied.
    arrays, nbytes : int
        Array leaves and their bytes, as the record describes them (0 when not counted).
    format : str
        The source's format (``"quire"``, or the source plugin's name for a conversion).
    """

    src: str
    dst: str
    objects: int
    bytes: int
    verified: int
    seconds: float
    chunks: int = 0
    arrays: int = 0
    nbytes: int = 0
    format: str = "quire"


@dataclasses.dataclass(frozen=True)
class _Item:
    """One object to copy: its key, what it belongs to, how to check it, a size estimate,
    and how many array chunks it holds (0 for a ``zarr.json``, an index, a unit's object)."""

    key: str
    owner: str
    check: Callable[[bytes], None] | None = None
    size: int | None = None
    chunks: int = 0
    dest: str | None = None  # the key at DST, when not ``key`` (a borrowed pack)
    rewrite: Callable[[bytes], bytes] | None = None  # what DST stores (a borrowing index)


# ----------------------------------------------------------------------------- checks
_check_unit_object = check_unit_object  # the name tier and promotion modules import


# ----------------------------------------------------------------------------- planning
def _range_checks(objs: list[StoredObject]) -> Callable[[bytes], None] | None:
    """One check of a whole object from the checks of the ranges leaves own in it."""
    checked = [o for o in objs if o.check is not None or o.length is not None]
    if not checked:
        return None

    def check(data: bytes) -> None:
        for o in checked:
            part = o.cut(data)
            if o.length is not None and len(part) != o.length:
                raise ValueError(f"{len(part)} bytes at {o.offset}, expected {o.length}")
            if o.check is not None:
                o.check(part)

    return check


async def plan(backend: Backend, url: str, doc: dict[str, Any]) -> list[_Item]:
    """Every object SRC's record references, with its check (leaves: their handlers')."""
    items: list[_Item] = []
    listed: list[tuple[str, str, Callable[[bytes], None] | None]] = []
    leaves = []
    packed = {e["txid"] for e in doc.get("indexes", [])}
    checkers: dict[str, Callable[[bytes], None]] = {}
    for name, unit in doc["units"].items():
        if unit["kind"] == "pytree":
            for leaf in from_json(unit["tree"]).leaves():
                loc = leaf.value.get("location")
                if loc is not None and not is_safe_location(loc):
                    raise CorruptCheckpointError(
                        f"{url}/{_records.RECORD}: leaf {keystr(leaf.path)!r} has location "
                        f"{loc!r}, outside d/; refusing to copy it"
                    )
                rec = leaf.value
                if "chunk_shape" in rec and loc is not None and loc.split("/")[1] in packed:
                    # format v2: the leaf's chunks are copied and verified inside its packs

                    checkers[loc] = chunk_checker(layout_from_record(rec, url))
                else:
                    leaves.append(leaf)
        elif unit["kind"] == "handler":
            loc = unit["location"]
            if not is_safe_location(loc):
                raise CorruptCheckpointError(
                    f"{url}/{_records.RECORD}: unit {name!r} has location {loc!r}, outside d/"
                )
            listed.append((loc, f"unit {name!r}", _check_unit_object))
    # Objects by key: a packed object holds ranges of several leaves; it is copied once.
    owned: dict[str, tuple[str, list[StoredObject]]] = {}
    for leaf, objs in await leaf_objects(url, backend, leaves):
        for o in objs:
            owned.setdefault(o.key, (keystr(leaf.path), []))[1].append(o)
    for key, (owner, objs) in owned.items():
        whole = objs[0].size if len(objs) == 1 and objs[0].length is None else None
        chunks = sum(is_chunk(o.key) for o in objs)
        items.append(_Item(key, owner, _range_checks(objs), whole, chunks))
    if packed:
        items += await plan_packed(
            backend, url, doc["indexes"], checkers, _Item, is_chunk, doc["txids"]
        )
    found = await asyncio.gather(*(backend.list(loc) for loc, _, _ in listed))
    for (_, owner, check), keys in zip(listed, found):
        items += [_Item(k, owner, check) for k in keys]
    return items


# ----------------------------------------------------------------------------- copying
def same_checkpoint(dst: str) -> str:
    """The message refusing a copy onto its own source (``--overwrite`` does not apply)."""
    return f"{dst}: the destination is the source; copy to another URL (--overwrite does not apply)"


async def copy_checkpoint(
    src: str,
    dst: str,
    *,
    overwrite: bool = False,
    src_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
    progress: Callable[[int, int, int, int], None] | None = None,
) -> CopyResult:
    """Copy the checkpoint at ``src`` to ``dst``; the record is written last.

    Parameters
    ----------
    src, dst : str
        Checkpoint URLs on any backends.
    overwrite : bool
        Replace a checkpoint at ``dst`` (atomically; its old data is deleted after).
    src_options, dst_options : dict, optional
        ``storage_options`` for each side.
    progress : callable, optional
        ``progress(chunks_done, chunks_total, bytes_done, bytes_total_estimate)``, after
        each object: array chunks as ``quire verify`` and ``quire info`` count them (a pack
        holds many, a ``zarr.json`` none), bytes as copied.

    Raises
    ------
    CheckpointNotFoundError
        No checkpoint at ``src``.
    CheckpointExistsError
        A checkpoint is at ``dst`` and ``overwrite`` is False (checked first, and again
        by the conditional create of the record), or ``dst`` is ``src``.
    CorruptCheckpointError
        An object of ``src`` is missing or fails its checksum (nothing is committed).
    """
    t0 = time.perf_counter()
    src, dst = normalize(src), normalize(dst)
    if src == dst:
        raise CheckpointExistsError(same_checkpoint(dst))
    sb = open_backend(src, src_options)
    db = open_backend(dst, dst_options)
    try:
        record = await _commit.read(sb, src)
        raw, doc = record.raw, record.doc
        if not overwrite:
            await _commit.ensure_absent(db, dst, "pass --overwrite to replace it")
        unb = Unborrow.of(doc)  # an incremental step: the copy owns what it borrows
        rb = sb if unb is None else BorrowingView(sb, open_backend(parent_url(src), src_options))
        items = await plan(rb, src, doc)
        txids: Collection[str] = record.txids
        if unb is not None:
            entries = {e["object"]: e for e in doc["indexes"]}
            items = [
                dataclasses.replace(
                    i,
                    dest=unb.dest(i.key),
                    rewrite=unb.index(entries[i.key]) if i.key in entries else None,
                )
                for i in items
            ]
        try:
            done_bytes, verified, chunks = await _copy_objects(rb, db, src, items, progress)
        except Exception:  # a damaged source, a storage error: nothing of the copy stays
            written = {d.split("/")[1] for d in (i.dest or i.key for i in items)
                       if d.startswith("d/") and d.count("/") >= 2}  # fmt: skip
            await _commit.drop_unreferenced(db, dst, written)
            raise
        await db.sync()
        if unb is not None:
            raw, txids = unb.record(raw)
        await _commit.publish(
            db, dst, raw, txids, overwrite=overwrite, fix="pass --overwrite to replace it"
        )
    finally:
        await sb.close()
        await db.close()
    return CopyResult(
        src, dst, len(items) + 1, done_bytes + len(raw), verified, time.perf_counter() - t0,
        chunks,
    )  # fmt: skip


async def _copy_objects(
    sb: Backend,
    db: Backend,
    src: str,
    items: list[_Item],
    progress: Callable[[int, int, int, int], None] | None,
) -> tuple[int, int, int]:
    cfg = current()
    budget = ByteBudget(cfg.byte_budget)
    sem = asyncio.Semaphore(max(1, cfg.max_concurrency))
    total_est = sum(i.size or 0 for i in items)
    total_chunks = sum(i.chunks for i in items)
    done = [0, 0, 0, 0]  # objects, bytes, verified, chunks

    async def one(item: _Item) -> None:
        async with sem:
            size = item.size if item.size is not None else await sb.size(item.key)
            async with budget.hold(size):
                try:
                    data = await sb.get(item.key)
                except FileNotFoundError:
                    raise CorruptCheckpointError(
                        f"{src}: {item.owner}: {item.key} is missing; the checkpoint is "
                        "damaged (run `quire verify`); nothing was committed at the destination"
                    ) from None
                except OSError as e:
                    if e.errno not in NOT_DATA:  # a storage error, not damage
                        raise
                    raise CorruptCheckpointError(
                        f"{src}: {item.owner}: {item.key} is not a data object ({e.strerror}: "
                        "a symbolic link, a FIFO, a directory); the checkpoint is damaged; "
                        "nothing was committed at the destination"
                    ) from e
                if item.check is not None:
                    try:
                        await run_blocking(item.check, data)
                    except Exception as e:
                        raise CorruptCheckpointError(
                            f"{src}: {item.owner}: {item.key} fails verification ({e}); the "
                            "checkpoint is damaged (run `quire verify`); nothing was committed "
                            "at the destination"
                        ) from e
                    done[2] += 1
                if item.rewrite is not None:
                    data = item.rewrite(data)
                await db.put(item.dest or item.key, [data])
        done[0] += 1
        done[1] += len(data)
        done[3] += item.chunks
        if progress is not None:
            progress(done[3], total_chunks, done[1], max(total_est, done[1]))

    tasks = [asyncio.ensure_future(one(i)) for i in items]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return done[1], done[2], done[3]
