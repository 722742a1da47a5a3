"""Format v2: rewriting mostly-dead packs when a partial-save journal is finalized.

Each journal version writes its own packs.  When later versions replace or delete leaves,
the older packs keep those bytes, now dead.  ``quire.partial.finalize`` calls
:func:`finalize_plan` with the replayed tree and the journal; it reads the chunk indexes
of the versions that lost a leaf since (the others are wholly live and kept unread):

* per pack, **live bytes** = the lengths of the objects whose leaf is still in the final
  tree; the pack's size is the end of its last object (packs are plain concatenations);
* a pack with ``2 * live < size`` (strictly less than half live, a fully dead pack
  included) is **rewritten**; a pack at or above half is **kept** as it is;
* a chunk index (one version, one process) holding a rewritten pack is **superseded**:
  every live array it holds is moved to a fresh txid ``R``.  Its leaf's location becomes
  ``d/R/<old txid>/<unit>/<path>`` (the old txid stays in the path, so two leaves saved by
  different versions at the same list index never collide), its zarr keys the same way.
  Chunks that sat in a rewritten pack are copied into new packs ``d/R/%packs/p<f>-<seq>``
  of the finalizing process ``f``: streamed, within the byte budget, each checked against
  the old index (``quire._format.chunkcheck.check_stored``) and its own codec chain as it is copied,
  and bound in the new index the way the old one bound it.  Chunks in
  kept packs are not copied: ``R``'s index points at the old pack, in place;
* ``R`` gets one index per original process (``d/R/%packs/p<p>.index.json``, what process
  ``p`` had), so a process loading its share still reads only its own index;
* a leaf that is not a zarr array (no ``chunk_shape``: a third-party handler's objects) is
  never moved: an index holding one is not superseded and its packs are kept.

Liveness is decided once, before anything moves.  Nothing is deleted here before the
commit: the new record names the kept indexes plus ``R``'s and every txid whose packs it
uses, and after the commit point the caller deletes :attr:`RewritePlan.dropped` (the rewritten
packs and the superseded index objects inside txids that stay live); txids with no live
data left go the usual way.  A crash before the commit leaves the journal untouched
(loadable, finalize can be run again) and ``d/R/`` unreferenced: garbage for ``quire gc``.
A crash after it leaves the journal behind; ``quire.partial.discard`` then calls
:func:`finish` to delete what the finalize superseded.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from quire._engine.commit import drop_txids
from quire._engine.save import new_txid, process_layout
from quire._format.chunkcheck import check_stored
from quire._format.chunkid import index_bytes
from quire._format.chunkindex import (
    ChunkError,
    Ref,
    index_entry,
    index_key,
    parse_index,
)
from quire._format.pack import PackWriter
from quire._format.packedreader import MAX_COALESCED
from quire._format.paths import is_chunk_of
from quire._format.tree import from_json
from quire._handlers.arrayplan import layout_from_record
from quire._handlers.zarr_io import chunk_checker
from quire._runtime.budget import ByteBudget
from quire._runtime.config import current
from quire._runtime.ioloop import run_blocking
from quire._store.base import Backend
from quire.errors import CheckpointExistsError, CorruptCheckpointError

log = logging.getLogger("quire")

CONCURRENCY = 8  # coalesced range reads in flight


@dataclass(frozen=True)
class RewritePlan:
    """What a finalize commits: the tree (moved leaves relocated), the chunk indexes and
    txids the record names, and what to delete once it is committed."""

    tree: dict[str, Any]
    indexes: list[dict[str, Any]]
    txids: set[str]
    txid: str | None = None  # R, the txid of the rewrite (None: nothing rewritten)
    dropped: list[str] = field(default_factory=list)  # objects to delete after the commit
    stats: dict[str, int] = field(default_factory=dict)


def _owner(key: str, locations: Collection[str]) -> str | None:
    """The location in ``locations`` that ``key`` lies under (its leaf), else None.  By
    prefix, not by zarr key syntax: a third-party handler's objects count too."""
    parts = key.split("/")
    for i in range(len(parts) - 1, 2, -1):
        loc = "/".join(parts[:i])
        if loc in locations:
            return loc
    return None


