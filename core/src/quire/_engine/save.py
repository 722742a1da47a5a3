"""Save: the write side of a checkpoint, up to the commit (DESIGN.md "Commit protocol").

A save walks the tree in the caller's thread (and, for ``save_async``, copies every
owned shard to host memory there), then runs the rest on quire's event loop:

1. every leaf handler writes its data under ``d/<txid>/`` (a fresh random id),
2. ``backend.sync()`` makes the data durable,
3. COMMIT: ``quire._engine.commit.publish`` creates ``quire.json`` (or swaps it for
   ``overwrite=True``) and only then deletes the old checkpoint's data.

A crash before 3 leaves only unreferenced garbage under a fresh txid; a crash after 3
leaves the new checkpoint whole.  The read side is ``quire._engine.load``; the commit
record's one write path is ``quire._engine.commit``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import weakref
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import jax
import numpy as np

from quire._engine import commit as _commit
from quire._engine.compaction import compact
from quire._engine.incremental import Carried, Incremental, LeafInfo, LeafKey
from quire._engine.record_parts import build_record, share, unit_digests
from quire._format.pack import PackWriter
from quire._format.paths import assign_locations, escape_component
from quire._format.record import PYTREE, process_dir
from quire._format.tree import KeyPath, Node, keystr, to_json, walk
from quire._handlers import select as _selection
from quire._handlers import unit_ops as _checkpointables
from quire._handlers.arrays import ArrayHandler
from quire._handlers.base import SaveContext, SaveEntry
from quire._handlers.casting import storage_cast_at
from quire._handlers.replicas import plan_writers
from quire._runtime.budget import ByteBudget
from quire._runtime.config import current
from quire._runtime.multihost import Coordinator
from quire._store.base import Backend
from quire._store.url import open_backend
from quire.errors import LossyCastError, UnsupportedLeafError
from quire.options import StorageOptions, StorageSpec

log = logging.getLogger("quire")


def new_txid() -> str:
    return secrets.token_hex(8)


def process_layout() -> tuple[int, int, int]:
    """(process index, process count, primary process)."""
    return jax.process_index(), jax.process_count(), current().primary_process


# ----------------------------------------------------------------------------- saving
@dataclass
class PreparedSave:
    """Units walked and assigned to handlers, ready for the asynchronous part."""

    txid: str
    roots: dict[str, Node]  # pytree units
    groups: dict[str, list[tuple[Node, SaveEntry]]]  # leaf handler id -> leaves (all units)
    objects: dict[str, tuple[str, Any]]  # other units: name -> (checkpointable handler id, obj)
    order: list[str]  # unit names, in the caller's order
    coord: Coordinator
    index: dict[str, Any] | None = None  # format v2: this process's chunk-index entry
    layout: str = "packed"  # "packed" (format v2) or "chunks" (format v1)
    # Streaming writers (``quire cp`` from a source): called with a handler's entries, it
    # yields them in order, in batches, with values filled in just in time.
    feed: Callable[[list[SaveEntry]], AsyncGenerator[list[SaveEntry], None]] | None = None
    # An incremental Checkpointer save (quire._engine.incremental): leaves carried from the
    # previous step, and every leaf's (unit, key path) by location.
    incremental: Incremental | None = None
    carried: dict[int, tuple[Node, SaveEntry, Carried]] = field(default_factory=dict)
    paths: dict[str, LeafKey] = field(default_factory=dict)
    per_process: frozenset[str] = frozenset()  # units every process writes its own state of


def _is_leaf_value(x: Any) -> bool:
    return _selection.for_value(x) is not None


def _storage_for(storage: StorageSpec, path: KeyPath, leaf: Any) -> StorageOptions:
    base = StorageOptions(checksum=current().checksum, codecs=current().codecs or None)
    if storage is None:
        return base
    if isinstance(storage, StorageOptions):
        return storage
    got = storage(path, leaf)
    if got is None:
        return base
    if not isinstance(got, StorageOptions):
        raise TypeError(
            f"the storage callable returned {type(got).__name__} for {keystr(path)!r}; "
            "return a quire.StorageOptions or None"
        )
    return got


def prepare_save(
    units: Mapping[str, Any],
    storage: StorageSpec,
    *,
    copy: bool,
    url: str,
    layout: str | None = None,
    incremental: Incremental | None = None,
    coordination: str | None = None,
) -> PreparedSave:
    """Walk every unit, choose handlers, assign locations; copy to host when ``copy``.

    With several JAX processes this is a synchronisation point: the primary's txid is
    used everywhere.  With ``incremental`` (packed layout only), a leaf that is the very
    ``jax.Array`` saved last time at its key path is carried: not copied to host.
    ``coordination``: the name the processes coordinate under when each saves to a URL of
    its own (:class:`SaveScope`); None: ``url``, the same in every process.
    """
    cfg = current()
    coord = Coordinator(
        url, "save", primary=cfg.primary_process, timeout=cfg.timeout, name=coordination
    )
    txid = coord.agree_txid()
    roots: dict[str, Node] = {}
    objects: dict[str, tuple[str, Any]] = {}
    groups: dict[str, list[tuple[Node, SaveEntry]]] = collections.defaultdict(list)
    carried: dict[int, tuple[Node, SaveEntry, Carried]] = {}
    paths: dict[str, LeafKey] = {}
    if (layout or cfg.layout) != "packed":
        incremental = None
    per_process: set[str] = set()
    for name, obj in units.items():
        hid = _checkpointables.handler_for(obj) if name != PYTREE else None
        if hid is not None:
            h = _checkpointables.get(hid, url=url)
            mine = _checkpointables.is_per_process(hid, h, obj, url=url, name=name)
            if mine:
                per_process.add(name)
            if copy:  # the unit's state at the call, never the live object later
                prefix = f"d/{txid}/{escape_component(name)}"
                obj = _checkpointables.capture(
                    hid,
                    h,
                    obj,
                    url=url,
                    name=name,
                    prefix=f"{prefix}/{process_dir(coord.index)}" if mine else prefix,
                    writes=coord.is_primary or mine or _checkpointables.is_inline(h),
                    process=coord.index if mine else None,
                )
            objects[name] = (hid, obj)
            continue
        root = walk(obj, _is_leaf_value, what=url if name == PYTREE else f"{url} unit {name!r}")
        roots[name] = root
        leaves = list(root.leaves())
        locs = assign_locations([n.path for n in leaves], f"d/{txid}/{escape_component(name)}")
        for node, loc in zip(leaves, locs):
            h = _selection.for_value(node.value)
            if h is None:  # pragma: no cover - walk() only stops at handled leaves
                raise UnsupportedLeafError(f"{url}: no handler for leaf {keystr(node.path)!r}")
            entry = SaveEntry(
                node.path, node.value, _storage_for(storage, node.path, node.value), loc
            )
            if incremental is not None:
                paths[loc] = (name, keystr(node.path))
                info = incremental.same(name, node.path, node.value, entry.storage)
                if info is not None:
                    carried[id(node)] = (node, entry, Carried(paths[loc], loc, info))
                    continue
            groups[h.id].append((node, entry))
    if cfg.replica_writes and jax.process_count() > 1:
        _spread_replica_writes(groups, url)
    if copy:
        for hid, items in groups.items():
            try:  # a storage cast is checked (and made) here
                snap = _selection.get(hid).snapshot([e for _, e in items])
            except LossyCastError as e:
                raise storage_cast_at(url, e) from e
            groups[hid] = [(n, e) for (n, _), e in zip(items, snap)]
    if layout not in (None, "packed", "chunks"):
        raise ValueError(f'layout must be "packed" or "chunks", got {layout!r}')
    return PreparedSave(
        txid,
        roots,
        dict(groups),
        objects,
        list(units),
        coord,
        layout=layout or cfg.layout,
        incremental=incremental,
        carried=carried,
        paths=paths,
        per_process=frozenset(per_process),
    )


def _spread_replica_writes(groups: dict[str, list[tuple[Node, SaveEntry]]], url: str) -> None:
    """Replica-parallel writes: give every array entry its share (``quire._handlers.replicas``).

    The plan is a function of the tree alone, so every process computes the same one."""
    cfg = current()
    where: list[tuple[str, int]] = []
    arrays: list[tuple[Any, np.dtype[Any]]] = []
    for hid, items in groups.items():
        h = _selection.get(hid, url=url)
        if not isinstance(h, ArrayHandler):
            continue
        for j, (_, e) in enumerate(items):
            arr = h.to_array(e.value)
            if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
                continue
            dtype = np.dtype(arr.dtype if e.storage.dtype is None else e.storage.dtype)
            where.append((hid, j))
            arrays.append((arr, dtype))
    plans = plan_writers(
        arrays,
        process_index=jax.process_index(),
        primary=cfg.primary_process,
        piece_bytes=cfg.replica_piece_bytes,
    )
    for (hid, j), plan in zip(where, plans):
        if plan is not None:
            node, e = groups[hid][j]
            groups[hid][j] = (node, replace(e, writers=plan))


async def write_units(
    url: str,
    backend: Backend,
    prep: PreparedSave,
    *,
    stats: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Write every unit's data under ``d/<txid>/`` and make it durable; return the units'
    JSON records.  On failure, remove what was written and re-raise."""
    cfg = current()
    pidx, pcount, primary = process_layout()
    ctx = SaveContext(url, backend, prep.txid, pidx, pcount, primary, ByteBudget(cfg.byte_budget))
    ctx.limit = asyncio.Semaphore(max(1, cfg.max_concurrency))
    records: dict[int, dict[str, Any]] = {}
    unit_records: dict[str, dict[str, Any]] = {}
    sink = None
    if prep.layout == "packed":  # format v2: chunks go into this process's packs
        sink = PackWriter(backend, prep.txid, pidx, cfg.pack_bytes, cfg.byte_budget)
        ctx.backend = sink

    async def write_group(hid: str, items: list[tuple[Node, SaveEntry]]) -> None:
        h = _selection.get(hid, url=url)
        entries = [e for _, e in items]
        with _selection.failures_named(h, entries, url, "saving"):
            if prep.feed is None:
                recs = await h.save(entries, ctx)
            else:
                recs = []
                async with contextlib.aclosing(prep.feed(entries)) as batches:
                    async for b in batches:
                        recs += await h.save(b, ctx)
                        del b  # not held while the next batch is read
        for (node, _), rec in zip(items, recs):
            if rec.get("handler") != hid:
                rec = {**rec, "handler": hid}
            records[id(node)] = rec

    try:
        if sink is not None and prep.incremental is not None:
            _start_incremental(url, backend, prep, sink)
        for hid, items in list(prep.groups.items()):
            await write_group(hid, items)
        if sink is not None and prep.carried and await sink.resolve() is None:
            # leaves carried from a previous step that is gone after all are written
            # after all (they are immutable ``jax.Array`` s)
            for hid, items in _uncarry(prep).items():
                await write_group(hid, items)
        for node, _, c in prep.carried.values():
            assert sink is not None
            sink.carry(c.location, c.info.location)
            records[id(node)] = {**c.info.record, "location": c.location}
        for name, (hid, obj) in prep.objects.items():
            unit_records[name] = await _checkpointables.save_unit(
                hid, obj, backend, f"d/{prep.txid}/{escape_component(name)}", url, ctx,
                per_process=name in prep.per_process,
            )  # fmt: skip
        if sink is not None and prep.incremental is not None and sink.previous is not None:
            inc = prep.incremental
            root = open_backend(inc.root, backend.storage_options)
            await compact(sink, root, sink.previous.sizes, inc.compact_below, url)
        if sink is not None:
            prep.index = await sink.finish()
            ctx.stats["objects"] = sink.packs + 1
        await backend.sync()
    except BaseException:
        if sink is not None:
            await sink.abort()
        if prep.incremental is not None:
            prep.incremental.failed()
        # Nothing references this txid; remove what we wrote (GC would, later).  With
        # several processes the primary cleans up once every process has stopped.
        if not prep.coord.active:
            await _commit.drop_txids(backend, url, [prep.txid])
        raise
    if stats is not None:
        stats.update(ctx.stats)
        stats["budget_peak"] = ctx.budget.peak if ctx.budget else 0
    if sink is not None and prep.incremental is not None:
        _wrote_incremental(url, prep, sink, records)
    units: dict[str, dict[str, Any]] = {}
    for name in prep.order:
        if name in prep.roots:
            units[name] = {
                "kind": "pytree",
                "tree": to_json(prep.roots[name], lambda n: records[id(n)]),
            }
        else:
            units[name] = unit_records[name]
    await share(prep.coord, units, prep.index)  # before it reports its writes done
    return units


