"""The versioned partial-save journal (DESIGN.md "Partial-save journal").

Version N of an unfinalized checkpoint is the replay of ``journal/1.json .. N.json``.
Each record is created with the backend's conditional create, so versions are totally
ordered and two writers never both create N+1: the loser re-reads the journal and lands
on N+2 with its changes applied on top, unless its change *conflicts* — it replaces or
deletes a key path that a version created after the loser's base also touched — in which
case it fails with :class:`JournalConflictError` (nothing of it is recorded).

A record (JSON)::

    {"format": "quire-journal", "version": 1, "journal_version": N, "base_version": B,
     "created": ISO-8601, "txid": id | null, "metadata": {...},
     "tree": <tree fragment, leaves carry their records> | null,
     "deleted": [[key, ...], ...], "added": [[...]], "replaced": [[...]]}

Replay merges fragments into the state (dicts by key, lists by index, the later version
wins), then applies deletions.  ``finalize`` writes ``quire.json`` from the replay by
conditional create and only then removes the journal and superseded data.
"""

from __future__ import annotations

import asyncio
import datetime
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from quire._engine import commit as _commit
from quire._engine import journal_cache as _cached
from quire._engine import load as _load
from quire._engine import packrewrite as _packrewrite
from quire._engine import record_parts as _record_parts
from quire._engine import save as _saving
from quire._engine.journal_replay import (
    drop_dead,
    find,
    leaf_paths,
    locations,
    overlaps,
    replay,
    replayed,
)
from quire._format import record as _records
from quire._format import schema as _schema
from quire._format.chunkindex import check_entries
from quire._format.tree import KeyPath, keystr
from quire._runtime import multihost as _multihost
from quire._runtime.config import current
from quire._runtime.multihost import Coordinator
from quire._store.base import Backend
from quire._store.url import open_backend
from quire.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    TreeMismatchError,
)

JOURNAL = _records.JOURNAL_DIR
FORMAT = "quire-journal"
VERSION = 1
MAX_RETRIES = 1000


class JournalConflictError(CheckpointExistsError):
    """A concurrent partial save touched the same key paths first; nothing was recorded."""


@dataclass(frozen=True)
class JournalVersion:
    """One version of a partial-save journal.

    Attributes
    ----------
    version : int
        The version number (1, 2, ...).
    created : datetime.datetime
        When it was written.
    added, replaced, deleted : list of key paths
        The leaves this version added, replaced and deleted.
    metadata : dict
        The user metadata given to this version's save.
    txid : str, optional
        The data prefix of this version's arrays.
    """

    version: int
    created: datetime.datetime
    added: list[KeyPath] = field(default_factory=list)
    replaced: list[KeyPath] = field(default_factory=list)
    deleted: list[KeyPath] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    txid: str | None = None


def record_key(n: int) -> str:
    return f"{JOURNAL}/{n:010d}.json"


def _parse(raw: bytes, url: str, n: int) -> dict[str, Any]:
    where = f"{url}/{record_key(n)}"
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"{where} is not valid JSON ({e}); the journal is damaged"
        ) from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{where} is not a quire journal record")
    if doc.get("version") != VERSION:
        raise CorruptCheckpointError(
            f"{where} has journal format version {doc.get('version')!r}; this quire reads "
            f"{VERSION}. Upgrade quire"
        )
    stored = doc.get("checksum")
    if _records.verify_record() and (
        not isinstance(stored, str) or stored != _records.record_checksum(doc)
    ):
        raise CorruptCheckpointError(
            f"{where} fails its checksum or has none; the journal is damaged (load it with "
            "quire.Context(verify_record=False) only if you trust it)"
        )
    if doc.get("journal_version") != n:
        raise CorruptCheckpointError(f"{where} claims version {doc.get('journal_version')!r}")
    if not isinstance(doc.get("metadata"), dict) or not isinstance(doc.get("deleted"), list):
        raise CorruptCheckpointError(f"{where} has malformed fields")
    _schema.check_journal(doc, where)
    if doc.get("tree") is not None:
        _commit.check_tree_locations(doc["tree"], where)
    # format v2: this version's chunk indexes
    if "indexes" in doc and any(
        e["txid"] != doc.get("txid") for e in check_entries(doc["indexes"], where)
    ):
        raise CorruptCheckpointError(f"{where} names chunk indexes of another save")
    return doc


