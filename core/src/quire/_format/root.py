"""The layout of a Checkpointer root: step names, the root record and listing.

A root holds one ordinary quire checkpoint per step, at ``<root>/<step_format.format(step)>``,
plus the root record ``<root>/checkpointer.json``::

    {"format": "quire-checkpointer", "version": 1, "step_format": "step_{:08d}",
     "created": ISO-8601, "library_version": str, "metadata": {...user...}}

A step directory is in one of three states:

* ``committed``  - it holds ``quire.json`` (the only state ``Checkpointer`` ever loads);
* ``partial``    - no ``quire.json`` but a partial-save journal (``journal/``);
* ``incomplete`` - neither: a save that never committed, or a half-finished deletion.

Reading only: creating the root record (a conditional create) and collecting garbage are
``quire._engine.garbage``'s.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import string
from collections import defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from quire._format import record as _records
from quire._format.record import JOURNAL_DIR
from quire._runtime.version import __version__
from quire._store.base import Backend
from quire.errors import CorruptCheckpointError

ROOT_RECORD = "checkpointer.json"
ROOT_FORMAT = "quire-checkpointer"
ROOT_VERSION = 1
DEFAULT_STEP_FORMAT = "step_{:08d}"
METRICS_KEY = "quire.metrics"
#: Incremental saves' leases (``quire._engine.incremental``), under the root.
LEASE_DIR = "leases"
#: Written by the first incremental save of a Checkpointer (never deleted): the root may
#: hold borrowed bytes, so every Checkpointer's retention deletes records, not directories,
#: and an overwrite of a step leaves the data it replaces to the root's gc.
INCREMENTAL_MARKER = f"{LEASE_DIR}/incremental.json"
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
        lost = [n for n in (0, 7, 12, 999, 1000, 12345, 10**9) if self.parse(self.name(n)) != n]
        if lost:  # a step saved under such a name would vanish from the next listing
            raise ValueError(
                f"step_format {pattern!r}: step {lost[0]}'s name {self.name(lost[0])!r} does not "
                "parse back to the step (use decimal digits, e.g. 'step_{:08d}', without "
                "separators or another base)"
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
    return parse_root_record(raw, url)


def parse_root_record(raw: bytes, url: str) -> dict[str, Any]:
    """Parse and check a root record's bytes: what every reader of one runs, and what its
    creation runs on the record before publishing it; ``CorruptCheckpointError``."""
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


def root_record_bytes(step_format: str, metadata: dict[str, Any]) -> bytes:
    """The root record of a new root, serialised (created by ``quire._engine.garbage.create_root_record``)."""
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
    return data


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
        if f"{self.name}/{_records.RECORD}" in self.keys:
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
    found = await _gather_limited(backend.exists(f"{n}/{_records.RECORD}") for n, _ in candidates)
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
    if backend.capabilities.directories:  # step folders holding no object (a killed save)
        _, names = await backend.list_dir("")
        for name in names:
            groups.setdefault(name, [])
    steps = []
    for name, keys in groups.items():
        step = fmt.parse(name)
        if step is None:
            others.add(name)
        else:
            steps.append(StepDir(name, step, tuple(keys)))
    steps.sort(key=lambda s: s.step)
    return Listing(steps, sorted(others))


async def folders(backend: Backend, prefix: str) -> list[str]:
    """The directory ``prefix`` and every directory under it, on a store with
    ``capabilities.directories`` (none elsewhere, and none when ``prefix`` is not one)."""
    if not backend.capabilities.directories:
        return []
    out, todo = [], [prefix]
    while todo:
        d = todo.pop()
        try:
            _, dirs = await backend.list_dir(d)
        except (FileNotFoundError, NotADirectoryError):
            continue
        out.append(d)
        todo += [f"{d}/{n}" for n in dirs]
    return out


async def subfolders(backend: Backend, prefix: str) -> list[str]:
    """Names of the directories directly under ``prefix`` on a store with
    ``capabilities.directories`` (an empty one included); [] elsewhere."""
    if not backend.capabilities.directories:
        return []
    try:
        return (await backend.list_dir(prefix))[1]
    except (FileNotFoundError, NotADirectoryError):
        return []


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


def record_metrics(doc: dict[str, Any]) -> dict[str, Any]:
    m = doc.get("metadata", {}).get(METRICS_KEY)
    return dict(m) if isinstance(m, dict) else {}


async def root_hint(backend: Backend) -> str:
    """For a 'no checkpoint here' error: what the URL is instead (a Checkpointer root,
    a folder of checkpoints), naming the steps or checkpoints; "" when nothing is known."""
    try:
        doc = await read_root_record(backend, "")
        _, dirs = await backend.list_dir("")
    except Exception:  # broad: a hint in a "no checkpoint here" error only
        return ""
    if doc is not None:
        fmt = StepFormat(doc["step_format"])
        steps = await committed_steps(backend, fmt)
        if not steps:
            return " It is a quire.Checkpointer root with no committed step yet"
        shown = ", ".join(map(str, steps[-10:]))
        more = f" ({len(steps)} in all)" if len(steps) > 10 else ""
        return (
            f" It is a quire.Checkpointer root; its committed steps are {shown}{more}. Load "
            f"one with quire.Checkpointer(url).load({steps[-1]}) or from "
            f"<url>/{fmt.name(steps[-1])}; `quire ls <url>` lists them"
        )
    try:
        have = [d for d in dirs if await backend.exists(f"{d}/{_records.RECORD}")]
    except Exception:  # broad: a hint in a "no checkpoint here" error only
        return ""
    if have:
        shown = ", ".join(have[:10]) + (" ..." if len(have) > 10 else "")
        return f" It holds checkpoints in sub-folders: {shown} (`quire ls <url>` lists them)"
    try:
        roots = [d for d in dirs if await backend.exists(f"{d}/{ROOT_RECORD}")]
    except Exception:  # broad: a hint in a "no checkpoint here" error only
        return ""
    if roots:  # a LocalTier's folder: a root per process
        shown = ", ".join(roots[:10]) + (" ..." if len(roots) > 10 else "")
        return (
            f" It holds quire.Checkpointer roots in sub-folders: {shown} (`quire ls <url>` "
            "lists their steps)"
        )
    return ""