def _start_incremental(url: str, backend: Backend, prep: PreparedSave, sink: Any) -> None:
    """Hash every chunk and borrow from the previous step, whose lease is taken at the
    first chunk found equal (``PackWriter.incremental``; the caller releases it)."""
    inc = prep.incremental
    assert inc is not None
    step = url[len(inc.root) + 1 :]
    candidate = inc.candidate(step, prep.paths)
    root = open_backend(inc.root, backend.storage_options)
    sink.incremental(candidate, lambda: inc.lease(root, step, prep.txid))


def _uncarry(prep: PreparedSave) -> dict[str, list[tuple[Node, SaveEntry]]]:
    """The carried leaves as leaves to write (by handler), now in ``prep.groups``."""
    extra: dict[str, list[tuple[Node, SaveEntry]]] = {}
    for node, entry, _ in prep.carried.values():
        h = _selection.for_value(node.value)
        assert h is not None
        extra.setdefault(h.id, []).append((node, entry))
    groups = {k: list(v) for k, v in prep.groups.items()}
    for hid, items in extra.items():
        groups.setdefault(hid, []).extend(items)
    prep.groups, prep.carried = groups, {}
    return extra


def _wrote_incremental(
    url: str, prep: PreparedSave, sink: Any, records: Mapping[int, dict[str, Any]]
) -> None:
    """Remember what this save wrote: the next save's base once it commits."""
    inc = prep.incremental
    assert inc is not None
    leaves: dict[LeafKey, LeafInfo] = {}
    items = [(n, e) for its in prep.groups.values() for n, e in its]
    items += [(n, e) for n, e, _ in prep.carried.values()]
    for node, entry in items:
        v = node.value
        rec = records.get(id(node))
        if rec is None or entry.location not in prep.paths:
            continue
        ref = weakref.ref(v) if isinstance(v, jax.Array) else None
        leaves[prep.paths[entry.location]] = LeafInfo(entry.location, rec, ref, entry.storage)
    inc.stats = {
        "borrowed_bytes": sink.borrowed_bytes,
        "written_bytes": sink.bytes,
        "compacted_bytes": sink.compacted,
    }
    inc.wrote(
        url[len(inc.root) + 1 :],
        prep.txid,
        sink.refs,
        sink.binds,
        sink.shards,
        sink.hashes or {},
        leaves,
    )


