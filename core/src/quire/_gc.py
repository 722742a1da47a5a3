"""The layout of a Checkpointer root: step names, the root record, listing and garbage.

A root holds one ordinary quire checkpoint per step, at ``<root>/<step_format.format(step)>``,
plus the root record ``<root>/checkpointer.json``::

    {"format": "quire-checkpointer", "version": 1, "step_format": "step_{:08d}",
     "created": ISO-8601, "library_version": str, "metadata": {...user...}}

A step directory is in one of three states:

* ``committed``  - it holds ``quire.json`` (the only state ``Checkpointer`` ever loads);
* ``partial``    - no ``quire.json`` but a partial-save journal (``journal/``);
* ``incomplete`` - neither: a save that never committed, or a half-finished deletion.

Garbage (removed by :func:`collect`, never younger than the grace period):

* incomplete step directories, whole;
* inside committed steps without a journal, ``d/<txid>/`` prefixes that ``quire.json``
  does not reference (left by a crash during an overwrite or by a re-save over debris).

Partial steps and directory names that do not parse as steps are never touched.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import string
import time
from collections import defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from quire import _commit, _format
from quire._format import JOURNAL_DIR
from quire._version import __version__
from quire.backends import Backend
from quire.errors import CorruptCheckpointError, QuireError

ROOT_RECORD = "checkpointer.json"
ROOT_FORMAT = "quire-checkpointer"
ROOT_VERSION = 1
DEFAULT_STEP_FORMAT = "step_{:08d}"
DEFAULT_GRACE_PERIOD = 3600.0
METRICS_KEY = "quire.metrics"
_CONCURRENCY = 32


# ----------------------------------------------------------------------------- step names
class StepFormat:
    """``str.format`` pattern with one integer field, e.g. ``"step_{:08d}"``; parses back."""

    def __init__(self, pattern: str) -> None:
        if not isinstance(pattern, str):
            raise TypeError(f"step_format must be a str like 'step_{{:08d}}', got {pattern!r}")
        try:
            parts = list(string.Formatter().parse(pattern))
        except ValueError as e:
            raise ValueError(f"step_format {pattern!r} is not a format string: {e}") from e
        fields = [p for p in parts if p[1] is not None]
        if len(fields) != 1 or fields[0][1] not in ("", "0") or fields[0][3] is not None:
            raise ValueError(
                f"step_format {pattern!r} must have exactly one replacement field for the step "
                "number ('{}' or '{:08d}'), without a name or conversion"
            )
        self.pattern = pattern
        i = parts.index(fields[0])
        self.prefix = "".join(p[0] for p in parts[: i + 1])
        self.suffix = "".join(p[0] for p in parts[i + 1 :])
        try:
            a, b = self.name(0), self.name(12345)
        except (ValueError, TypeError) as e:
            raise ValueError(f"step_format {pattern!r} cannot format an int step: {e}") from e
        bad = [c for c in ("/", "\\", "\x00") if c in a + b]
        if bad or a in ("", ".", "..") or a == b:
            raise ValueError(
                f"step_format {pattern!r} must give one plain directory name per step "
                "(no '/', not empty, the step number in it)"
            )

    def name(self, step: int) -> str:
        """The directory name of ``step``."""
        return self.pattern.format(step)

    def parse(self, name: str) -> int | None:
        """The step a directory name stands for; None if it is not exactly such a name."""
        if not (name.startswith(self.prefix) and name.endswith(self.suffix)):
            return None
        middle = name[len(self.prefix) : len(name) - len(self.suffix)]
        if not middle or not middle.strip().lstrip("+").isdigit():
            return None
        step = int(middle)
        if step < 0 or self.name(step) != name:  # only the canonical spelling counts
            return None
        return step

    def __repr__(self) -> str:
        return f"StepFormat({self.pattern!r})"


# ----------------------------------------------------------------------------- root record
async def read_root_record(backend: Backend, url: str) -> dict[str, Any] | None:
    """The parsed root record, or None when the root has none."""
    try:
        raw = await backend.get(ROOT_RECORD)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(
            f"{url}/{ROOT_RECORD} is not valid JSON ({e}); delete it to let quire rewrite it"
        ) from e
    if (
        not isinstance(doc, dict)
        or doc.get("format") != ROOT_FORMAT
        or not isinstance(doc.get("step_format"), str)
        or not isinstance(doc.get("metadata", {}), dict)
    ):
        raise CorruptCheckpointError(
            f"{url}/{ROOT_RECORD} is not a quire Checkpointer root record; move it away"
        )
    if doc.get("version") != ROOT_VERSION:
        raise CorruptCheckpointError(
            f"{url}/{ROOT_RECORD} has version {doc.get('version')!r}; this quire reads version "
            f"{ROOT_VERSION}. Upgrade quire"
        )
    return doc


async def create_root_record(backend: Backend, step_format: str, metadata: dict[str, Any]) -> bool:
    """Create the root record unless one exists (conditional create); True if we made it."""
    doc = {
        "format": ROOT_FORMAT,
        "version": ROOT_VERSION,
        "step_format": step_format,
        "created": datetime.datetime.now(datetime.UTC).isoformat(),
        "library_version": __version__,
        "metadata": metadata,
    }
    try:
        data = json.dumps(doc, allow_nan=False, indent=1).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"Checkpointer metadata must be JSON-serialisable: {e}") from e
    return await _commit.create(backend, ROOT_RECORD, data, backend.url)


async def root_step_format(backend: Backend, url: str, given: str | None = None) -> StepFormat:
    """``given``, else the root record's, else the default."""
    if given is not None:
        return StepFormat(given)
    doc = await read_root_record(backend, url)
    return StepFormat(doc["step_format"] if doc else DEFAULT_STEP_FORMAT)