def _moved(key: str, txid: str) -> str:
    """``d/T/rest`` -> ``d/R/T/rest``."""
    return f"d/{txid}/{key[2:]}"


def leaf_records(tree: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for leaf in from_json(tree).leaves():
        loc = leaf.value.get("location")
        if isinstance(loc, str) and loc.startswith("d/"):
            out[loc] = leaf.value
    return out


def _relocate(node: dict[str, Any], moved: Mapping[str, str]) -> None:
    if node["kind"] == "leaf":
        loc = node.get("location")
        if isinstance(loc, str) and loc in moved:
            node["location"] = moved[loc]
        return
    for c in node["children"]:
        _relocate(c, moved)


async def _read_indexes(
    backend: Backend,
    url: str,
    entries: Sequence[Mapping[str, Any]],
    why: str = "the partial save's data is damaged (finalize committed nothing)",
) -> list[dict[str, Ref]]:
    sem = asyncio.Semaphore(16)

    async def one(e: Mapping[str, Any]) -> dict[str, Ref]:
        async with sem:
            try:
                return parse_index(await backend.get(e["object"]), e, url)
            except (FileNotFoundError, ChunkError) as err:
                raise CorruptCheckpointError(
                    f"{url}: chunk index {e['object']}: {err or 'missing'}; {why}"
                ) from err

    return list(await asyncio.gather(*(one(e) for e in entries)))


def pack_liveness(refs: Sequence[Mapping[str, Ref]], live: set[str]) -> dict[str, tuple[int, int]]:
    """``{pack: (live bytes, size)}`` over the given indexes' refs."""
    out: dict[str, list[int]] = {}
    for m in refs:
        for key, r in m.items():
            if r.target is None:
                continue
            acc = out.setdefault(r.target, [0, 0])
            acc[1] = max(acc[1], r.offset + r.length)
            if _owner(key, live) is not None:
                acc[0] += r.length
    return {k: (v[0], v[1]) for k, v in out.items()}


def rewrites(live_bytes: int, size: int) -> bool:
    """The rule: a pack is rewritten when strictly less than half of its bytes are live."""
    return 2 * live_bytes < size


async def plan(
    backend: Backend,
    url: str,
    tree: dict[str, Any],
    entries: Sequence[dict[str, Any]],
    *,
    new_txid: str,
    process: int,
    pack_bytes: int,
    byte_budget: int,
    suspects: Collection[str] | None = None,
) -> RewritePlan:
    """Decide which packs to rewrite, copy their live chunks under ``new_txid`` and write
    its indexes; returns what to commit.  Only the indexes of txids in ``suspects`` (all
    when None) are read: the others are known to be wholly live and are kept unread.  On
    failure ``d/<new_txid>/`` may hold garbage (the caller removes it; nothing references
    it)."""
    leaves = leaf_records(tree)
    live = set(leaves)
    base_txids = {loc.split("/")[1] for loc in live} | {e["txid"] for e in entries}
    untouched = [e for e in entries if suspects is not None and e["txid"] not in suspects]
    entries = [e for e in entries if suspects is None or e["txid"] in suspects]
    if not entries:
        return RewritePlan(tree, untouched, base_txids)
    refs = await _read_indexes(backend, url, entries)
    sizes = pack_liveness(refs, live)
    doomed = {p for p, (n, size) in sizes.items() if rewrites(n, size)}
    superseded: list[int] = []
    blocked = 0
    for i, m in enumerate(refs):
        if not any(r.target in doomed for r in m.values()):
            continue
        locs = {loc for k in m if (loc := _owner(k, live)) is not None}
        if any("chunk_shape" not in leaves[loc] for loc in locs):
            blocked += 1  # a leaf we cannot move: keep this index and its packs
            continue
        superseded.append(i)
    moving: set[str] = set()
    for i in superseded:
        moving |= {loc for k in refs[i] if (loc := _owner(k, live)) is not None}
    sup = set(superseded)
    stats = {
        "packs": len(sizes),
        "pack_bytes": sum(s for _, s in sizes.values()),
        "live_bytes": sum(n for n, _ in sizes.values()),
        "packs_rewritten": 0,
        "bytes_copied": 0,
        "indexes_blocked": blocked,
    }
    if not sup:
        return RewritePlan(tree, untouched + list(entries), base_txids, stats=stats)
    dropped_packs = {r.target for i in sup for r in refs[i].values() if r.target in doomed}
    assert all(p is not None for p in dropped_packs)
    stats["packs_rewritten"] = len(dropped_packs)

    # Every key of a moving leaf, from every index of its txid, goes to R's index of the
    # same process; chunks in rewritten packs are copied, the rest are referenced in place.
    new_refs: dict[int, dict[str, Any]] = {}
    new_binds: dict[int, dict[str, tuple[str, bool]]] = {}
    new_shards: dict[int, dict[str, str]] = {}  # zarr shards' trailers, as the old index had
    copies: dict[str, list[tuple[str, Ref, int]]] = {}
    kept_targets: set[str] = set()
    for e, m in zip(entries, refs):
        p = e["process"]
        for key, r in m.items():
            if _owner(key, moving) is None:
                continue
            nk = _moved(key, new_txid)
            if r.inline is not None:
                new_refs.setdefault(p, {})[nk] = r.inline.decode()
                new_binds.setdefault(p, {})[nk] = (r.crc, r.trailer)
            elif r.target in doomed:
                assert r.target is not None
                copies.setdefault(r.target, []).append((nk, r, p))
            else:
                assert r.target is not None
                new_refs.setdefault(p, {})[nk] = [r.target, r.offset, r.length]
                new_binds.setdefault(p, {})[nk] = (r.crc, r.trailer)
                if r.shard is not None:
                    new_shards.setdefault(p, {})[nk] = r.shard
                kept_targets.add(r.target)
    writer = PackWriter(backend, new_txid, process, pack_bytes, byte_budget)
    origin: dict[str, int] = {}
    try:
        stats["bytes_copied"] = await _copy(
            backend, url, copies, writer, byte_budget, leaves, origin
        )
        await writer.close()
    except BaseException:
        await writer.abort()
        raise
    for nk, ref in writer.refs.items():
        new_refs.setdefault(origin[nk], {})[nk] = ref
        new_binds.setdefault(origin[nk], {})[nk] = writer.binds[nk]
        if nk in writer.shards:
            new_shards.setdefault(origin[nk], {})[nk] = writer.shards[nk]
    new_entries = []
    for p in sorted(new_refs):
        data = index_bytes(new_txid, p, new_refs[p], new_binds[p], new_shards.get(p))
        key = index_key(new_txid, p)
        await backend.put(key, [data])
        new_entries.append(index_entry(new_txid, p, key, data))
    await backend.sync()

    moved_locs = {loc: _moved(loc, new_txid) for loc in moving}
    out_tree = copy.deepcopy(tree)
    _relocate(out_tree, moved_locs)
    still = live - moving
    kept = [
        e
        for i, (e, m) in enumerate(zip(entries, refs))
        if i not in sup and any(_owner(k, still) is not None for k in m)
    ]
    kept += untouched
    indexes = kept + new_entries
    txids = {loc.split("/")[1] for loc in still} | {e["txid"] for e in indexes}
    txids |= {t.split("/")[1] for t in kept_targets}  # R itself: only when it holds data
    kept_keys = {e["object"] for e in kept}
    dropped = sorted(dropped_packs)  # type: ignore[arg-type]
    dropped += [e["object"] for e in entries if e["object"] not in kept_keys]
    dropped = [k for k in dropped if k.split("/")[1] in txids]  # others go with their txid
    log.info(
        "%s: finalize rewrote %d of %d packs (%d live bytes copied into d/%s)",
        url, stats["packs_rewritten"], stats["packs"], stats["bytes_copied"], new_txid,
    )  # fmt: skip
    return RewritePlan(out_tree, indexes, txids, new_txid if new_entries else None, dropped, stats)


async def _copy(
    backend: Backend,
    url: str,
    copies: Mapping[str, list[tuple[str, Ref, int]]],
    writer: PackWriter,
    byte_budget: int,
    leaves: Mapping[str, dict[str, Any]],
    origin: dict[str, int],
) -> int:
    """Copy the chunks of ``copies`` (per old pack: new key, old ref, process) into
    ``writer``, reading adjacent chunks together in ranges of up to ``MAX_COALESCED``."""

    budget = ByteBudget(byte_budget)
    sem = asyncio.Semaphore(CONCURRENCY)
    checkers: dict[str, Callable[[bytes], None]] = {}
    runs: list[tuple[str, list[tuple[str, Ref, int]]]] = []
    for pack, items in sorted(copies.items()):
        items.sort(key=lambda x: x[1].offset)
        run: list[tuple[str, Ref, int]] = []
        for it in items:
            if run and (
                it[1].offset != run[-1][1].offset + run[-1][1].length
                or it[1].offset + it[1].length - run[0][1].offset > MAX_COALESCED
            ):
                runs.append((pack, run))
                run = []
            run.append(it)
        if run:
            runs.append((pack, run))

    def check(nk: str, old: str, r: Ref, data: memoryview) -> None:
        check_stored(r, old, data)  # identity, in one pass (no decoder is assumed)
        loc = _owner(old, leaves)
        if loc is None or not is_chunk_of(old, loc):
            return
        if loc not in checkers:  # the chunk's own codec chain: crc32c, shard index
            checkers[loc] = chunk_checker(layout_from_record(leaves[loc], url))
        checkers[loc](bytes(data))

    async def one(pack: str, run: list[tuple[str, Ref, int]]) -> int:
        a = run[0][1].offset
        b = run[-1][1].offset + run[-1][1].length
        async with sem, budget.hold(b - a):
            data = memoryview(await backend.get(pack, a, b))
            if len(data) != b - a:
                raise CorruptCheckpointError(
                    f"{url}/{pack} is truncated ({len(data)} bytes at {a}, expected {b - a}); "
                    "the partial save's data is damaged (nothing was committed)"
                )
            for nk, r, p in run:
                part = data[r.offset - a : r.offset - a + r.length]
                old = f"d/{nk.split('/', 2)[2]}"
                try:
                    if r.length > (1 << 16):
                        await run_blocking(check, nk, old, r, part)
                    else:
                        check(nk, old, r, part)
                except ChunkError as e:
                    raise CorruptCheckpointError(
                        f"{url}: {e}; the partial save's data is damaged (nothing was "
                        "committed; `quire.partial.load` names the leaf)"
                    ) from e
                origin[nk] = p
                await writer.put_bound(nk, [part], trailer=r.trailer, crc=r.crc, shard=r.shard)
        return b - a

    try:
        async with asyncio.TaskGroup() as tg:  # the first failure cancels the rest
            tasks = [tg.create_task(one(p, r)) for p, r in runs]
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None  # the first failure; the rest were cancelled
    return sum(t.result() for t in tasks)


async def finalize_plan(
    backend: Backend, url: str, tree: dict[str, Any], records: Sequence[Mapping[str, Any]]
) -> RewritePlan:
    """:func:`plan` for ``quire.partial.finalize`` of the journal ``records`` replayed into
    ``tree``, on this (the finalizing) process, with the current Context's ``pack_bytes``
    and ``byte_budget``; removes its own data on failure.  It reads only the indexes of
    versions that lost a leaf (replaced or deleted since): the others are wholly live."""

    live = set(leaf_records(tree))
    live_txids = {loc.split("/")[1] for loc in live}
    entries = [e for r in records if r.get("txid") in live_txids for e in r.get("indexes", [])]
    suspects = {
        r["txid"]
        for r in records
        if r.get("txid") in live_txids
        and r.get("tree") is not None
        and not set(leaf_records(r["tree"])) <= live
    }
    cfg = current()
    txid = new_txid()
    try:
        return await plan(
            backend, url, tree, entries, new_txid=txid, process=process_layout()[0],
            pack_bytes=cfg.pack_bytes, byte_budget=cfg.byte_budget, suspects=suspects,
        )  # fmt: skip
    except BaseException:
        await drop_txids(backend, url, [txid])
        raise


@contextlib.asynccontextmanager
async def committing(backend: Backend, url: str, p: RewritePlan) -> AsyncIterator[None]:
    """Around the commit of ``p``'s record: when another finalize won the race, remove the
    rewrite's data (nothing references it); once committed, delete what it superseded."""
    try:
        yield
    except CheckpointExistsError:
        if p.txid is not None:
            await drop_txids(backend, url, [p.txid])
        raise
    await _drop(backend, url, p.dropped)


async def _drop(backend: Backend, url: str, keys: Sequence[str]) -> None:
    """Delete superseded packs, then their index objects (an index left by an interrupted
    deletion still names the packs :func:`finish` has to find)."""
    packs = [k for k in keys if not k.endswith(".index.json")]
    indexes = [k for k in keys if k.endswith(".index.json")]
    try:
        for group in (packs, indexes):
            if group:
                await backend.delete(group)
    except Exception as e:  # the checkpoint is whole; only dead bytes stay behind
        log.warning(
            "%s: could not remove %d packs and chunk indexes the finalize superseded (%s: %s); "
            "they hold only dead bytes: `quire gc` (or quire.partial.discard(url)) removes "
            "them while the journal is there",
            url, len(keys), type(e).__name__, e,
        )  # fmt: skip


async def finish(
    backend: Backend, url: str, records: Sequence[Mapping[str, Any]], doc: Mapping[str, Any]
) -> None:
    """Finish a finalize that was killed after its commit point, before it deleted what it
    superseded: the chunk indexes of the journal ``records`` that the committed record
    ``doc`` no longer names, inside txids it still references, and their packs that none
    of its indexes points at (other txids go whole, the usual way)."""
    live = set(doc["txids"])
    named = {e["object"] for e in doc.get("indexes", [])}
    stale = [
        e for r in records for e in r.get("indexes", [])
        if e["txid"] in live and e["object"] not in named
    ]  # fmt: skip
    if not stale:
        return
    journal_txids = {r.get("txid") for r in records}
    users = [
        e for e in doc.get("indexes", [])
        if e["txid"] not in journal_txids or e["txid"] in {s["txid"] for s in stale}
    ]  # fmt: skip
    try:
        got = await _read_indexes(backend, url, users, "the checkpoint is damaged")
        used = {r.target for m in got for r in m.values()}
    except CorruptCheckpointError as err:
        log.warning("%s: not removing superseded packs: %s", url, err)
        return
    doomed: list[str] = []
    for e in stale:
        try:
            refs = parse_index(await backend.get(e["object"]), e, url)
        except FileNotFoundError:
            continue  # removed already, after its packs
        except ChunkError as err:
            log.warning("%s: not removing superseded packs of %s: %s", url, e["object"], err)
            continue
        doomed += sorted({r.target for r in refs.values() if r.target and r.target not in used})
        doomed.append(e["object"])
    await _drop(backend, url, doomed)
