"""What a command's URL holds: a committed checkpoint, a partial save, a Checkpointer root
or anything else (another format's checkpoint, or nothing); and the one-line refusals of the
commands that work on one checkpoint, each naming the command to run instead (exit 2).

Reads a few small objects (``quire.json``, ``checkpointer.json``, the journal's listing);
imports neither JAX nor zarr.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quire._cli.common import UsageError
from quire._format import root as _root
from quire._format.record import JOURNAL_DIR, RECORD, is_journal_record
from quire._runtime import ioloop as _io
from quire._store.base import NOT_DATA
from quire._store.url import normalize, open_backend


@dataclass(frozen=True)
class Target:
    """A URL as a command sees it.

    ``kind`` is ``"checkpoint"`` (``quire.json``), ``"partial"`` (a partial save's journal,
    not finalized), ``"root"`` (a ``quire.Checkpointer`` root) or ``"other"``.  A root has
    its committed ``steps`` and the URL of the ``latest``; a partial save its ``versions``.
    """

    url: str
    kind: str
    steps: tuple[int, ...] = ()
    latest: str = ""
    versions: int = 0


async def _target(u: str, storage_options: dict[str, Any] | None) -> Target:
    backend = open_backend(u, storage_options)
    if await backend.exists(RECORD):
        return Target(u, "checkpoint")
    if await backend.exists(_root.ROOT_RECORD):
        fmt = await _root.root_step_format(backend, u)
        steps = await _root.committed_steps(backend, fmt)
        latest = f"{u}/{fmt.name(steps[-1])}" if steps else ""
        return Target(u, "root", tuple(steps), latest)
    try:
        names, _ = await backend.list_dir(JOURNAL_DIR)
    except OSError as e:
        if isinstance(e, FileNotFoundError) or e.errno in NOT_DATA:
            return Target(u, "other")  # a file, a looping link: the source that opens it says
        raise
    versions = sum(map(is_journal_record, names))
    if versions:
        return Target(u, "partial", versions=versions)
    return Target(u, "other")


def target(url: str, storage_options: dict[str, Any] | None) -> Target:
    """What ``url`` holds (see :class:`Target`)."""
    return _io.submit(_target(normalize(url), storage_options)).result()


def one_checkpoint(t: Target, command: Callable[[str], str], *, partial_ok: bool = False) -> None:
    """Refuse a root (and unless ``partial_ok``, a partial save) where a command needs one
    committed checkpoint (or another format's): :class:`UsageError` naming what to run
    instead; ``command(url)`` is the same command line on another URL (a root's latest
    step)."""
    if t.kind == "root":
        if not t.steps:
            raise UsageError(
                f"{t.url} is a quire.Checkpointer root with no committed step yet, not one "
                f"checkpoint: quire ls {t.url} shows its steps"
            )
        steps = ", ".join(map(str, t.steps[-5:]))
        raise UsageError(
            f"{t.url} is a quire.Checkpointer root (committed steps {steps}), not one "
            f"checkpoint: run {command(t.latest)} for its latest step; quire ls {t.url} "
            "lists its steps"
        )
    if t.kind == "partial" and not partial_ok:
        raise UsageError(
            f"{t.url} is a partial save, not finalized (journal at version {t.versions}): "
            "finalize it first (quire.partial.finalize(url) in Python); quire info and "
            "quire verify read it as it is"
        )


def other_format(url: str, storage_options: dict[str, Any] | None) -> str | None:
    """The format id of another format's checkpoint at ``url`` (safetensors, Orbax...),
    None when none recognises it (or quire's own does).  It is opened once: a URL a source
    recognises but cannot open (an Orbax ``CheckpointManager`` root) raises that source's
    error, which names what to open instead."""
    from quire._sources.opening import open as open_source  # the source plugins: only here
    from quire._sources.opening import recognised

    fmt = recognised(url, **(storage_options or {}))
    if fmt in (None, "quire"):
        return None
    with open_source(url, format=fmt, **(storage_options or {})):
        return fmt


def a_checkpoint(fmt: str) -> str:
    """``"a safetensors checkpoint"``, ``"an orbax checkpoint"``."""
    return f"{'an' if fmt[:1] in 'aeiou' else 'a'} {fmt} checkpoint"


def not_a_prefix(url: str, storage_options: dict[str, Any] | None, then: str) -> None:
    """Where a command over quire's prefixes (ls, gc) is given another format's checkpoint:
    :class:`UsageError` in one line (``then`` says what follows for this command), naming
    the commands that read it."""
    fmt = other_format(url, storage_options)
    if fmt is not None:
        raise UsageError(
            f"{url} is {a_checkpoint(fmt)}, not a quire one: {then}; quire info {url} "
            f"describes it, quire cp {url} DST converts it"
        )
