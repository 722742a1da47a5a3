"""The public free functions: save / load / metadata, blocking and async."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypedDict, Unpack

from quire._engine import load as _load
from quire._engine import metadata as _metadata
from quire._engine import save as _saving
from quire._engine.incremental import Incremental
from quire._format import record as _records
from quire._handlers.units import as_mapping
from quire._runtime import ioloop as _io
from quire._runtime import progress as _progress
from quire._runtime.registry import sources
from quire._runtime.responses import AsyncResponse, chain
from quire._sources.materialize import load_and_transform
from quire._store.url import effective_options, normalize
from quire.errors import CheckpointNotFoundError
from quire.metadata import CheckpointMetadata
from quire.options import CastingSpec, StorageSpec


class SaveOptions(TypedDict, total=False):
    """The keyword options every save function takes (each is described under
    :func:`quire.save`); one definition, so the four save functions cannot drift apart."""

    metadata: Mapping[str, Any] | None
    overwrite: bool
    storage: StorageSpec
    storage_options: dict[str, Any] | None
    progress: Any
    layout: str | None


def _start_save(
    fn: str,
    url: str | os.PathLike[str],
    units: Mapping[str, Any],
    copy: bool,
    options: SaveOptions,
    stats: dict[str, Any] | None = None,
    incremental: Incremental | None = None,
    scope: _saving.SaveScope | None = None,
) -> AsyncResponse[None]:
    """The one save path; ``copy``: snapshot to host first (async) or stream (blocking);
    ``stats`` receives the engine's counters (tests read the byte budget's peak);
    ``incremental``: a Checkpointer's incremental state (``quire._engine.incremental``);
    ``scope``: every process saves its own checkpoint (``quire._engine.save.SaveScope``)."""
    unknown = sorted(set(options) - set(SaveOptions.__annotations__))
    if unknown:
        raise TypeError(f"{fn}() got an unexpected keyword argument {unknown[0]!r}")
    u = normalize(url)
    progress = options.get("progress")
    rep = _progress.make(progress, "save", u)
    if rep is not None:
        rep.add_total(_tree_nbytes(units))
    prep = _saving.prepare_save(
        units,
        options.get("storage"),
        copy=copy,
        url=u,
        layout=options.get("layout"),
        incremental=incremental,
        coordination=None if scope is None else scope.name,
    )
    writer = scope.write if scope is not None and prep.coord.active else _saving.save_prepared

    def write() -> Awaitable[None]:
        return _progress.tracked(
            rep,
            lambda: writer(
                u,
                prep,
                metadata=options.get("metadata"),
                overwrite=options.get("overwrite", False),
                storage_options=options.get("storage_options"),
                stats=stats,
            ),
            close=rep is not progress,
        )

    # An async save has returned: its write runs beside the caller's training steps.
    return chain(u, (lambda: _io.in_background(write())) if copy else write, f"save {u}")


def save_units_async(
    url: str,
    units: Mapping[str, Any],
    *,
    incremental: Incremental | None,
    scope: _saving.SaveScope | None = None,
    **options: Unpack[SaveOptions],
) -> AsyncResponse[None]:
    """``save_checkpointables_async`` for a Checkpointer: ``units`` as they are (a tree is
    ``{"pytree": tree}``), with its incremental state (None: a plain save) and, when every
    process saves a checkpoint of its own, their :class:`~quire._engine.save.SaveScope`."""
    return _start_save(
        "save_async", url, units, True, options, incremental=incremental, scope=scope
    )


def _tree_nbytes(node: Any) -> int:
    """Array bytes in a tree (the total a save's progress counts towards)."""
    if isinstance(node, Mapping):
        return sum(_tree_nbytes(v) for v in node.values())
    if isinstance(node, list | tuple):
        return sum(_tree_nbytes(v) for v in node)
    if hasattr(node, "shape") and hasattr(node, "dtype"):
        return int(getattr(node, "nbytes", 0) or 0)
    try:  # other pytree nodes (dataclasses, flax structs): their children
        import jax

        children = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)[0]
    except Exception:  # broad: a progress total only; the save reports a bad node itself
        return 0
    return 0 if children == [node] else sum(_tree_nbytes(c) for c in children)


