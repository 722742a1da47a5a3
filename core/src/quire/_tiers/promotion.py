"""Incremental promotion: a committed step of the local tier becomes a step of an
incremental persistent root, uploading only what that root does not store yet.

``quire._engine.copying`` copies every object of a step.  Here (``Checkpointer(root,
incremental=True, local=quire.LocalTier(...))``) the step is instead *re-packed* at the
destination, key by key, through a :class:`~quire._format.pack.PackWriter` in incremental
mode whose base is the persistent root's previous step (``quire._engine.incremental``):

1. every chunk of the local step is read (ranged reads of its packs), checked against
   its binding, hashed (xxh3-128) and either borrowed — the base holds the same bytes at
   the same key path; before the first borrow, the lease and the check that the base
   still exists (``Incremental.lease``) — or written into the destination's packs;
   mostly-dead packs are compacted as a save compacts them (``quire._engine.compaction``);
2. the chunk index; ``sync``; COMMIT: the local record with its ``indexes`` replaced by
   the new index's entry (its borrowed packs declared) and its checksum recomputed, by the
   conditional create of ``quire.json``; the lease is released.

Keys, locations, txid and units stay those of the local step, so the persistent step reads
exactly as the local one.  What cannot be re-packed this way (format v1, several indexes,
units stored as objects of their own) is copied whole by ``copy_checkpoint``.

With several processes (:func:`promote_spread`: each process's local root holds its own
part of the step, ``quire._tiers.spread_save``) every process re-packs the chunks of its own
index the same way, borrowing from *its* index of the previous persistent step (as a
multi-process incremental save does), and copies the checkpointable-unit objects it owns
whole (the primary those of whole units, each process its own of per-process units); once
all succeeded the primary reads every process's new index, puts their entries in the record
and commits it by the conditional create.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

from quire._engine import commit as _commit
from quire._engine import record_parts as _record_parts
from quire._engine.compaction import compact
from quire._engine.copying import _check_unit_object, _copy_objects, _Item, copy_checkpoint
from quire._engine.incremental import Incremental, LeafInfo, LeafKey, record_leaves
from quire._format import record as _records
from quire._format.chunkcheck import check_stored
from quire._format.chunkid import Ref
from quire._format.chunkindex import parse_index
from quire._format.crc import ChunkError
from quire._format.pack import PackWriter
from quire._runtime.config import current
from quire._runtime.multihost import Coordinator
from quire._store.base import Backend
from quire._store.url import normalize, open_backend
from quire._tiers.ownership import entry_of, owned_unit_locations
from quire.errors import CorruptCheckpointError

log = logging.getLogger("quire")

WINDOW = 32 << 20  # bytes of one ranged read of a local pack
READS = 4


async def promote(
    src: str,
    dst: str,
    inc: Incremental,
    *,
    overwrite: bool = False,
    src_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
) -> dict[str, int]:
    """Promote the committed step at ``src`` to ``dst`` (a step directory of ``inc``'s
    root), borrowing what the root's previous step stores; ``{"written_bytes",
    "borrowed_bytes", ...}`` (``inc.stats``)."""
    src, dst = normalize(src), normalize(dst)
    sb = open_backend(src, src_options)
    try:
        record = await _commit.read(sb, src)
        doc = record.doc
        entries = doc.get("indexes") or []
        if len(entries) != 1 or any(
            u.get("kind") not in ("pytree", "json") for u in doc["units"].values()
        ):
            log.info("%s: copied whole to %s (not a one-index packed step)", src, dst)
            res = await copy_checkpoint(
                src, dst, overwrite=overwrite, src_options=src_options, dst_options=dst_options
            )
            return {"written_bytes": res.bytes, "borrowed_bytes": 0}
        return await _promote(sb, src, dst, inc, record, overwrite, dst_options)
    finally:
        await sb.close()


async def _promote(
    sb: Backend,
    src: str,
    dst: str,
    inc: Incremental,
    record: Any,
    overwrite: bool,
    dst_options: dict[str, Any] | None,
) -> dict[str, int]:
    doc = record.doc
    (entry,) = doc["indexes"]
    txid = entry["txid"]
    refs = parse_index(await sb.get(entry["object"]), entry, src, doc["txids"])
    leaves = dict(record_leaves(doc))
    db = open_backend(dst, dst_options)
    root = open_backend(inc.root, dst_options)
    cfg = current()
    sink = PackWriter(db, txid, entry["process"], cfg.pack_bytes, cfg.byte_budget)
    try:
        if not overwrite:
            await _commit.ensure_absent(db, dst, "pass overwrite=True to replace it")
        new = await _rewrite(sink, sb, src, refs, inc, root, dst, leaves)
        await db.sync()
        assert new is not None
        data = _with_indexes(record.raw, [new])
        await _commit.publish(db, dst, data, [txid], overwrite=overwrite, keep_superseded=True)
        inc.committed()
    except BaseException:
        await sink.abort()
        inc.failed()
        raise
    finally:
        await inc.release(root)
        await asyncio.gather(db.close(), root.close())
    inc.stats = _stats(sink)
    return inc.stats


async def promote_spread(
    src: str,
    dst: str,
    coord: Coordinator,
    inc: Incremental,
    *,
    overwrite: bool,
    src_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
) -> dict[str, int]:
    """Promote this process's part of the multi-process local step at ``src`` (its own
    root) to ``dst``, re-packed against ``inc``'s previous step; the primary commits the
    record with every process's new index (``coord``: all succeed or nothing commits)."""
    src, dst = normalize(src), normalize(dst)
    sb, db = open_backend(src, src_options), open_backend(dst, dst_options)
    root = open_backend(inc.root, dst_options)
    cfg = current()
    sink: PackWriter | None = None
    try:
        record = await _commit.read(sb, src)
        doc = record.doc
        (txid,) = doc["txids"]  # one txid for every process (quire._tiers.spread_save)
        entry = entry_of(doc, coord.index)
        leaves = dict(record_leaves(doc))
        units: list[str] = []  # this process's objects of checkpointable units
        locs = owned_unit_locations(doc, coord.index, coord.primary)
        for keys in await asyncio.gather(*(sb.list(loc) for loc in locs)):
            units += keys

        async def work() -> dict[str, Any] | None:
            nonlocal sink
            if not overwrite:
                await _commit.ensure_absent(db, dst, "pass force=True to replace it")
            items = [_Item(k, "a checkpointable unit", _check_unit_object) for k in units]
            await _copy_objects(sb, db, src, items, None)
            new = None
            if entry is not None:
                refs = parse_index(await sb.get(entry["object"]), entry, src, doc["txids"])
                sink = PackWriter(db, txid, coord.index, cfg.pack_bytes, cfg.byte_budget)
                new = await _rewrite(sink, sb, src, refs, inc, root, dst, leaves)
            await db.sync()
            await _record_parts.share(coord, {}, new)  # before it reports its writes done
            return new

        async def commit(new: dict[str, Any] | None) -> None:
            got = await _record_parts.shared(coord)
            entries = _record_parts.index_entries(coord, txid, new, got, dst)
            data = _with_indexes(record.raw, entries or [])
            await _commit.publish(
                db, dst, data, record.txids, overwrite=overwrite, coord=coord, keep_superseded=True
            )

        async def cleanup() -> None:
            kept = await _commit._txids_at(db, dst)
            await _commit.drop_txids(db, dst, sorted(record.txids - kept))

        try:
            await _commit.collective(coord, dst, work, commit, cleanup, lambda _: {})
        except BaseException:
            if sink is not None:
                await sink.abort()
            inc.failed()
            raise
        inc.committed()
    finally:
        await inc.release(root)
        await asyncio.gather(sb.close(), db.close(), root.close())
    inc.stats = _stats(sink)
    return inc.stats