def _reader_of(url: str, n: int) -> Callable[[bytes], dict[str, Any]]:
    """The check a load runs on version ``n``'s bytes: :func:`_parse`, not a copy of it."""
    return lambda raw: _parse(raw, url, n)


async def list_versions(backend: Backend) -> list[int]:
    out = []
    for k in await backend.list(JOURNAL):
        name = k.rsplit("/", 1)[-1]
        if _records.is_journal_record(name):
            out.append(int(name[:-5]))
    return sorted(out)


async def read_records(backend: Backend, url: str, upto: int | None = None) -> list[dict[str, Any]]:
    """Every record (1..upto), parsed; ``CorruptCheckpointError`` if one is missing."""
    versions = await list_versions(backend)
    if upto is not None:
        versions = [v for v in versions if v <= upto]
    if versions != list(range(1, len(versions) + 1)):
        raise CorruptCheckpointError(
            f"{url}: the partial-save journal has gaps (versions {versions[:20]}); it is damaged"
        )

    if not versions:
        return []
    raw1 = await backend.get(record_key(1))
    first = _cached.digest(raw1)  # which journal this is: another's may replace it
    _cached.check(url, first)

    async def one(n: int) -> dict[str, Any]:
        hit = _cached.get(url, n)
        if hit is not None:
            return hit
        doc = _parse(raw1 if n == 1 else await backend.get(record_key(n)), url, n)
        if _records.verify_record():  # an unverified record must not serve verified reads
            _cached.put(url, first, n, doc)
        return doc

    return list(await asyncio.gather(*(one(n) for n in versions)))


# ----------------------------------------------------------------------------- operations
async def _ensure_not_finalized(backend: Backend, url: str) -> None:
    if await backend.exists(_records.RECORD):
        raise CheckpointExistsError(
            f"{url} is already a finalized checkpoint; partial saves go to a new URL "
            "(or quire.save(url, tree, overwrite=True) to replace it)"
        )


