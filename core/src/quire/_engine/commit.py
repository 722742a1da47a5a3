"""The one commit path: reading and writing ``quire.json`` (DESIGN.md "Commit protocol").

Every module that needs the commit record reads it with :func:`read`, and every record
quire creates - ``quire.json``, journal versions, the Checkpointer's root record - is
written here and nowhere else.  Call order of a save (``quire.save``), a copy
(``quire cp``) and a finalize (``quire.partial.finalize``)::

    ensure_absent(dst)                # optional early "already exists" check
    collective(coord, work, ...)      # every process writes d/<txid>/...; backend.sync()
      |  primary, once every process succeeded and agrees on the records:
      +- publish(backend, url, record, txids, overwrite=...)
           check_record(record)                   # the check every load runs on it
           completeness.check(record's arrays)    # every chunk in an index, or stored
           put_if_absent("quire.json")            # <-- COMMIT POINT (new checkpoint)
           replace_if_match("quire.json", v)      # <-- COMMIT POINT (overwrite)
           coord.decide("ok")                     # every process hears "committed"
           delete_prefix(d/<old txid>)            # superseded data, after the commit only

Write only what you can read (DESIGN.md, commit protocol step 5): before a record is
published, :func:`publish` runs :func:`check_record` on its bytes - the one function
:func:`read` runs on every ``quire.json`` - and :func:`create` runs the reader its caller
names (the journal's, the root record's); a record that fails is never published
(``UnreadableRecordError``), and the previous one stays as it was.  Nor is a record one of
whose arrays misses a chunk (``quire._engine.completeness``, run by :func:`publish` and, for
a journal version, by :func:`create`): ``IncompleteCheckpointError``, a subclass.

A crash before the commit point leaves only unreferenced data under a fresh txid (GC
removes it); a crash after it leaves the new checkpoint whole, and at worst superseded
data behind.  The create and the swap use the backend's real preconditions; which
guarantees hold is read from its declared ``atomic_create`` / ``atomic_replace``
capabilities, and a backend lacking one is used with a warning, never refused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from quire._format import record as _records
from quire._format.paths import is_safe_location
from quire._format.root import INCREMENTAL_MARKER, root_hint
from quire._format.tree import from_json, keystr
from quire._store.base import Backend, PreconditionFailed
from quire._store.url import open_backend
from quire.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MultiProcessError,
    UnreadableRecordError,
)

if TYPE_CHECKING:
    from quire._runtime.multihost import Coordinator

log = logging.getLogger("quire")

RECORD = _records.RECORD
JOURNAL_DIR = "journal"

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Record:
    """A parsed, location-checked commit record and the exact bytes it was read from."""

    raw: bytes
    doc: dict[str, Any]

    @property
    def txids(self) -> set[str]:
        return set(self.doc["txids"])


# ----------------------------------------------------------------------------- reading
def check_locations(units: dict[str, Any], url: str) -> None:
    """Refuse a record whose leaves or units point outside ``d/`` (damage or malice)."""
    for name, unit in units.items():
        if unit.get("kind") == "pytree":
            check_tree_locations(unit["tree"], url)
        elif unit.get("kind") == "handler" and not is_safe_location(unit.get("location")):
            raise CorruptCheckpointError(
                f"{url}/{RECORD}: unit {name!r} has location {unit.get('location')!r}, outside "
                "d/; refusing to read it (the record is damaged or malicious)"
            )


def check_tree_locations(tree: dict[str, Any], url: str) -> None:
    """As :func:`check_locations`, for one pytree unit's (or journal fragment's) tree."""
    for leaf in from_json(tree).leaves():
        loc = leaf.value.get("location")
        if loc is not None and not is_safe_location(loc):
            raise CorruptCheckpointError(
                f"{url}/{RECORD}: leaf {keystr(leaf.path)!r} has location {loc!r}, outside d/; "
                "refusing to read it (the record is damaged or malicious)"
            )


async def read(backend: Backend, url: str, *, under: str = "") -> Record:
    """Read, parse and check the commit record at ``<under>/quire.json``.

    Raises ``CheckpointNotFoundError`` when it is absent (pointing at an unfinalized
    journal when there is one), ``CorruptCheckpointError`` when it is malformed, fails
    its checksum or points outside ``d/``.
    """
    got = await _read(backend, url, under=under, missing_ok=False)
    assert got is not None
    return got


async def read_if_exists(backend: Backend, url: str, *, under: str = "") -> Record | None:
    """As :func:`read`, but None when there is no record (e.g. a step deleted meanwhile)."""
    return await _read(backend, url, under=under, missing_ok=True)


async def _read(backend: Backend, url: str, *, under: str, missing_ok: bool) -> Record | None:
    base = f"{under}/" if under else ""
    where = f"{url}/{under}" if under else url
    try:
        raw = await backend.get(base + RECORD)
    except (FileNotFoundError, NotADirectoryError) as e:  # the latter: the URL is a file
        if missing_ok:
            return None
        hint = (
            " It is a file, not a checkpoint's directory."
            if isinstance(e, NotADirectoryError)
            else ""
        )
        try:
            if await backend.list(base + JOURNAL_DIR):
                hint = (
                    " It holds an unfinalized partial save: run quire.partial.finalize(url) "
                    "to commit it, or quire.partial.load(url) to read it"
                )
        except Exception:  # broad: a hint only; CheckpointNotFoundError is raised below
            pass
        if not hint and not under:
            hint = await root_hint(backend)
        raise CheckpointNotFoundError(f"no checkpoint at {where} (no {RECORD}).{hint}") from None
    return Record(raw, check_record(raw, where))


def check_record(raw: bytes, where: str) -> dict[str, Any]:
    """The check every reader runs on ``quire.json`` (its bytes at ``where``), and every
    writer on what it is about to publish: parse, checksum, schema, locations.

    Raises
    ------
    CorruptCheckpointError
        Naming ``where`` and the key path of the first bad value.
    """
    doc = _records.parse(raw, where)
    check_locations(doc["units"], where)
    return doc


def _refuse_unreadable(check: Callable[[bytes], T], data: bytes, url: str, key: str) -> T:
    """Run a record's reader on ``data`` before it is published and return what it read;
    ``UnreadableRecordError`` (nothing published) when that reader refuses it."""
    try:
        return check(data)
    except CorruptCheckpointError as e:
        raise UnreadableRecordError(
            f"{url}: refusing to publish {key}: quire's own load would refuse it ({e}). "
            "Nothing was committed; what was there before is unchanged. This is a defect "
            "of quire or of the plugin that wrote the leaf named: please report it"
        ) from e


async def _refuse_incomplete(
    backend: Backend, url: str, key: str, doc: Any, indexes_from: Backend | None = None
) -> None:
    """Refuse to publish ``doc`` (a parsed record) when one of its arrays misses a chunk
    that no chunk index it names holds and no object stores (``quire._engine.completeness``);
    ``IncompleteCheckpointError``, an ``UnreadableRecordError``, nothing published."""
    # Heavy (the array handlers: JAX, zarr), and only a commit needs it: reading a record
    # (quire ls, quire info) does not import it.
    from quire._engine import completeness as _completeness

    trees, indexes = _completeness.record_parts(doc)
    await _completeness.check(backend, url, key, trees, indexes, indexes_from)


async def ensure_absent(backend: Backend, url: str, fix: str) -> None:
    """Fail early (before any data is written) when a checkpoint is already at ``url``, or
    an unfinalized partial save (its journal); the conditional create at the commit point
    is what actually decides."""
    if await backend.exists(RECORD):
        raise CheckpointExistsError(f"a checkpoint already exists at {url}; {fix}")
    if await backend.list(JOURNAL_DIR):  # a save over it would lose the partial save
        raise CheckpointExistsError(
            f"{url} holds an unfinalized partial save ({JOURNAL_DIR}/): commit it with "
            f"quire.partial.finalize(url) or remove it with quire.partial.discard(url) "
            f"first; or {fix}"
        )


# ----------------------------------------------------------------------------- writing
def _warn_unless(backend: Backend, url: str, capability: str, what: str) -> None:
    if not getattr(backend.capabilities, capability):
        log.warning(
            "%s: backend %s has no %s; a concurrent writer could race this %s "
            "(install a dedicated quire backend for this protocol)",
            url,
            type(backend).__name__,
            capability.replace("_", " "),
            what,
        )


async def create(
    backend: Backend,
    key: str,
    data: bytes,
    url: str,
    check: Callable[[bytes], object],
    *,
    complete: bool = False,
) -> bool:
    """Conditionally create ``key`` (a journal version, the Checkpointer's root record);
    True if this call created it, False if it already existed.

    ``check`` is the function its readers parse ``key`` with; it runs on ``data`` first,
    and a record it refuses is not created (``UnreadableRecordError``).  With ``complete``
    (a record with array leaves: a journal version), the record ``check`` returns must also
    have every chunk of its arrays stored (``IncompleteCheckpointError`` otherwise).
    """
    doc = _refuse_unreadable(check, data, url, key)
    if complete:
        await _refuse_incomplete(backend, url, key, doc)
    _warn_unless(backend, url, "atomic_create", f"create of {key}")
    try:
        await backend.put_if_absent(key, data)  # COMMIT of ``key``
    except PreconditionFailed:
        return False
    return True


async def publish(
    backend: Backend,
    url: str,
    data: bytes,
    txids: Collection[str],
    *,
    overwrite: bool,
    fix: str = "pass overwrite=True to replace it",
    owned: bool = True,
    coord: Coordinator | None = None,
    keep_superseded: bool = False,
    indexes_from: Backend | None = None,
) -> None:
    """Commit ``data`` as ``url``'s ``quire.json``, then drop the data it supersedes
    (unless ``keep_superseded``: an incremental root, whose later steps may borrow those
    bytes; its mark-and-sweep gc removes them).

    ``txids`` are the data the record references.  Without ``overwrite`` the record is
    conditionally created; losing that race raises ``CheckpointExistsError`` after
    removing ``txids`` when this call ``owned`` them (wrote them for this commit), unless
    the winner's record references them too (a concurrent copy of the same checkpoint).  With ``overwrite`` the current
    record is swapped for ours by compare-and-swap, retried until it lands.  After the
    commit point the primary of ``coord`` announces the outcome, and only then is the data
    of txids no longer referenced deleted (a failure there just leaves garbage for GC).

    First of all ``data`` goes through :func:`check_record`, as every load would, and
    every chunk of its arrays must be stored (``quire._engine.completeness``: in a chunk
    index it names, or as an object); if not, nothing is published
    (``UnreadableRecordError``; ``IncompleteCheckpointError`` for a missing chunk) and
    ``txids`` are removed as after a lost race.  ``indexes_from``: where that check reads
    the record's chunk-index objects when not from ``backend`` (a promotion: the local step
    it copied them from, so the persistent tier is not read again).
    """
    mine = set(txids)
    try:
        doc = _refuse_unreadable(lambda raw: check_record(raw, url), data, url, RECORD)
        await _refuse_incomplete(backend, url, RECORD, doc, indexes_from)
    except UnreadableRecordError:  # IncompleteCheckpointError too
        if owned:
            await drop_unreferenced(backend, url, mine)
        raise
    _warn_unless(backend, url, "atomic_create", "commit")
    old: set[str] = set()
    if overwrite:
        _warn_unless(backend, url, "atomic_replace", "overwrite")
        while True:
            version = await backend.version(RECORD)
            try:
                if version is None:
                    await backend.put_if_absent(RECORD, data)  # COMMIT POINT
                    old = set()
                    break
                old = await _txids_at(backend, url)
                await backend.replace_if_match(RECORD, data, version)  # COMMIT POINT
                break
            except PreconditionFailed:
                continue  # another writer committed meanwhile: replace theirs
    else:
        try:
            await backend.put_if_absent(RECORD, data)  # COMMIT POINT
        except PreconditionFailed:
            if owned:
                await drop_unreferenced(backend, url, mine)
            raise CheckpointExistsError(
                f"a checkpoint already exists at {url} (another writer committed first); {fix}"
            ) from None
    if coord is not None and coord.active and coord.is_primary:
        await coord.decide("ok:null")
    stale = sorted(old - mine)
    if stale and not keep_superseded and await in_incremental_root(backend, url):
        log.info(
            "%s: the data of the replaced checkpoint is left to the root's gc "
            "(`quire gc ROOT`): it is a step of an incremental root, whose later steps may "
            "borrow its bytes",
            url,
        )
    elif not keep_superseded:
        await drop_txids(backend, url, stale)


async def in_incremental_root(backend: Backend, url: str) -> bool:
    """Whether ``url`` is a step of a Checkpointer root that has held incremental steps
    (its ``leases/incremental.json``): later steps may borrow its bytes, so only the
    root's mark-and-sweep gc deletes them."""
    head, sep, _ = url.rstrip("/").rpartition("/")
    if not sep or not head or head.endswith(":/"):
        return False
    try:
        root = open_backend(head, backend.storage_options)
        return await root.exists(INCREMENTAL_MARKER)
    except Exception as e:  # cannot tell: keep the bytes (garbage, never a broken step)
        log.debug("%s: could not look for %s in %s: %s", url, INCREMENTAL_MARKER, head, e)
        return True