class Writer(Protocol):
    """The asynchronous part of a prepared save: writes ``prep`` at ``url`` and commits it
    (:func:`save_prepared`, or a :class:`SaveScope`'s)."""

    async def __call__(
        self,
        url: str,
        prep: PreparedSave,
        *,
        metadata: Mapping[str, Any] | None,
        overwrite: bool,
        storage_options: dict[str, Any] | None = None,
        stats: dict[str, Any] | None = None,
    ) -> None: ...


@dataclass(frozen=True)
class SaveScope:
    """A multi-process save in which every process saves a checkpoint of its own (each its
    own URL) together, rather than its part of one shared checkpoint.

    ``name`` is what the processes coordinate under (their URLs differ): the same in every
    process, unique to the save.  ``write`` runs instead of :func:`save_prepared` (with
    several processes): it writes each process's data, exchanges what the commit records
    need and commits every process's checkpoint.
    """

    name: str
    write: Writer


async def save_prepared(
    url: str,
    prep: PreparedSave,
    *,
    metadata: Mapping[str, Any] | None,
    overwrite: bool,
    storage_options: dict[str, Any] | None = None,
    stats: dict[str, Any] | None = None,
) -> None:
    backend = open_backend(url, storage_options)
    coord = prep.coord

    async def work() -> dict[str, dict[str, Any]]:
        if not overwrite:
            await _commit.ensure_absent(
                backend, url, "pass overwrite=True to replace it, or save to another URL"
            )
        return await write_units(url, backend, prep, stats=stats)

    async def do_commit(units: dict[str, dict[str, Any]]) -> None:
        data = await build_record(backend, prep, units, metadata)
        await _commit.publish(
            backend,
            url,
            data,
            [prep.txid],
            overwrite=overwrite,
            coord=coord,
            keep_superseded=prep.incremental is not None,
        )

    await _commit.collective(
        coord,
        url,
        work,
        do_commit,
        lambda: _commit.drop_txids(backend, url, [prep.txid]),
        unit_digests,
    )