# ----------------------------------------------------------------------------- listing
@dataclass(frozen=True)
class StepDir:
    """One step directory as listed: its keys are relative to the root."""

    name: str
    step: int
    keys: tuple[str, ...]

    @property
    def state(self) -> str:
        if f"{self.name}/{_format.RECORD}" in self.keys:
            return "committed"
        if any(k.startswith(f"{self.name}/{JOURNAL_DIR}/") for k in self.keys):
            return "partial"
        return "incomplete"

    @property
    def has_journal(self) -> bool:
        return any(k.startswith(f"{self.name}/{JOURNAL_DIR}/") for k in self.keys)


@dataclass(frozen=True)
class Listing:
    """Step directories (sorted by step) and top-level names that are not steps."""

    steps: list[StepDir]
    others: list[str] = field(default_factory=list)


async def committed_steps(backend: Backend, fmt: StepFormat) -> list[int]:
    """Steps with a commit record: one-level listing plus an existence check per step
    (never a recursive listing of the steps' data)."""
    _, names = await backend.list_dir("")
    candidates = [(name, step) for name in names if (step := fmt.parse(name)) is not None]
    found = await _gather_limited(backend.exists(f"{n}/{_format.RECORD}") for n, _ in candidates)
    return sorted(step for (_, step), ok in zip(candidates, found) if ok)


async def list_root(backend: Backend, fmt: StepFormat) -> Listing:
    """Group every key under the root by its first path component."""
    groups: dict[str, list[str]] = defaultdict(list)
    others: set[str] = set()
    for key in await backend.list(""):
        head, sep, _ = key.partition("/")
        if sep:
            groups[head].append(key)
        else:
            others.add(head)
    steps = []
    for name, keys in groups.items():
        step = fmt.parse(name)
        if step is None:
            others.add(name)
        else:
            steps.append(StepDir(name, step, tuple(keys)))
    steps.sort(key=lambda s: s.step)
    return Listing(steps, sorted(others))


async def _gather_limited(coros: Iterable[Any]) -> list[Any]:
    sem = asyncio.Semaphore(_CONCURRENCY)

    async def one(c: Any) -> Any:
        async with sem:
            return await c

    return list(await asyncio.gather(*(one(c) for c in coros)))


async def _size(backend: Backend, key: str) -> int:
    try:
        return await backend.size(key)
    except FileNotFoundError:
        return 0


async def _mtime(backend: Backend, key: str) -> float | None:
    try:
        return await backend.modified(key)
    except FileNotFoundError:
        return None


async def sizes(backend: Backend, keys: Collection[str]) -> int:
    return sum(await _gather_limited(_size(backend, k) for k in keys))


async def newest(backend: Backend, keys: Collection[str]) -> float | None:
    """The newest modification time among ``keys``; None if any is unknown (or none)."""
    times = await _gather_limited(_mtime(backend, k) for k in keys)
    if not times or any(t is None for t in times):
        return None
    return max(times)


async def read_step_record(backend: Backend, url: str, name: str) -> dict[str, Any] | None:
    """The parsed ``quire.json`` of step directory ``name``; None if it vanished."""
    rec = await _commit.read_if_exists(backend, url, under=name)
    return rec.doc if rec is not None else None


def record_metrics(doc: dict[str, Any]) -> dict[str, Any]:
    m = doc.get("metadata", {}).get(METRICS_KEY)
    return dict(m) if isinstance(m, dict) else {}


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
    from quire._progress import advance

    advance(g.nbytes)  # `quire gc --yes` on a terminal: the bar counts what is removed
    return True


async def finish_unfinished(backend: Backend, url: str, path: str) -> bool:
    """Garbage of kind ``"unfinished"`` at ``path`` (a checkpoint that was finalized, but
    whose finalize was killed before it removed its journal and what it superseded):
    finish that clean-up.  False when there is nothing to finish any more."""
    from quire import _journal
    from quire._url import open_backend

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
