"""The public free functions: save / load / metadata, blocking and async."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Generic, TypeVar

from quire import _engine, _io
from quire._url import normalize
from quire.metadata import CheckpointMetadata
from quire.options import StorageSpec

T = TypeVar("T")

_inflight_lock = threading.Lock()
_inflight: dict[str, concurrent.futures.Future[Any]] = {}


class AsyncResponse(Generic[T]):
    """The handle of a background save or load.

    ``result(timeout=None)`` waits and returns the value (or raises the error);
    ``done()`` says whether it finished.
    """

    def __init__(self, future: concurrent.futures.Future[T], description: str = "") -> None:
        self._future = future
        self._description = description

    def result(self, timeout: float | None = None) -> T:
        """Wait for completion; re-raise the operation's error. ``TimeoutError`` on timeout."""
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Any) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<AsyncResponse {self._description} {state}>"


def _start_save(
    url: str | os.PathLike[str],
    units: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None,
    overwrite: bool,
    storage: StorageSpec,
    copy: bool,
    storage_options: dict[str, Any] | None = None,
    stats: dict[str, Any] | None = None,
    layout: str | None = None,
) -> AsyncResponse[None]:
    u = normalize(url)
    prep = _engine.prepare_save(units, storage, copy=copy, url=u, layout=layout)

    return chain(
        u,
        lambda: _engine.save_prepared(
            u,
            prep,
            metadata=metadata,
            overwrite=overwrite,
            storage_options=storage_options,
            stats=stats,
        ),
        f"save {u}",
    )


def chain(u: str, make: Callable[[], Awaitable[T]], description: str) -> AsyncResponse[T]:
    """Run ``make()`` on quire's loop after the previous write-operation on ``u`` ends.

    Writes to one URL from one process thus apply in call order, one at a time.
    """
    with _inflight_lock:
        prev = _inflight.get(u)

        async def run() -> T:
            if prev is not None and not prev.done():
                try:
                    await asyncio.wrap_future(prev)
                except BaseException:
                    pass  # its error belongs to its own caller
            return await make()

        fut = _io.submit(run())
        _inflight[u] = fut

    def _done(f: concurrent.futures.Future[Any]) -> None:
        with _inflight_lock:
            if _inflight.get(u) is f:
                del _inflight[u]

    fut.add_done_callback(_done)
    return AsyncResponse(fut, description)


def save(
    url: str | os.PathLike[str],
    tree: Any,
    *,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    storage: StorageSpec = None,
    storage_options: dict[str, Any] | None = None,
    layout: str | None = None,
) -> None:
    """Save ``tree`` to ``url`` and commit it atomically.

    Parameters
    ----------
    url : str or path
        A local path, ``file://``, ``memory://`` or any URL with an installed backend.
    tree : pytree
        Dicts (str or int keys), lists, tuples, None and registered JAX pytree nodes, with array,
        scalar, string, bytes, None and PRNG-key leaves.
    metadata : dict, optional
        JSON-serialisable user metadata, returned by :func:`quire.metadata` as ``custom``.
    overwrite : bool
        Replace a committed checkpoint at ``url`` (atomically; the old data is removed
        after the new record is in place).
    storage : StorageOptions or callable, optional
        Per-leaf cast, compression, chunking and checksums; a callable receives
        ``(key_path, leaf)`` and returns ``StorageOptions`` or None.
    storage_options : dict, optional
        fsspec options for the backend.
    layout : {"packed", "chunks"}, optional
        ``"packed"`` (format v2: a few pack objects per process plus a chunk index) or
        ``"chunks"`` (format v1: one object per zarr chunk, for tensorstore); default the
        ``layout`` option of :class:`quire.Context` (``"packed"``).

    Raises
    ------
    CheckpointExistsError
        A checkpoint exists at ``url`` and ``overwrite`` is False (or a concurrent writer
        committed first).
    UnsupportedLeafError
        A leaf has a type no handler saves (the message names its key path).
    """
    # The streaming path: no host copy of the tree, shards are read while writing.
    _start_save(
        url,
        {_engine.PYTREE: tree},
        metadata=metadata,
        overwrite=overwrite,
        storage=storage,
        copy=False,
        storage_options=storage_options,
        layout=layout,
    ).result()