def save(url: str | os.PathLike[str], tree: Any, **options: Unpack[SaveOptions]) -> None:
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
    overwrite : bool, default False
        Replace a committed checkpoint at ``url`` (atomically; the old data is removed
        after the new record is in place).
    storage : StorageOptions or callable, optional
        Per-leaf cast, compression, chunking and checksums; a callable receives
        ``(key_path, leaf)`` and returns ``StorageOptions`` or None.
    storage_options : dict, optional
        fsspec options for the backend.
    progress : bool or callable, optional
        Show a progress bar (True), call ``progress(event)`` with a
        :class:`quire.progress.ProgressEvent`, or pass a :class:`quire.progress.Progress`.
        Default: the ``progress`` option of :class:`quire.Config` (off).
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
    MultiProcessError
        With several JAX processes: another process failed or disagreed; nothing was
        committed.
    """
    # The streaming path: no host copy of the tree, shards are read while writing.
    _start_save("save", url, {_records.PYTREE: tree}, False, options).result()


def save_async(
    url: str | os.PathLike[str], tree: Any, **options: Unpack[SaveOptions]
) -> AsyncResponse[None]:
    """Like :func:`save`, but return once every owned shard's bytes are safe from the caller.

    The caller may then mutate numpy leaves, and donate or delete ``jax.Array`` leaves: the
    checkpoint holds the values at the call.  Numpy leaves are copied (into host buffers
    reused across saves); a ``jax.Array`` shard is its device-to-host transfer, and on a CPU
    device no copy at all: quire reads the device buffer in place through a numpy view,
    which keeps XLA from reusing it until the write is done (a jitted step that donates it
    meanwhile writes its output into a new buffer instead).  A second save to the same URL
    while this one is in flight starts after it finishes.

    Parameters
    ----------
    url, tree, metadata, overwrite, storage, storage_options, progress, layout
        As for :func:`save`.

    Returns
    -------
    AsyncResponse
        ``.result()`` waits for the commit and raises what :func:`save` would.

    Raises
    ------
    UnsupportedLeafError
        A leaf has a type no installed leaf handler saves (raised at once).
    """
    return _start_save("save_async", url, {_records.PYTREE: tree}, True, options)


def save_checkpointables(
    url: str | os.PathLike[str],
    checkpointables: Mapping[str, Any],
    **options: Unpack[SaveOptions],
) -> None:
    """Save several named units (pytrees, JSON configs, checkpointable objects) in one commit.

    ``quire.save(url, tree)`` is ``save_checkpointables(url, {"pytree": tree})``.  See
    :mod:`quire.checkpointables` for what a unit may be.

    Parameters
    ----------
    url : str or os.PathLike
        Where to save: a local path or any fsspec URL with an installed backend.
    checkpointables : mapping of str to unit
        Unit name -> pytree, JSON value or checkpointable object.
    metadata, overwrite, storage, storage_options, progress, layout
        As for :func:`save`.

    Raises
    ------
    CheckpointExistsError, UnsupportedLeafError, MultiProcessError
        As for :func:`save` (a unit, too, may have a type no installed handler saves).
    """
    _start_save("save_checkpointables", url, as_mapping(checkpointables), False, options).result()


def save_checkpointables_async(
    url: str | os.PathLike[str],
    checkpointables: Mapping[str, Any],
    **options: Unpack[SaveOptions],
) -> AsyncResponse[None]:
    """:func:`save_checkpointables` in the background: returns once every unit's state at
    the call is safe from the caller (host copies of arrays, a snapshot of each other unit).

    Parameters
    ----------
    url, checkpointables, metadata, overwrite, storage, storage_options, progress, layout
        As for :func:`save_checkpointables`.

    Returns
    -------
    AsyncResponse
        ``.result()`` waits for the commit and raises what
        :func:`save_checkpointables` would.

    Raises
    ------
    SnapshotError
        A checkpointable unit's state could not be captured at the call (its snapshot step
        failed, or it has none and writing it at the call failed; see
        :mod:`quire.checkpointables`).  Raised at once; nothing is saved.
    UnsupportedLeafError
        A leaf has a type no installed leaf handler saves (raised at once).
    """
    return _start_save(
        "save_checkpointables_async", url, as_mapping(checkpointables), True, options
    )


def load_checkpointables(
    url: str | os.PathLike[str],
    checkpointables: Mapping[str, Any] | None = None,
    *,
    partial: bool = False,
    storage_options: dict[str, Any] | None = None,
    casting: CastingSpec = None,
) -> dict[str, Any]:
    """Load the named units (all of them when ``checkpointables`` is None).

    Parameters
    ----------
    url : str or os.PathLike
        The checkpoint.
    checkpointables : mapping of str to target, optional
        Each value is the unit's target: an abstract tree for a pytree unit (None: as
        saved), the object to restore into for a Checkpointable unit.
    partial, casting
        For pytree units: load only the keys present in the target; the casts to the
        targets' dtypes allowed (see :func:`load`).
    storage_options : dict, optional
        fsspec ``storage_options`` for the backend.

    Returns
    -------
    dict
        Unit name -> loaded value, in the order asked for.

    Raises
    ------
    CheckpointNotFoundError
        No committed checkpoint at ``url``.
    TreeMismatchError
        A unit asked for is not in the checkpoint, or a target does not match.
    LossyCastError
        A target asks for a cast that ``casting`` refuses (see :func:`load`).
    PluginError
        A unit needs a handler that is not installed or fails to load.
    """
    return load_checkpointables_async(
        url, checkpointables, partial=partial, storage_options=storage_options, casting=casting
    ).result()


def load_checkpointables_async(
    url: str | os.PathLike[str],
    checkpointables: Mapping[str, Any] | None = None,
    *,
    partial: bool = False,
    storage_options: dict[str, Any] | None = None,
    casting: CastingSpec = None,
) -> AsyncResponse[dict[str, Any]]:
    """Start :func:`load_checkpointables` in the background.

    Parameters
    ----------
    url, checkpointables, partial, storage_options, casting
        As for :func:`load_checkpointables`.

    Returns
    -------
    AsyncResponse
        ``.result()`` returns the units (name -> loaded value) and raises what
        :func:`load_checkpointables` would.
    """
    u = normalize(url)
    return AsyncResponse(
        _io.submit(
            _load.load_units(
                u,
                checkpointables,
                partial=partial,
                storage_options=storage_options,
                casting=casting,
            )
        ),
        f"load {u}",
    )


def load_async(
    url: str | os.PathLike[str],
    abstract: Any = None,
    *,
    partial: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: Any = None,
    casting: CastingSpec = None,
) -> AsyncResponse[Any]:
    """Start :func:`load` in the background.

    Parameters
    ----------
    url : str or os.PathLike
        The checkpoint.
    abstract : pytree, optional
        The target, as for :func:`load`.
    partial : bool
        Load only the keys present in ``abstract``.
    storage_options : dict, optional
        fsspec ``storage_options`` for the backend.
    casting : str or callable, optional
        The casts to ``abstract``'s dtypes allowed, as for :func:`load`.

    Returns
    -------
    AsyncResponse
        ``.result()`` returns the tree and raises what :func:`load` would.
    """
    u = normalize(url)
    rep = _progress.make(progress, "load", u)

    async def run() -> Any:
        if rep is not None and rep.bytes_total is None:
            try:
                from quire._format import describe as _describe

                m = await _metadata.metadata(u, storage_options)
                rep.add_total(_describe.array_bytes(m.tree))
            except Exception:  # broad: a progress total only; the load reports what is wrong
                pass
        return await _load.load(
            u, abstract, partial=partial, storage_options=storage_options, casting=casting
        )

    return AsyncResponse(
        _io.submit(_progress.tracked(rep, run, close=rep is not progress)),
        f"load {u}",
    )


def load(
    url: Any,
    abstract: Any = None,
    *,
    partial: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: Any = None,
    transform: Callable[..., Any] | None = None,
    shardings: Any = None,
    casting: CastingSpec = None,
) -> Any:
    """Load the checkpoint at ``url``.

    Parameters
    ----------
    url : str, path, quire.sources.Source, or a sequence / dict of them
        A quire checkpoint, or any checkpoint an installed source reads (safetensors, an HF
        directory, Orbax with quire-orbax): see :func:`quire.open`.  Several sources (a
        sequence, or a dict name -> URL) are opened lazily and handed to ``transform``:
        positionally for a sequence, as keywords for a dict (``docs/surgery.md``).
    transform : callable, optional
        Model surgery: gets each source's lazy tree and returns the tree to load; only what
        it returns is read.  Omitted: a list of trees for a sequence, a dict for a dict.
    shardings : tree of shardings or quire.surgery.partition_rules(...), optional
        Shardings for leaves whose abstract leaf carries none (or with no ``abstract``).
    abstract : pytree, optional
        The target: its structure is used for the result and its leaves say what each
        leaf becomes — ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` a ``jax.Array``
        with that sharding, a numpy array a numpy array, a type or value that type (a str or
        bytes only its own); a different dtype casts (see ``casting``).  Empty nodes (None,
        ``()``, ``{}``, optax's ``EmptyState()``, any pytree node with no leaves) match each
        other.  Without it, containers come back as dicts/lists/tuples and arrays as saved.
    partial : bool
        Load only the keys present in ``abstract`` (default: strict, every key must match).
    progress : bool or callable, optional
        As for :func:`save`: a bar (True), a callback, or a :class:`quire.progress.Progress`.
    casting : str or callable, optional
        The casts to ``abstract``'s dtypes allowed, in numpy's terms: ``"same_kind"`` (the
        default: float32 -> bfloat16 or int32 -> int64, and int64 -> int32 if every value
        fits), ``"no"``, ``"equiv"``, ``"safe"`` or ``"unsafe"`` (float -> int, wrapping ints
        ...); a callable ``(key_path, target_leaf) -> casting or None`` chooses per leaf.

    Raises
    ------
    CheckpointNotFoundError
        No committed checkpoint at ``url``.
    TreeMismatchError
        ``abstract`` lacks saved keys, names keys the checkpoint lacks, or has other shapes;
        the message lists every such key path.
    LossyCastError
        ``abstract`` asks for lossy casts ``casting`` refuses (listed with both dtypes).
    CorruptCheckpointError
        A chunk fails its checksum or the commit record is malformed.
    """
    kw: dict[str, Any] = {"partial": partial, "storage_options": storage_options}
    kw["casting"] = casting
    if transform is None and shardings is None and isinstance(url, str | os.PathLike):
        try:
            return load_async(url, abstract, progress=progress, **kw).result()
        except (CheckpointNotFoundError, NotADirectoryError):
            from quire._sources.opening import available

            if available() == ["quire"] or not _other_source(url, storage_options):
                raise

    return load_and_transform(url, abstract, transform, shardings=shardings, **kw)


def _other_source(url: Any, storage_options: dict[str, Any] | None) -> bool:
    """Whether a source other than quire's own recognises ``url`` (after a failed load)."""

    u = normalize(url)
    opts = effective_options(u, storage_options)
    for name in sources.names():
        if name == "quire":
            continue
        try:
            if sources.get(name).detect(u, dict(opts)):
                return True
        except Exception:  # broad: a message after a failed load; a failing detect: "not mine"
            continue
    return False


def metadata(
    url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> CheckpointMetadata:
    """Describe the checkpoint at ``url`` (reads only ``quire.json``).

    Parameters
    ----------
    url : str or os.PathLike
        The checkpoint.
    storage_options : dict, optional
        fsspec ``storage_options`` for the backend.

    Returns
    -------
    CheckpointMetadata
        The tree of leaf metadata (shapes, dtypes, ...), user metadata, creation time,
        txids and units, and the raw record.

    Raises
    ------
    CheckpointNotFoundError
        No committed checkpoint at ``url``.
    CorruptCheckpointError
        The commit record is malformed, fails its checksum or points outside ``d/``.
    PluginError
        A leaf needs a handler that is not installed or fails to load.
    """
    u = normalize(url)
    return _io.submit(_metadata.metadata(u, storage_options)).result()
