"""Partial saves: build a checkpoint over several calls, then finalize it atomically.

::

    quire.partial.save(url, {"params": params})          # version 1
    quire.partial.save(url, {"opt_state": opt_state})    # version 2
    quire.partial.delete(url, [("params", "unused")])    # version 3
    quire.partial.load(url)                              # the state at version 3
    quire.partial.finalize(url)                          # now an ordinary checkpoint

Every call appends one version to ``<url>/journal/`` by conditional create, writing only
its own leaves' data (never a copy of earlier versions).  A later version wins where two
touch the same key; custom metadata is merged, later keys winning.  An interrupted call
leaves the previous version whole.  Two writers appending at once never lose a version:
one gets N+1, the other retries on top as N+2 — unless it replaces or deletes a key path
that the winner also touched, in which case it raises :class:`JournalConflictError`
(a :class:`quire.CheckpointExistsError`) and records nothing.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Iterable, Mapping
from typing import Any, TypedDict, Unpack

from quire import _api
from quire._engine import journal as _journal
from quire._engine import save as _saving
from quire._engine.journal import JournalConflictError, JournalVersion
from quire._format import record as _records
from quire._runtime import ioloop as _io
from quire._runtime.config import current
from quire._runtime.multihost import Coordinator
from quire._store.url import normalize
from quire.options import StorageSpec

__all__ = [
    "JournalConflictError",
    "JournalVersion",
    "delete",
    "discard",
    "finalize",
    "load",
    "save",
    "save_async",
    "versions",
]


def _coordinator(url: str, what: str) -> Any:
    cfg = current()
    return Coordinator(url, what, primary=cfg.primary_process, timeout=cfg.timeout)


class PartialSaveOptions(TypedDict, total=False):
    """The keyword options of :func:`save` and :func:`save_async` (described under
    :func:`save`)."""

    metadata: Mapping[str, Any] | None
    storage: StorageSpec
    storage_options: dict[str, Any] | None


def _start_save(
    fn: str, url: str | os.PathLike[str], tree: Any, copy: bool, options: PartialSaveOptions
) -> _api.AsyncResponse[int]:
    unknown = sorted(set(options) - set(PartialSaveOptions.__annotations__))
    if unknown:
        raise TypeError(f"quire.partial.{fn}() got an unexpected keyword argument {unknown[0]!r}")
    u = normalize(url)
    prep = _saving.prepare_save({_records.PYTREE: tree}, options.get("storage"), copy=copy, url=u)
    md = dict(options.get("metadata") or {})
    so = options.get("storage_options")

    def write() -> Awaitable[int]:
        return _journal.append(u, prep=prep, metadata=md, storage_options=so)

    # An async save has returned: its write runs beside the caller's training steps.
    return _api.chain(
        u, (lambda: _io.in_background(write())) if copy else write, f"partial save {u}"
    )


def save_async(
    url: str | os.PathLike[str], tree: Any, **options: Unpack[PartialSaveOptions]
) -> _api.AsyncResponse[int]:
    """Append ``tree`` (its leaves are added or replace earlier ones) as a new version.

    Returns once every owned shard is safe from the caller (as for :func:`quire.save_async`);
    async calls on one URL apply in call order.

    Parameters
    ----------
    url, tree, metadata, storage, storage_options
        As for :func:`save`.

    Returns
    -------
    AsyncResponse of int
        ``.result()`` is the new version number; it raises what :func:`save` would.
    """
    return _start_save("save_async", url, tree, True, options)


def save(url: str | os.PathLike[str], tree: Any, **options: Unpack[PartialSaveOptions]) -> int:
    """Blocking :func:`save_async`; returns the new version number.

    Parameters
    ----------
    url : str or os.PathLike
        The (unfinalized) checkpoint.
    tree : pytree
        Leaves to add or replace (key paths as in :func:`quire.save`).
    metadata : mapping, optional
        JSON user metadata merged into the checkpoint's (later versions win per key).
    storage : StorageOptions or callable, optional
        Per-leaf storage options, as for :func:`quire.save`.
    storage_options : dict, optional
        fsspec ``storage_options`` for the backend.

    Returns
    -------
    int
        The new version number.

    Raises
    ------
    CheckpointExistsError
        ``url`` is already finalized.
    JournalConflictError
        A concurrent partial save touched the same key paths first.
    """
    return _start_save("save", url, tree, False, options).result()


def delete(
    url: str | os.PathLike[str],
    key_paths: Iterable[tuple[Any, ...]],
    *,
    metadata: Mapping[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """Append a version deleting ``key_paths``.

    Parameters
    ----------
    url : str or os.PathLike
        The (unfinalized) checkpoint.
    key_paths : iterable of tuple
        Tuples of keys, e.g. ``("params", "w")``; a path to a container deletes the
        whole subtree.
    metadata : mapping, optional
        JSON user metadata merged into the checkpoint's.
    storage_options : dict, optional
        fsspec ``storage_options`` for the backend.

    Returns
    -------
    int
        The new version number.

    Raises
    ------
    TreeMismatchError
        A key path does not exist in the latest version (the error names it).
    TypeError
        A key path is not a non-empty tuple of keys.
    CheckpointExistsError
        ``url`` is already finalized.
    """
    u = normalize(url)
    paths = []
    for p in key_paths:
        if isinstance(p, str | bytes) or not isinstance(p, tuple | list) or not p:
            raise TypeError(
                f"key paths are non-empty tuples of keys, e.g. ('params', 'w'); got {p!r}"
            )
        paths.append(tuple(p))
    md = dict(metadata or {})
    coord = _coordinator(u, "partial-delete")
    return _api.chain(
        u,
        lambda: _journal.append(
            u, prep=None, coord=coord, deleted=paths, metadata=md, storage_options=storage_options
        ),
        f"partial delete {u}",
    ).result()


def finalize(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> None:
    """Commit the latest version as an ordinary checkpoint, then remove the journal and
    the data no leaf references any more.

    Format v2: a pack of which less than half the bytes are still live is rewritten first
    (its live chunks copied, checked, into a new pack of this process; the primary does it
    for every process); packs at least half live are kept as they are (docs/format.md).
    If interrupted before the commit, run it again.

    Parameters
    ----------
    url : str or os.PathLike
        The (unfinalized) checkpoint.
    storage_options : dict, optional
        fsspec ``storage_options`` for the backend.

    Raises
    ------
    CheckpointNotFoundError
        There is no journal at ``url``.
    CheckpointExistsError
        ``url`` is already finalized (or was finalized concurrently).
    """
    u = normalize(url)
    coord = _coordinator(u, "finalize")
    _api.chain(u, lambda: _journal.finalize(u, storage_options, coord), f"finalize {u}").result()


def discard(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> None:
    """Throw away the journal and its data (latest version first, so an interrupted
    discard leaves an earlier version whole; run it again to finish).

    On a checkpoint whose finalize was killed after its commit, it finishes that finalize's
    clean-up instead: the leftover journal and the packs it superseded; the committed
    checkpoint is untouched.

    Parameters
    ----------
    url : str or os.PathLike
        The (unfinalized) checkpoint.
    storage_options : dict, optional
        fsspec ``storage_options`` for the backend.

    Raises
    ------
    CheckpointNotFoundError
        There is no journal at ``url``.
    """
    u = normalize(url)
    coord = _coordinator(u, "discard")
    _api.chain(u, lambda: _journal.discard(u, storage_options, coord), f"discard {u}").result()


def versions(
    url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> list[JournalVersion]:
    """Every version of the journal at ``url``, oldest first.

    Parameters
    ----------
    url : str or os.PathLike
        The (unfinalized) checkpoint.
    storage_options : dict, optional
        fsspec ``storage_options`` for the backend.

    Returns
    -------
    list of JournalVersion
        ``.version``, ``.created``, ``.metadata`` and the key paths added, replaced and
        deleted by each version.

    Raises
    ------
    CorruptCheckpointError
        A journal record is malformed or missing.
    """
    return _io.submit(_journal.versions(normalize(url), storage_options)).result()


def load(
    url: str | os.PathLike[str],
    abstract: Any = None,
    *,
    version: int | None = None,
    partial: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """Load an unfinalized checkpoint at its latest (or any) version.

    Parameters
    ----------
    url : str or os.PathLike
        The (unfinalized) checkpoint.
    abstract : pytree, optional
        The target; same meaning and strictness as for :func:`quire.load`.
    version : int, optional
        The version to load (default: the latest).
    partial : bool
        Load only the keys present in ``abstract``.
    storage_options : dict, optional
        fsspec ``storage_options`` for the backend.

    Returns
    -------
    pytree
        The replay of versions 1..``version``.

    Raises
    ------
    CheckpointNotFoundError
        No journal at ``url`` (a finalized checkpoint loads as with :func:`quire.load`
        when ``version`` is None), or no such version.
    TreeMismatchError
        ``abstract`` does not match the tree.
    """
    u = normalize(url)
    return _io.submit(
        _journal.load(
            u, abstract, version=version, partial=partial, storage_options=storage_options
        )
    ).result()