def save_async(
    url: str | os.PathLike[str],
    tree: Any,
    *,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    storage: StorageSpec = None,
    storage_options: dict[str, Any] | None = None,
    layout: str | None = None,
) -> AsyncResponse[None]:
    """Like :func:`save`, but return once every owned shard is copied to host memory.

    The caller may then mutate or donate the arrays. A second save to the same URL
    while this one is in flight starts after it finishes.
    """
    return _start_save(
        url,
        {_engine.PYTREE: tree},
        metadata=metadata,
        overwrite=overwrite,
        storage=storage,
        copy=True,
        storage_options=storage_options,
        layout=layout,
    )


def save_checkpointables(
    url: str | os.PathLike[str],
    checkpointables: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    storage: StorageSpec = None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Save several named units (pytrees, JSON configs, checkpointable objects) in one commit.

    ``quire.save(url, tree)`` is ``save_checkpointables(url, {"pytree": tree})``.  See
    :mod:`quire.checkpointables` for what a unit may be.
    """
    from quire.checkpointables import as_mapping

    _start_save(
        url,
        as_mapping(checkpointables),
        metadata=metadata,
        overwrite=overwrite,
        storage=storage,
        copy=False,
        storage_options=storage_options,
    ).result()


def save_checkpointables_async(
    url: str | os.PathLike[str],
    checkpointables: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    storage: StorageSpec = None,
    storage_options: dict[str, Any] | None = None,
) -> AsyncResponse[None]:
    """:func:`save_checkpointables` in the background (blocks only for host copies)."""
    from quire.checkpointables import as_mapping

    return _start_save(
        url,
        as_mapping(checkpointables),
        metadata=metadata,
        overwrite=overwrite,
        storage=storage,
        copy=True,
        storage_options=storage_options,
    )


def load_checkpointables(
    url: str | os.PathLike[str],
    checkpointables: Mapping[str, Any] | None = None,
    *,
    partial: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load the named units (all of them when ``checkpointables`` is None).

    Each value of ``checkpointables`` is the unit's target: an abstract tree for a pytree
    unit (None: as saved), the object to restore into for a Checkpointable unit.
    """
    u = normalize(url)
    return _io.submit(
        _engine.load_units(u, checkpointables, partial=partial, storage_options=storage_options)
    ).result()


def load_async(
    url: str | os.PathLike[str],
    abstract: Any = None,
    *,
    partial: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> AsyncResponse[Any]:
    """Start :func:`load` in the background."""
    u = normalize(url)
    return AsyncResponse(
        _io.submit(_engine.load(u, abstract, partial=partial, storage_options=storage_options)),
        f"load {u}",
    )


def load(
    url: str | os.PathLike[str],
    abstract: Any = None,
    *,
    partial: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """Load the checkpoint at ``url``.

    Parameters
    ----------
    abstract : pytree, optional
        The target: its structure is used for the result and its leaves say what each
        leaf becomes — ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` a ``jax.Array``
        with that sharding, a numpy array a numpy array, a Python type or value that type;
        a different dtype casts.  Without it, containers come back as dicts/lists/tuples
        and arrays as they were saved.
    partial : bool
        Load only the keys present in ``abstract`` (default: strict, every key must match).

    Raises
    ------
    CheckpointNotFoundError
        No committed checkpoint at ``url``.
    TreeMismatchError
        ``abstract`` lacks saved keys, names keys the checkpoint lacks, or has other shapes;
        the message lists every such key path.
    CorruptCheckpointError
        A chunk fails its checksum or the commit record is malformed.
    """
    return load_async(url, abstract, partial=partial, storage_options=storage_options).result()


def metadata(
    url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> CheckpointMetadata:
    """Describe the checkpoint at ``url`` (reads only ``quire.json``)."""
    u = normalize(url)
    return _io.submit(_engine.metadata(u, storage_options)).result()
