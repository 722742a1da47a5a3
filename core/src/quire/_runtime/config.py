"""Global configuration and the (thread- and task-local) Context overrides.

``quire.configure(**options)`` sets the process-wide defaults; ``with quire.Context(**options):``
overrides them for a block.  The override lives in a :mod:`contextvars` variable, so it is
local to the thread and to the asyncio task that entered it, and quire's background work
(its event-loop thread and I/O pool, see ``_io``) runs in a copy of the caller's context:
what an API call sees is the configuration in effect *where it was called*, even when the
work finishes after the ``with`` block has exited (``save_async``).

Every option is documented once, on :class:`Config` (and in ``docs/configuration.md``).
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

__all__ = ["GROUPS", "Config", "Context", "configure", "current"]

# The plugin entry-point groups (quire._runtime.registry has one registry per group); here because
# the ``plugins=`` option names them, and configuration sits below the registries.
GROUPS = (
    "quire.backends",
    "quire.codecs",
    "quire.leaf_handlers",
    "quire.checkpointables",
    "quire.sources",
)


@dataclass(frozen=True)
class Config:
    """quire's options; every field can be set by ``quire.configure`` or ``quire.Context``.

    Attributes
    ----------
    byte_budget : int
        Host bytes a save may hold in flight for chunks it has to allocate (cast,
        compressed or copied from an accelerator) beyond the tree itself.  Default 256 MiB.
        A chunk larger than the budget is still written, alone.
    max_concurrency : int
        Chunk reads/writes (backend requests) in flight at once per save or load.
        Default 64.
    storage_options : dict
        Per-protocol fsspec options, e.g. ``{"s3": {"endpoint_url": ...}}``; the
        ``storage_options=`` argument of an API call is merged over the entry for its
        URL's protocol.
    plugins : dict
        Plugin choices when two distributions provide one entry-point name:
        ``{"quire.backends:s3": "quire-s3"}`` (``"group:name"`` -> distribution name or
        entry-point value).
    primary_process : int
        The process that writes metadata and commits in multi-process runs (default 0).
    checksum : bool
        Default for ``StorageOptions.checksum``: a crc32c on every chunk (default True).
    codecs : tuple
        Default compressors for array leaves that have no ``StorageOptions``: codec ids
        (``"zstd"``), ``{"name", "configuration"}`` dicts or zarr codecs.  Default none
        (raw bytes are fastest on local disks).
    timeout : float or None
        Seconds a multi-process barrier waits before the save is aborted (default 600;
        None waits forever).
    layout : str
        How array chunks are stored: ``"packed"`` (format version 2, the default: each
        process streams its chunks into a few pack objects plus one chunk index) or
        ``"chunks"`` (format version 1: one object per zarr chunk, for tensorstore).
    pack_bytes : int
        Largest pack object (format version 2).  Default 256 MiB: a host's 1 GB is 4 packs,
        far below S3's limits (5 GiB per PUT; 10,000 multipart parts), and a ranged GET
        stays cheap on stores that serve ranges in O(object size) (moto, some gateways).
        Backends with streamed writes (local disks, S3 multipart) stream chunks into the
        pack; others upload it with one ``put``, so there a pack is also sealed when the
        chunks waiting for it reach a quarter of ``byte_budget``: host memory stays bounded.
    leaf_handlers : tuple
        Leaf handlers in effect in addition to the installed ones (instances, or classes
        instantiated once); they take part in handler choice (most specific type first)
        and are found by id when loading.  Usually set through ``quire.Context``.
    verify_record : bool
        Whether a commit or journal record must carry a valid checksum (default True).
        A record without one is refused as corrupt; ``quire.Context(verify_record=False)``
        reads such a record (written by another tool, or repaired by hand) for the calls
        inside the block.  The record's structure is validated either way.
    progress : bool or callable
        Default of the ``progress=`` argument of save/load: False (silent, the default),
        True (a progress bar on stderr), or a callable receiving
        :class:`quire.progress.ProgressEvent` (e.g. to log to a training logger).
    replica_writes : bool
        Replica-parallel writes (default True): with several JAX processes, the chunks of a
        shard that several processes hold are written by pieces spread over those
        processes, and whole small arrays go to the least-loaded holder, so each byte is
        written once and every holder writes its share.  False: each shard is written by
        the process holding its ``replica_id == 0`` copy (one chunk per shard).
    replica_piece_bytes : int
        Smallest piece a replicated shard is split into for replica-parallel writes
        (default 1 MiB): a shard is split into at most as many pieces as it has holders,
        each at least this large (see ``docs/scaling.md`` for why 1 MiB).
    replica_reads : bool or None
        Shared reads on load: with several JAX processes, a stored chunk that several
        processes need (a replicated or resharded target) is read by one of them and
        exchanged with the others by a collective behind a barrier that waits at most
        ``timeout`` seconds.  False: every process reads all it needs from storage.  None
        (the default): shared reads for object stores (``s3://``, ``gs://``, ...), direct
        reads for local paths and ``memory://``, where reading is faster than the
        exchange (``docs/scaling.md``).
    replica_read_min_bytes : int
        Shared reads happen only when the chunks several processes need add up to at
        least this many bytes (default 16 MiB): below it, the barrier and the collective
        cost more than the reads they save (measured: ``docs/scaling.md``).
    pinned_staging : bool or None
        How ``save_async`` (and ``Checkpointer.save``) takes accelerator shards to the host:
        True starts a copy of every shard it writes into the device's ``pinned_host``
        memory (page-locked, so the DMA runs at the link's full speed, as Orbax does on
        GPU), then reads the bytes from there;
        False reads each shard with ``copy_to_host_async`` + ``numpy.asarray`` (pageable
        memory).  None (the default): True on GPU devices that have ``pinned_host``
        memory, False elsewhere (on CPU the shard's own buffer is read in place).
    """

    byte_budget: int = 256 * 1024 * 1024
    max_concurrency: int = 64
    storage_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    plugins: dict[str, str] = field(default_factory=dict)
    primary_process: int = 0
    checksum: bool = True
    codecs: tuple[Any, ...] = ()
    timeout: float | None = 600.0
    leaf_handlers: tuple[Any, ...] = ()
    verify_record: bool = True
    progress: Any = False
    layout: str = "packed"
    pack_bytes: int = 256 << 20
    replica_writes: bool = True
    replica_piece_bytes: int = 1 << 20
    replica_reads: bool | None = None
    replica_read_min_bytes: int = 16 << 20
    pinned_staging: bool | None = None


OPTIONS = tuple(f.name for f in dataclasses.fields(Config))

_lock = threading.Lock()
_global = Config()
_override: contextvars.ContextVar[Config | None] = contextvars.ContextVar(
    "quire_config", default=None
)


def current() -> Config:
    """The configuration in effect here: the innermost Context's, else the global one."""
    return _override.get() or _global


def _int(name: str, v: Any, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"quire option {name} must be an int >= {low}, got {v!r}")
    return v


def _instance(h: Any) -> Any:
    obj = h() if isinstance(h, type) else h
    if not isinstance(getattr(obj, "id", None), str) or not callable(getattr(obj, "handles", None)):
        raise TypeError(
            f"{h!r} is not a leaf handler: it needs a str `id` and a `handles` method "
            "(see quire.handlers.LeafHandler)"
        )
    return obj


def _validate(name: str, v: Any) -> Any:
    """The normalized value of option ``name``; ValueError/TypeError naming the fix."""
    if name == "byte_budget":
        return _int(name, v, 1)
    if name == "max_concurrency":
        return _int(name, v, 1)
    if name == "replica_read_min_bytes":
        return _int(name, v, 0)
    if name in ("pack_bytes", "replica_piece_bytes"):
        return _int(name, v, 1)
    if name == "layout":
        if v not in ("packed", "chunks"):
            raise ValueError(f'quire option layout must be "packed" or "chunks", got {v!r}')
        return v
    if name == "primary_process":
        return _int(name, v, 0)
    if name in ("replica_reads", "pinned_staging") and v is None:
        return None
    if name in ("checksum", "verify_record", "replica_writes", "replica_reads", "pinned_staging"):
        if not isinstance(v, bool):
            raise TypeError(f"quire option {name} must be a bool, got {v!r}")
        return v
    if name == "timeout":
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
            raise ValueError(f"quire option timeout must be a positive number or None, got {v!r}")
        return float(v)
    if name == "storage_options":
        if not isinstance(v, Mapping) or not all(
            isinstance(k, str) and isinstance(o, Mapping) for k, o in v.items()
        ):
            raise TypeError(
                "quire option storage_options must map a URL protocol to a dict of fsspec "
                f'options, e.g. {{"s3": {{"anon": True}}}}; got {v!r}'
            )
        return {k: dict(o) for k, o in v.items()}
    if name == "plugins":
        if not isinstance(v, Mapping):
            raise TypeError(f"quire option plugins must be a dict, got {v!r}")
        for k, d in v.items():
            group = k.rpartition(":")[0] if isinstance(k, str) else None
            if group not in GROUPS or not isinstance(d, str):
                raise ValueError(
                    f"quire option plugins: {k!r}: {d!r} must be '<group>:<name>': "
                    f"'<distribution>', with group one of {', '.join(GROUPS)}"
                )
        return dict(v)
    if name == "codecs":
        if isinstance(v, str | dict) or not isinstance(v, Sequence):
            v = (v,)
        return tuple(v)
    if name == "progress":
        if not (isinstance(v, bool) or callable(v)):
            raise TypeError(
                f"quire option progress must be a bool or a callable taking a "
                f"quire.progress.ProgressEvent, got {v!r}"
            )
        return v
    if name == "leaf_handlers":
        if not isinstance(v, Sequence) or isinstance(v, str):
            v = (v,)
        return tuple(_instance(h) for h in v)
    raise TypeError(  # pragma: no cover - names are checked before
        f"unknown quire option {name!r}"
    )


def _check_names(options: Mapping[str, Any]) -> None:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(
            f"unknown quire option(s) {', '.join(map(repr, unknown))}; "
            f"the options are {', '.join(OPTIONS)} (see quire.Config)"
        )


def configure(config: Config | None = None, /, **options: Any) -> Config:
    """Set quire's global defaults; returns the new global :class:`Config`.

    Parameters
    ----------
    config : Config, optional
        Replace every option at once (``quire.configure(quire.Config())`` restores the
        defaults); ``options`` then apply on top of it.
    **options
        Any field of :class:`Config`; each replaces the global value.

    Raises
    ------
    TypeError, ValueError
        An unknown option name, or a value of the wrong type.
    """
    global _global
    _check_names(options)
    clean = {k: _validate(k, v) for k, v in options.items()}
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"quire.configure takes a quire.Config, got {type(config).__name__}")
    with _lock:
        _global = dataclasses.replace(config if config is not None else _global, **clean)
        return _global


def _merged(base: Config, clean: Mapping[str, Any]) -> Config:
    """``base`` overridden by ``clean``: dicts merge key by key, handlers go in front."""
    upd = dict(clean)
    if "storage_options" in upd:
        so = {k: dict(v) for k, v in base.storage_options.items()}
        for proto, opts in upd["storage_options"].items():
            so[proto] = {**so.get(proto, {}), **opts}
        upd["storage_options"] = so
    if "plugins" in upd:
        upd["plugins"] = {**base.plugins, **upd["plugins"]}
    if "leaf_handlers" in upd:
        upd["leaf_handlers"] = (*upd["leaf_handlers"], *base.leaf_handlers)
    return dataclasses.replace(base, **upd)


class Context:
    """Override quire's options for a block of code::

        with quire.Context(byte_budget=64 << 20, storage_options={"s3": {"anon": True}}):
            quire.save(url, tree)

    The override is local to the thread and to the asyncio task that enters it, and
    follows the work an API call starts in quire's background threads (a ``save_async``
    started inside the block keeps the block's options after it exits).  Contexts nest;
    dict options (``storage_options``, ``plugins``) merge over the enclosing values key
    by key, ``leaf_handlers`` go in front of the enclosing ones, other options replace
    them.  ``with`` returns the effective :class:`Config`.

    Parameters
    ----------
    **options
        Any field of :class:`Config`.

    Raises
    ------
    TypeError, ValueError
        An unknown option name, or a value of the wrong type (at construction).
    """

    def __init__(self, **options: Any) -> None:
        _check_names(options)
        self.options: dict[str, Any] = {k: _validate(k, v) for k, v in options.items()}
        self._tokens: list[contextvars.Token[Config | None]] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"quire.Context({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"

    def __enter__(self) -> Config:
        cfg = _merged(current(), self.options)
        token = _override.set(cfg)
        with self._lock:
            self._tokens.append(token)
        return cfg

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # One Context object may be entered by several threads/tasks at once: reset the
        # newest token that belongs to the context we are running in.
        with self._lock:
            tokens = list(reversed(self._tokens))
        for token in tokens:
            try:
                _override.reset(token)
            except (ValueError, RuntimeError):  # another thread's/task's, or already used
                continue
            with self._lock:
                self._tokens.remove(token)
            return
        raise RuntimeError("quire.Context exited in a different thread or task than it entered")


def _set_override(cfg: Config | None) -> contextvars.Token[Config | None]:
    return _override.set(cfg)


def _reset_override(token: contextvars.Token[Config | None]) -> None:
    _override.reset(token)