async def _txids_at(backend: Backend, url: str) -> set[str]:
    try:
        return set(_records.parse(await backend.get(RECORD), url)["txids"])
    except (FileNotFoundError, CorruptCheckpointError):
        return set()


async def drop_unreferenced(backend: Backend, url: str, txids: Collection[str]) -> None:
    """Delete the data of those ``txids`` the record at ``url`` does not reference (what a
    failed write of this process left behind; another writer's copy of the same txids, once
    committed, is kept)."""
    await drop_txids(backend, url, sorted(set(txids) - await _txids_at(backend, url)))


async def drop_txids(backend: Backend, url: str, txids: Collection[str]) -> None:
    """Delete the data of ``txids`` (failures only leave garbage for GC)."""
    for t in txids:
        try:
            await backend.delete_prefix(f"d/{t}")
        except Exception as e:
            log.warning(
                "could not remove unreferenced data d/%s under %s (%s: %s); `quire gc %s --yes` "
                "removes it once it is older than the grace period",
                t, url, type(e).__name__, e, url,
            )  # fmt: skip


# ----------------------------------------------------------------------------- processes
async def collective(
    coord: Coordinator,
    url: str,
    work: Callable[[], Awaitable[T]],
    commit_fn: Callable[[T], Awaitable[R]],
    cleanup: Callable[[], Awaitable[None]],
    digests: Callable[[T], dict[str, str]],
) -> R:
    """Run ``work`` on every process, then ``commit_fn`` on the primary once every process
    succeeded and agrees (``digests`` of their results match); every process returns the
    primary's result or raises ``MultiProcessError``.  ``commit_fn`` may announce the
    outcome itself (``publish`` does, at the commit point); otherwise it is announced
    with ``commit_fn``'s JSON result once it returns."""
    try:
        result = await work()
    except BaseException as e:
        if coord.active:
            await coord.report(f"{type(e).__name__}: {e}")
            if coord.is_primary:
                await coord.decide(f"abort: primary process {coord.index} failed: {e}")
                await cleanup()
        raise
    if not coord.active:
        return await commit_fn(result)
    mine = digests(result)
    await coord.report(None, mine)
    if coord.is_primary:
        why = await coord.collect(mine)
        if why is not None:
            await coord.decide(f"abort: {why}")
            await cleanup()
            raise MultiProcessError(
                f"{url}: save aborted on every process, nothing committed: {why}"
            )
        try:
            value = await commit_fn(result)
        except BaseException as e:
            if not coord.decided:
                await coord.decide(
                    f"abort: the commit failed on primary process {coord.index}: {e}"
                )
            raise
        if not coord.decided:
            await coord.decide("ok:" + json.dumps(value))
        return value
    out = await coord.outcome()
    if not out.startswith("ok:"):
        raise MultiProcessError(
            f"{url}: save aborted on every process, nothing committed: {out.removeprefix('abort: ')}"
        )
    return json.loads(out[3:])  # type: ignore[no-any-return]
