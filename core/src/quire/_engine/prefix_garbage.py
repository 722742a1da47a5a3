"""Garbage under any prefix (``quire gc`` of any URL): every Checkpointer root's (as
:func:`quire._engine.garbage.collect`), plus each plain checkpoint's unreferenced
``d/<txid>/`` data, killed first saves' and finalizes killed after their commit.  Partial
saves are never touched; nothing younger than the grace period is."""

from __future__ import annotations

import time
from collections import defaultdict

from quire._engine import garbage as _gc
from quire._engine.scan import TXID, Opener, join, scan
from quire._format import record as _records
from quire._format import root as _root
from quire._runtime.progress import advance
from quire._store.base import Backend
from quire.errors import QuireError


async def _txid_garbage(
    backend: Backend, path: str, live: set[str], now: float, grace: float
) -> tuple[list[_gc.Garbage], list[_gc.Garbage]]:
    """``<path>/d/<txid>/`` prefixes not in ``live``: (old enough, too young)."""
    removable: list[_gc.Garbage] = []
    kept: list[_gc.Garbage] = []
    by_txid: dict[str, list[str]] = defaultdict(list)
    base = join(path, "d")
    for k in await backend.list(base):
        parts = k[len(base) + 1 :].split("/")
        if len(parts) >= 2 and TXID.match(parts[0]):
            by_txid[parts[0]].append(k)
    for txid in await _root.subfolders(backend, base):  # folders, no object (a killed save)
        if TXID.match(txid):
            by_txid.setdefault(txid, [])
    for txid, keys in sorted(by_txid.items()):
        if txid in live:
            continue
        t = await _root.newest(backend, keys or await _root.folders(backend, f"{base}/{txid}"))
        age = None if t is None else max(0.0, now - t)
        g = _gc.Garbage(f"{base}/{txid}", -1, "superseded" if live else "uncommitted",
                        await _root.sizes(backend, keys), age)  # fmt: skip
        old = grace <= 0 or (age is not None and age >= grace)
        (removable if old else kept).append(g)
    return removable, kept


async def _live(backend: Backend, url: str, path: str) -> set[str] | None:
    """The txids ``<path>/quire.json`` references; empty if none; None if unreadable."""
    try:
        raw = await backend.get(join(path, _records.RECORD))
    except FileNotFoundError:
        return set()
    try:
        return set(_records.parse(raw, join(url, path))["txids"])
    except QuireError:
        return None  # a damaged record is for a human to look at, not for GC


async def collect_any(
    backend: Backend, url: str, opener: Opener, *, grace_period: float, dry_run: bool
) -> _gc.GcReport:
    """Garbage under any prefix: every Checkpointer root's (as ``collect``), plus each
    plain checkpoint's unreferenced ``d/<txid>/`` data and killed first saves'."""
    s = await scan(backend, opener)
    removable: list[_gc.Garbage] = []
    kept: list[_gc.Garbage] = []
    for r in s.roots:
        sub = opener(r) if r else backend
        fmt = await _root.root_step_format(sub, join(url, r))
        rep = await _gc.collect(sub, join(url, r), fmt, grace_period=grace_period,
                                dry_run=dry_run)  # fmt: skip
        for lst, into in ((rep.removable, removable), (rep.kept, kept)):
            into += [_gc.Garbage(join(r, g.prefix), g.step, g.kind, g.nbytes, g.age) for g in lst]
    now = time.time()
    for f in s.checkpoints:
        if (f.root is not None and f.step is not None) or f.state == "partial":
            continue  # a root's step (done above) or a partial save (never touched)
        live = await _live(backend, url, f.path)
        if live is None:
            continue
        rem, kp = await _txid_garbage(backend, f.path, live, now, grace_period)
        rem2, kp2 = await _unfinished(backend, f.path, now, grace_period)
        removable += rem + rem2
        kept += kp + kp2
    if not dry_run:
        plain = [g for g in removable if g.step < 0 and g.kind != "lease"]  # a root's lease: done
        gone = {g.prefix for g in plain if await _remove(backend, url, g)}
        removable = [g for g in removable if g not in plain or g.prefix in gone]
    return _gc.GcReport(removable, kept, not dry_run, grace_period)


async def _unfinished(
    backend: Backend, path: str, now: float, grace: float
) -> tuple[list[_gc.Garbage], list[_gc.Garbage]]:
    """A committed checkpoint that still holds its journal (a finalize killed after its
    commit): one ``"unfinished"`` item, (old enough, too young)."""
    keys = await backend.list(join(path, _gc.JOURNAL_DIR))
    if not keys:
        return [], []
    t = await _root.newest(backend, keys)
    age = None if t is None else max(0.0, now - t)
    g = _gc.Garbage(join(path, _gc.JOURNAL_DIR), -1, "unfinished",
                    await _root.sizes(backend, keys), age)  # fmt: skip
    old = grace <= 0 or (age is not None and age >= grace)
    return ([g], []) if old else ([], [g])


async def _remove(backend: Backend, url: str, g: _gc.Garbage) -> bool:
    """Remove one piece of garbage after checking again that no record references it."""
    if g.kind == "unfinished":
        path = g.prefix.rpartition("/")[0] if "/" in g.prefix else ""
        if not await _gc.finish_unfinished(backend, url, path):
            return False

        advance(g.nbytes)
        return True
    path, _, txid = ("/" + g.prefix).rpartition("/d/")
    path = path.lstrip("/")
    live = await _live(backend, url, path)
    if live is None or txid in live:
        return False

    await backend.delete_prefix(g.prefix)
    advance(g.nbytes)
    return True