async def _rewrite(
    sink: PackWriter,
    sb: Backend,
    src: str,
    refs: Mapping[str, Ref],
    inc: Incremental,
    root: Backend,
    dst: str,
    leaves: dict[LeafKey, LeafInfo],
) -> dict[str, Any] | None:
    """Re-pack ``refs`` (one process's index of the local step ``src``) into ``sink``,
    borrowing from ``inc``'s previous step and compacting as a save does; the index entry
    (None: nothing written), what was written noted in ``inc``."""
    step, txid = dst[len(inc.root) + 1 :], sink.txid
    paths = {info.location: key for key, info in leaves.items()}
    sink.incremental(inc.candidate(step, paths), lambda: inc.lease(root, step, txid))
    await _repack(sb, src, refs, sink)
    if sink.previous is not None:
        await compact(sink, root, sink.previous.sizes, inc.compact_below, dst)
    new = await sink.finish()
    inc.wrote(step, txid, sink.refs, sink.binds, sink.shards, sink.hashes or {}, leaves)
    return new


def _stats(sink: PackWriter | None) -> dict[str, int]:
    if sink is None:
        return {"borrowed_bytes": 0, "written_bytes": 0, "compacted_bytes": 0}
    return {
        "borrowed_bytes": sink.borrowed_bytes,
        "written_bytes": sink.bytes,
        "compacted_bytes": sink.compacted,
    }


def _with_indexes(raw: bytes, entries: list[dict[str, Any]]) -> bytes:
    """The commit record ``raw`` with its ``indexes`` replaced and its checksum redone."""
    doc = json.loads(raw)
    doc["indexes"] = entries
    doc["checksum"] = _records.record_checksum(doc)
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()


async def _repack(sb: Backend, src: str, refs: Mapping[str, Ref], sink: PackWriter) -> None:
    """Put every key of the local step into ``sink``, each chunk checked on the way."""
    windows: list[list[tuple[str, Ref]]] = []
    by_pack: dict[str, list[tuple[str, Ref]]] = {}
    for key, ref in refs.items():
        if ref.target is None:  # inline (zarr.json): the writer inlines it again
            assert ref.inline is not None
            await sink.put_bound(key, [ref.inline], crc=ref.crc)
        else:
            by_pack.setdefault(ref.target, []).append((key, ref))
    for rs in by_pack.values():
        rs.sort(key=lambda kr: kr[1].offset)
        for kr in rs:
            w = windows[-1] if windows else None
            if (
                w is not None
                and w[0][1].target == kr[1].target
                and kr[1].offset + kr[1].length - w[0][1].offset <= WINDOW
            ):
                w.append(kr)
            else:
                windows.append([kr])
    sem = asyncio.Semaphore(READS)

    async def one(w: list[tuple[str, Ref]]) -> None:
        first = w[0][1]
        assert first.target is not None
        end = max(r.offset + r.length for _, r in w)
        async with sem:
            data = memoryview(await sb.get(first.target, first.offset, end))
        for key, ref in w:
            part = data[ref.offset - first.offset : ref.offset - first.offset + ref.length]
            try:
                check_stored(ref, key, part)
            except ChunkError as e:
                raise CorruptCheckpointError(
                    f"{src}: {e}; the local step is damaged (run `quire verify {src}`); "
                    "nothing was committed at the persistent tier"
                ) from e
            await sink.put_bound(
                key, [part], trailer=ref.trailer, crc=None if ref.trailer else ref.crc,
                shard=ref.shard,
            )  # fmt: skip

    await asyncio.gather(*(one(w) for w in windows))