async def append(
    url: str,
    *,
    prep: _saving.PreparedSave | None,
    coord: Coordinator | None = None,
    deleted: Sequence[KeyPath] = (),
    metadata: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """Write a partial save's data, then create its journal record; returns its version.

    With several processes every process writes its shards, and the primary creates the
    record once all have succeeded (see ``quire._runtime.multihost``).
    """
    backend = open_backend(url, storage_options)
    if coord is None:
        if prep is not None:
            coord = prep.coord
        else:
            cfg = current()
            coord = Coordinator(url, "partial", primary=cfg.primary_process, timeout=cfg.timeout)
    txid = prep.txid if prep is not None else None
    base_box: list[int] = []

    async def work() -> dict[str, Any] | None:
        await _ensure_not_finalized(backend, url)
        base_records = await read_records(backend, url)
        base_box.append(len(base_records))
        state, _ = replay(base_records)
        for p in deleted:
            if find(state, p) is None:
                raise TreeMismatchError(
                    f"{url}: cannot delete {keystr(tuple(p))!r}: no such key path in version "
                    f"{len(base_records)} of the partial save",
                    missing=[keystr(tuple(p))],
                )
        if prep is None:
            return None
        units = await _saving.write_units(url, backend, prep)
        frag: dict[str, Any] = units[_records.PYTREE]["tree"]
        return frag

    async def create(frag: dict[str, Any] | None) -> int:
        try:
            indexes = None if prep is None else await _record_parts.prepared_indexes(prep, url)
            return await _create_record(
                backend, url, frag, txid, base_box[0], deleted, metadata, indexes
            )
        except BaseException:
            if txid is not None:
                await backend.delete_prefix(f"d/{txid}")
            raise

    async def cleanup() -> None:
        if txid is not None:
            await backend.delete_prefix(f"d/{txid}")

    def digests(frag: dict[str, Any] | None) -> dict[str, str]:
        if frag is None:
            return {"<deleted>": _multihost.digest([list(p) for p in deleted])}
        return _record_parts.unit_digests({_records.PYTREE: {"kind": "pytree", "tree": frag}})

    return await _commit.collective(coord, url, work, create, cleanup, digests)


async def _create_record(
    backend: Backend,
    url: str,
    frag: dict[str, Any] | None,
    txid: str | None,
    base: int,
    deleted: Sequence[KeyPath],
    metadata: dict[str, Any] | None,
    indexes: list[dict[str, Any]] | None = None,
) -> int:
    mine = leaf_paths(frag) + [tuple(p) for p in deleted]
    for _ in range(MAX_RETRIES):
        records = await read_records(backend, url)
        n = len(records) + 1
        for r in records[base:]:
            theirs = [tuple(p) for p in r["added"] + r["replaced"] + r["deleted"]]
            clash = [keystr(a) for a in mine if any(overlaps(a, b) for b in theirs)]
            if clash:
                raise JournalConflictError(
                    f"{url}: partial save conflicts with version {r['journal_version']}, "
                    f"written concurrently, on {', '.join(sorted(set(clash))[:10])}; "
                    "re-read the checkpoint (quire.partial.load) and save again"
                )
        cur, _ = replay(records)
        cur_paths = leaf_paths(cur)
        added, replaced = [], []
        for p in leaf_paths(frag):
            if find(cur, p) is not None or any(overlaps(p, q) for q in cur_paths):
                replaced.append(list(p))
            else:
                added.append(list(p))
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "journal_version": n,
            "base_version": base,
            "created": datetime.datetime.now(datetime.UTC).isoformat(),
            "txid": txid,
            "metadata": dict(metadata or {}),
            "tree": frag,
            "deleted": [list(p) for p in deleted],
            "added": added,
            "replaced": replaced,
            "process_count": _saving.process_layout()[1],
        }
        if indexes is not None:
            doc["indexes"] = indexes
        doc["checksum"] = _records.record_checksum(doc)
        data = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
        check = _reader_of(url, n)  # what read_records parses version n with
        # COMMIT of n; its arrays must have every chunk stored (commit.create's ``complete``)
        if await _commit.create(backend, record_key(n), data, url, check, complete=True):
            break
    else:  # pragma: no cover
        raise CheckpointExistsError(f"{url}: gave up appending to a busy journal")
    # A finalize that raced us committed without version n: say so, leave no trace.
    fin = await _commit.read_if_exists(backend, url)
    if fin is not None and int(fin.doc.get("journal_version", 0)) < n:
        await backend.delete([record_key(n)])
        raise CheckpointExistsError(
            f"{url} was finalized while this partial save was in flight; it is not part "
            "of the checkpoint"
        )
    return n


async def versions(url: str, storage_options: dict[str, Any] | None = None) -> list[JournalVersion]:
    backend = open_backend(url, storage_options)
    out = []
    for r in await read_records(backend, url):
        out.append(
            JournalVersion(
                version=r["journal_version"],
                created=datetime.datetime.fromisoformat(r["created"]),
                added=[tuple(p) for p in r["added"]],
                replaced=[tuple(p) for p in r["replaced"]],
                deleted=[tuple(p) for p in r["deleted"]],
                metadata=r["metadata"],
                txid=r.get("txid"),
            )
        )
    return out


