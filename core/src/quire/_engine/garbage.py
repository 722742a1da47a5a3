"""Garbage of a Checkpointer root (and ``quire ls``'s step reports); the root's layout is
``quire._format.root``'s.

Garbage (removed by :func:`collect`, never younger than the grace period):

* incomplete step directories, whole;
* inside committed steps without a journal, ``d/<txid>/`` prefixes that ``quire.json``
  does not reference (left by a crash during an overwrite or by a re-save over debris).

Partial steps and directory names that do not parse as steps are never touched.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from quire._engine import commit as _commit
from quire._engine import journal as _journal
from quire._format import record as _format
from quire._format.record import JOURNAL_DIR
from quire._format.root import (
    ROOT_RECORD,
    StepDir,
    StepFormat,
    list_root,
    newest,
    record_metrics,
    root_record_bytes,
    sizes,
)
from quire._runtime.progress import advance
from quire._store.base import Backend
from quire._store.url import open_backend
from quire.errors import QuireError

DEFAULT_GRACE_PERIOD = 3600.0


async def create_root_record(backend: Backend, step_format: str, metadata: dict[str, Any]) -> bool:
    """Create the root record unless one exists (conditional create); True if we made it."""
    data = root_record_bytes(step_format, metadata)
    return await _commit.create(backend, ROOT_RECORD, data, backend.url)


async def read_step_record(backend: Backend, url: str, name: str) -> dict[str, Any] | None:
    """The parsed ``quire.json`` of step directory ``name``; None if it vanished."""
    rec = await _commit.read_if_exists(backend, url, under=name)
    return rec.doc if rec is not None else None


# ----------------------------------------------------------------------------- quire ls
@dataclass(frozen=True)
class StepReport:
    """One line of ``quire ls``."""

    name: str
    step: int
    state: str
    nbytes: int
    age: float | None  # seconds since commit (committed) or since the newest write
    metrics: dict[str, Any]
    error: str = ""


async def describe(backend: Backend, url: str, fmt: StepFormat) -> list[StepReport]:
    listing = await list_root(backend, fmt)
    now = time.time()

    async def one(sd: StepDir) -> StepReport:
        nbytes = await sizes(backend, sd.keys)
        metrics: dict[str, Any] = {}
        age: float | None = None
        error = ""
        state = sd.state
        if state == "committed":
            try:
                doc = await read_step_record(backend, url, sd.name)
            except QuireError as e:
                doc, error = None, str(e).splitlines()[0]
            if doc is not None:
                metrics = record_metrics(doc)
                age = now - doc["_created"].timestamp()
        else:
            t = await newest(backend, sd.keys)
            age = None if t is None else now - t
        return StepReport(sd.name, sd.step, state, nbytes, age, metrics, error)

    return list(await asyncio.gather(*(one(sd) for sd in listing.steps)))


# ----------------------------------------------------------------------------- garbage
@dataclass(frozen=True)
class Garbage:
    """Data ``collect`` removes (or would): a whole step directory or one stale txid."""

    prefix: str  # relative to the root, no trailing slash
    step: int
    kind: str  # "incomplete" (whole step directory) or "superseded" (an unreferenced txid)
    nbytes: int
    age: float | None  # seconds since the newest write; None when the backend can't say


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
    candidates: list[tuple[StepDir, str, str, list[str]]] = []
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
            try:
                doc = await read_step_record(backend, url, sd.name)
            except QuireError:
                continue  # a damaged record is for a human to look at, not for GC
            if doc is None:
                continue
            live = set(doc["txids"])
            by_txid: dict[str, list[str]] = defaultdict(list)
            for k in sd.keys:
                parts = k.split("/")
                if len(parts) >= 4 and parts[1] == "d":
                    by_txid[parts[2]].append(k)
            for txid, keys in sorted(by_txid.items()):
                if txid not in live:
                    candidates.append((sd, f"{sd.name}/d/{txid}", "superseded", keys))

    async def one(c: tuple[StepDir, str, str, list[str]]) -> tuple[Garbage, bool]:
        sd, prefix, kind, keys = c
        t = await newest(backend, keys)
        age = None if t is None else max(0.0, now - t)
        g = Garbage(prefix, sd.step, kind, await sizes(backend, keys), age)
        old = grace_period <= 0 or (age is not None and age >= grace_period)
        return g, old

    results = await asyncio.gather(*(one(c) for c in candidates))
    removable = [g for g, old in results if old]
    kept = [g for g, old in results if not old]
    return removable, kept


async def remove(backend: Backend, url: str, g: Garbage) -> bool:
    """Remove one piece of garbage, re-checking first that it is still garbage."""
    name = g.prefix.split("/", 1)[0]
    if g.kind == "unfinished":
        if not await finish_unfinished(backend, url, name):
            return False
    elif g.kind == "incomplete":
        if await backend.exists(f"{name}/{_format.RECORD}"):
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


async def delete_step(backend: Backend, name: str) -> None:
    """Delete one step: ``quire.json`` first (the step vanishes at once), then its data.

    A crash in between leaves an incomplete step directory, which :func:`collect` removes.
    """
    await backend.delete([f"{name}/{_format.RECORD}"])
    await backend.delete_prefix(name)
