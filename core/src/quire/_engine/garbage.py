"""Garbage of a Checkpointer root; the root's layout is ``quire._format.root``'s (what
``quire ls`` reports of its steps: ``quire._engine.step_reports``; garbage under any prefix:
``quire._engine.prefix_garbage``).

Garbage (removed by :func:`collect`, never younger than the grace period):

* incomplete step directories, whole;
* inside committed steps without a journal, ``d/<txid>/`` prefixes that ``quire.json``
  does not reference (left by a crash during an overwrite or by a re-save over debris).

Partial steps and directory names that do not parse as steps are never touched.

Borrowed bytes (an incremental root, ``quire._engine.incremental``): the collection is a
mark-and-sweep.  *Mark*: every pack a committed step's record declares as borrowed, then
every pack a lease younger than the grace period names (records first, leases second: a
save writes its lease before it checks that the step it borrows from still exists).
*Sweep*: the garbage above, less the marked packs: a pack goes only when nothing live
points into it.  A record that cannot be read marks every pack (nothing is swept blind).
Old leases (a save that died) are garbage too.  A step deleted by an incremental
Checkpointer's retention leaves a ``retired.json`` naming its txids; :func:`sweep_retired`
removes what of those txids is not marked at once, whatever its age.  No pack is ever
rewritten here: a save stops borrowing from a mostly-dead pack
(``quire._engine.compaction``), which then dies whole.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from quire._engine import commit as _commit
from quire._engine import journal as _journal
from quire._engine.step_reports import read_step_record
from quire._format import record as _records
from quire._format.borrow import borrowed_of, root_relative
from quire._format.record import JOURNAL_DIR
from quire._format.root import (
    INCREMENTAL_MARKER,
    LEASE_DIR,
    ROOT_RECORD,
    StepDir,
    StepFormat,
    folders,
    list_root,
    newest,
    parse_root_record,
    root_record_bytes,
    sizes,
    subfolders,
)
from quire._runtime.progress import advance
from quire._store.base import Backend
from quire._store.url import open_backend
from quire.errors import QuireError

DEFAULT_GRACE_PERIOD = 3600.0


async def create_root_record(backend: Backend, step_format: str, metadata: dict[str, Any]) -> bool:
    """Create the root record unless one exists (conditional create); True if we made it."""
    data = root_record_bytes(step_format, metadata)
    url = backend.url
    return await _commit.create(
        backend, ROOT_RECORD, data, url, lambda raw: parse_root_record(raw, url)
    )


# ----------------------------------------------------------------------------- garbage
@dataclass(frozen=True)
class Garbage:
    """Data ``collect`` removes (or would): a whole step directory or one stale txid."""

    prefix: str  # relative to the root, no trailing slash
    step: int
    kind: str  # "incomplete" (whole step directory), "superseded" (an unreferenced txid), "lease"
    nbytes: int
    age: float | None  # seconds since the newest write; None when the backend can't say
    keys: tuple[str, ...] = ()  # only these (the rest of the prefix holds borrowed packs)


@dataclass(frozen=True)
class GcReport:
    """What :func:`collect` found: ``removable`` (removed unless dry run) and ``kept``.

    ``kept`` is garbage spared because it is younger than the grace period or of unknown age.
    """

    removable: list[Garbage]
    kept: list[Garbage]
    removed: bool
    grace_period: float


async def find_garbage(
    backend: Backend,
    url: str,
    fmt: StepFormat,
    grace_period: float,
    exclude: Collection[int] = (),
) -> tuple[list[Garbage], list[Garbage]]:
    """(removable, kept-because-young-or-unknown-age) garbage under the root."""
    listing = await list_root(backend, fmt)
    now = time.time()
    docs: dict[str, dict[str, Any] | None] = {}
    live = await mark(backend, url, listing.steps, grace_period, docs)
    candidates: list[tuple[StepDir | None, str, str, list[str]]] = []
    for key in live.stale_leases:
        candidates.append((None, key, "lease", [key]))
    for sd in listing.steps:
        if sd.step in exclude:
            continue
        state = sd.state
        if state == "incomplete":
            candidates.append((sd, sd.name, "incomplete", list(sd.keys)))
        elif state == "committed" and sd.has_journal:  # a finalize killed after its commit
            journal = [k for k in sd.keys if k.startswith(f"{sd.name}/{JOURNAL_DIR}/")]
            candidates.append((sd, f"{sd.name}/{JOURNAL_DIR}", "unfinished", journal))
        elif state == "committed":
            doc = docs.get(sd.name)
            if doc is None:
                continue  # a damaged record is for a human to look at, not for GC
            referenced = set(doc["txids"])
            by_txid: dict[str, list[str]] = defaultdict(list)
            for k in sd.keys:
                parts = k.split("/")
                if len(parts) >= 4 and parts[1] == "d":
                    by_txid[parts[2]].append(k)
            for txid in await subfolders(backend, f"{sd.name}/d"):  # folders, no object
                by_txid.setdefault(txid, [])
            for txid, keys in sorted(by_txid.items()):
                if txid not in referenced:
                    candidates.append((sd, f"{sd.name}/d/{txid}", "superseded", keys))

    async def one(c: tuple[StepDir | None, str, str, list[str]]) -> tuple[Garbage, bool]:
        sd, prefix, kind, keys = c
        dead = [k for k in keys if not live.holds(k)]
        # Folders holding no object at all (a save killed as it made them): their own age.
        t = await newest(backend, dead if keys else await folders(backend, prefix))
        age = None if t is None else max(0.0, now - t)
        only = tuple(dead) if len(dead) < len(keys) or kind == "lease" else ()
        g = Garbage(
            prefix, -1 if sd is None else sd.step, kind, await sizes(backend, dead), age, only
        )
        old = grace_period <= 0 or (age is not None and age >= grace_period)
        return g, old and (bool(dead) or not keys)

    results = await asyncio.gather(*(one(c) for c in candidates))
    removable = [g for g, old in results if old]
    kept = [g for g, old in results if not old]
    return removable, kept


async def remove(backend: Backend, url: str, g: Garbage) -> bool:
    """Remove one piece of garbage, re-checking first that it is still garbage."""
    name = g.prefix.split("/", 1)[0]
    if g.kind == "lease":
        await backend.delete(list(g.keys))
    elif g.keys:  # borrowed packs stay: remove the rest, once it is still garbage
        if g.kind == "incomplete" and await backend.exists(f"{name}/{_records.RECORD}"):
            return False
        if g.kind == "superseded":
            doc = await read_step_record(backend, url, name)
            if doc is None or g.prefix.rsplit("/", 1)[-1] in doc["txids"]:
                return False
        await backend.delete(list(g.keys))
    elif g.kind == "unfinished":
        if not await finish_unfinished(backend, url, name):
            return False
    elif g.kind == "incomplete":
        if await backend.exists(f"{name}/{_records.RECORD}"):
            return False  # a slow writer committed it meanwhile
        await backend.delete_prefix(g.prefix)
    else:
        doc = await read_step_record(backend, url, name)
        txid = g.prefix.rsplit("/", 1)[-1]
        if doc is None or txid in doc["txids"]:
            return False
        await backend.delete_prefix(g.prefix)

    advance(g.nbytes)  # `quire gc --yes` on a terminal: the bar counts what is removed
    return True


async def finish_unfinished(backend: Backend, url: str, path: str) -> bool:
    """Garbage of kind ``"unfinished"`` at ``path`` (a checkpoint that was finalized, but
    whose finalize was killed before it removed its journal and what it superseded):
    finish that clean-up.  False when there is nothing to finish any more."""

    where = f"{url}/{path}" if path else url
    sub = open_backend(where, backend.storage_options) if path else backend
    return await _journal.finish_finalized(sub, where)


async def collect(
    backend: Backend,
    url: str,
    fmt: StepFormat,
    *,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    dry_run: bool = False,
    exclude: Collection[int] = (),
) -> GcReport:
    """Find garbage older than ``grace_period`` seconds and (unless ``dry_run``) remove it."""
    removable, kept = await find_garbage(backend, url, fmt, grace_period, exclude)
    if not dry_run:
        done = [g for g in removable if await remove(backend, url, g)]
        removable = done
    return GcReport(removable, kept, not dry_run, grace_period)


@dataclass
class Live:
    """The mark of a mark-and-sweep: root-relative packs something live points into."""

    packs: set[str]
    everything: bool = False  # a record could not be read: keep every pack
    stale_leases: tuple[str, ...] = ()

    def holds(self, key: str) -> bool:
        return key in self.packs or (self.everything and "/%packs/p" in key)


async def mark(
    backend: Backend,
    url: str,
    steps: Collection[StepDir],
    grace_period: float,
    docs: dict[str, dict[str, Any] | None] | None = None,
) -> Live:
    """Mark the packs committed steps borrow, then those young leases name (in that order,
    see the module docstring); ``docs`` receives the records read."""
    docs = {} if docs is None else docs
    live = Live(set())

    async def one(sd: StepDir) -> None:
        try:
            doc = await read_step_record(backend, url, sd.name)
        except QuireError:
            doc, live.everything = None, True
        docs[sd.name] = doc
        for target in borrowed_of((doc or {}).get("indexes")):
            live.packs.add(root_relative(sd.name, target))

    await asyncio.gather(*(one(sd) for sd in steps if sd.state == "committed"))
    stale = []
    now = time.time()
    for key in await backend.list(f"{LEASE_DIR}/"):
        if key == INCREMENTAL_MARKER:
            continue
        try:
            t = await backend.modified(key)
        except FileNotFoundError:
            continue  # released between the listing and now (another process's save)
        if grace_period > 0 and (t is None or now - t < grace_period):
            try:
                doc = json.loads(await backend.get(key))
                live.packs.update(p for p in doc["packs"] if isinstance(p, str))
            except FileNotFoundError:
                continue  # released meanwhile: its save committed (marked above) or failed
            except (ValueError, KeyError, TypeError):
                live.everything = True
        else:
            stale.append(key)
    live.stale_leases = tuple(stale)
    return live


RETIRED = "retired.json"


async def retire_step(backend: Backend, url: str, name: str) -> None:
    """Retention in an incremental root: the record goes (the step vanishes at once), its
    txids are noted in ``<step>/retired.json``, and :func:`sweep_retired` removes what of
    them no other step borrows.  A crash in between leaves an incomplete step directory
    (``collect`` removes it after the grace period, borrowed packs excepted)."""
    doc = await read_step_record(backend, url, name)
    await backend.delete([f"{name}/{_records.RECORD}"])
    if doc is not None:
        await backend.put(f"{name}/{RETIRED}", [json.dumps({"txids": doc["txids"]}).encode()])


async def sweep_retired(backend: Backend, url: str, fmt: StepFormat, grace_period: float) -> int:
    """Remove the unmarked data of every retired step (the txids its ``retired.json``
    names; never another save's) and, once none is left, the note; objects removed."""
    listing = await list_root(backend, fmt)
    retired = [sd for sd in listing.steps if f"{sd.name}/{RETIRED}" in sd.keys]
    if not retired:
        return 0
    live = await mark(backend, url, listing.steps, grace_period)
    removed = 0
    for sd in retired:
        if sd.state != "incomplete":
            continue  # saved again meanwhile: its own gc rules apply
        try:
            txids = json.loads(await backend.get(f"{sd.name}/{RETIRED}"))["txids"]
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            continue
        mine = [k for k in sd.keys if any(k.startswith(f"{sd.name}/d/{t}/") for t in txids)]
        dead = [k for k in mine if not live.holds(k)]
        if dead:
            await backend.delete(dead)
            removed += len(dead)
        if len(dead) == len(mine):
            await backend.delete([f"{sd.name}/{RETIRED}"])
    return removed


async def delete_step(backend: Backend, name: str) -> None:
    """Delete one step: ``quire.json`` first (the step vanishes at once), then its data.

    A crash in between leaves an incomplete step directory, which :func:`collect` removes.
    """
    await backend.delete([f"{name}/{_records.RECORD}"])
    await backend.delete_prefix(name)