async def load(
    url: str,
    abstract: Any,
    *,
    version: int | None,
    partial: bool,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    backend = open_backend(url, storage_options)
    if await backend.exists(_records.RECORD):
        # Once quire.json exists the journal is dead (a finalize may have been killed
        # before deleting it): read the committed state, never an older replay.
        fin = _records.parse(await backend.get(_records.RECORD), url)
        if version is not None and version != fin.get("journal_version"):
            raise CheckpointNotFoundError(
                f"{url} is finalized (from journal version {fin.get('journal_version')}); "
                f"partial-save version {version} is no longer readable: load it without "
                "version="
            )
        return await _load.load(url, abstract, partial=partial, storage_options=storage_options)
    records = await read_records(backend, url)
    if not records:
        raise CheckpointNotFoundError(f"no partial-save journal at {url}")
    if version is not None:
        if not 1 <= version <= len(records):
            raise CheckpointNotFoundError(
                f"{url}: partial-save version {version} does not exist (versions 1..{len(records)})"
            )
        records = records[:version]
    tree, view, _ = replayed(backend, url, records)
    return await _load.load_tree(url, tree, view, abstract, partial=partial)


async def finalize(
    url: str, storage_options: dict[str, Any] | None = None, coord: Coordinator | None = None
) -> None:
    """Every process calls it; the primary finalizes, the others wait for its outcome."""
    if coord is None or not coord.active:
        return await _finalize(url, storage_options)

    async def nothing() -> None:
        return None

    async def run(_: None) -> None:
        await _finalize(url, storage_options)

    async def noop() -> None:
        return None

    await _commit.collective(coord, url, nothing, run, noop, lambda _: {})


async def _finalize(url: str, storage_options: dict[str, Any] | None = None) -> None:
    backend = open_backend(url, storage_options)
    if await backend.exists(_records.RECORD):
        raise CheckpointExistsError(f"{url} is already finalized")
    records = await read_records(backend, url)
    if not records:
        raise CheckpointNotFoundError(
            f"no partial-save journal at {url}: nothing to finalize (quire.partial.save first)"
        )
    state, meta = replay(records)
    tree = state if state is not None else {"kind": "dict", "keys": [], "children": []}
    # Format v2: packs less than half live are rewritten (docs/format.md, _packrewrite).
    plan = await _packrewrite.finalize_plan(backend, url, tree, records)
    data = _records.build(
        units={_records.PYTREE: {"kind": "pytree", "tree": plan.tree}},
        txids=sorted(plan.txids),
        metadata=meta,
        process_count=_saving.process_layout()[1],
        extra={"journal_version": len(records)},
        indexes=plan.indexes or None,
    )
    async with _packrewrite.committing(backend, url, plan):
        await _commit.publish(
            backend, url, data, plan.txids, overwrite=False,
            fix="it was finalized concurrently", owned=False,
        )  # fmt: skip
    await _cleanup(backend, url, records, plan.txids, locations(plan.tree))


async def _cleanup(
    backend: Backend,
    url: str,
    records: list[dict[str, Any]],
    live: set[str],
    live_locations: set[str] | None = None,
) -> None:
    dead = {r["txid"] for r in records if r.get("txid")} - live
    # Leaves replaced or deleted inside a transaction that still has live leaves.
    dead_locs = set()
    if live_locations is not None:
        for r in records:
            dead_locs |= {
                loc for loc in locations(r.get("tree")) if loc.split("/")[1] in live
            } - live_locations
    # Highest version first, so an interrupted cleanup never leaves a gap below a record.
    for r in reversed(records):
        await backend.delete([record_key(r["journal_version"])])
    await drop_dead(backend, records, dead, dead_locs)
    _cached.forget(url)


async def discard(
    url: str, storage_options: dict[str, Any] | None = None, coord: Coordinator | None = None
) -> None:
    """Every process calls it; the primary discards, the others wait for its outcome."""
    if coord is None or not coord.active:
        return await _discard(url, storage_options)

    async def nothing() -> None:
        return None

    async def run(_: None) -> None:
        await _discard(url, storage_options)

    await _commit.collective(coord, url, nothing, run, nothing, lambda _: {})


async def _discard(url: str, storage_options: dict[str, Any] | None = None) -> None:
    backend = open_backend(url, storage_options)
    records = await read_records(backend, url)
    if not records:
        raise CheckpointNotFoundError(f"no partial-save journal at {url}: nothing to discard")
    if not await finish_finalized(backend, url, records):
        await _cleanup(backend, url, records, set())


async def finish_finalized(
    backend: Backend, url: str, records: list[dict[str, Any]] | None = None
) -> bool:
    """Finish the clean-up of a finalize killed after its commit point: drop the packs its
    rewrite superseded, the replaced indexes and the journal.  False (nothing done) when
    ``url`` is not finalized or holds no journal.  ``quire gc`` and :func:`discard` call it.
    """
    if records is None:
        records = await read_records(backend, url)
    fin = await _commit.read_if_exists(backend, url)
    if fin is None or not records:
        return False
    await _packrewrite.finish(backend, url, records, fin.doc)
    await _cleanup(backend, url, records, fin.txids)
    return True
