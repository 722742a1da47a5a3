"""``quire.Checkpointer``: a sequence of step checkpoints under one root, for training loops.

Layout and garbage rules: see ``quire._engine.garbage``.  Threads and ordering:

* ``save`` runs the device-to-host copy in the caller's thread (``quire.save_async``),
  then the write and the commit on quire's event loop.  One save is in flight at a time:
  the next ``save`` (and ``load``) waits for it first.
* After each commit, the keep policy runs as a background task; these tasks run one
  after another, never two at once.  The automatic garbage collection runs once, as part
  of the first save (so no later save of this Checkpointer can race with it).
* A background failure is kept and raised by the next public call, by ``wait`` or
  ``close``, or when the ``with`` block exits — never dropped.  Checkpointers still open
  when the interpreter exits are closed then (errors are logged), before quire's I/O
  threads stop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import concurrent.futures.thread  # registers its exit hook before ours (see below)
import json
import logging
import threading
import time
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from quire import _api
from quire._checkpointer.deciding import _DecideMixin
from quire._checkpointer.keep_policies import KeepPolicy, StepInfo
from quire._checkpointer.retain import (
    _as_step,
    _await_response,
    _clean_metrics,
    _RetainLoadMixin,
)
from quire._checkpointer.save_policies import SavePolicy
from quire._checkpointer.tasks import _BackgroundTasks
from quire._checkpointer.tiers import LocalTier, _Tier, _TierMixin
from quire._engine import garbage as _gc
from quire._engine import incremental as _inc
from quire._format import root as _root
from quire._format.record import PYTREE
from quire._handlers.units import as_mapping
from quire._runtime import exithook as _exit
from quire._runtime.config import current
from quire._store.url import normalize, open_backend

if TYPE_CHECKING:
    import os
    import types


__all__ = ["Checkpointer"]

log = logging.getLogger("quire")

_open_checkpointers: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def _close_at_exit() -> None:
    for c in list(_open_checkpointers):
        try:
            c.close()
        except BaseException as e:
            log.error("quire.Checkpointer(%r): background work failed at exit: %r", c.root, e)


# quire's one exit hook (``_exit``) closes every open Checkpointer first, then waits for
# the other in-flight writes.
_exit.add_closer(_close_at_exit)


class Checkpointer(_DecideMixin, _TierMixin, _RetainLoadMixin, _BackgroundTasks):
    """Numbered checkpoints of a training run under one root URL.

    Each step is an ordinary quire checkpoint at ``<root>/<step_format.format(step)>``
    (readable with ``quire.load``); a step exists iff its ``quire.json`` does.  The root
    also holds ``checkpointer.json`` (the step format and the run's ``metadata``), created
    by the first save.  Use it as a context manager: leaving the block waits for the
    background work and raises its errors::

        with quire.Checkpointer(root, save_policy=EveryNSteps(100), keep=LatestN(3)) as ckpt:
            start = ckpt.latest_step()  # None: nothing committed yet
            if start is None:
                state, start = init_state(), 0
            else:
                state = ckpt.load(start, jax.eval_shape(init_state))
            for step in range(start + 1, num_steps + 1):
                state, loss = train_step(state, step)
                ckpt.save(step, state, metrics={"loss": loss})   # saves when the policy says so

    Parameters
    ----------
    root_url : str or path
        Where the steps live (a local path, ``memory://...``, ``s3://...``).
    save_policy : quire.policies.SavePolicy, optional
        When :meth:`save` actually saves (default: at every call with a new step).
    keep : quire.policies.KeepPolicy, optional
        Which committed steps survive (default: all).  The latest committed step and
        steps being loaded are never deleted.
    step_format : str, optional
        Directory name of a step, a ``str.format`` pattern with one int field; default
        the root's recorded one, else ``"step_{:08d}"``.  Names that do not parse back to
        a step are ignored.
    storage_options : dict, optional
        fsspec options for the backend.
    metadata : dict, optional
        JSON metadata about the run, stored once in ``checkpointer.json`` (the first
        writer's is kept) and returned by ``metadata()``.
    gc_grace_period : float or None
        After its first commit, the Checkpointer removes (in the background, on the
        primary process) uncommitted steps and superseded data older than this many
        seconds; None turns that off (``quire gc ROOT`` still works).
    incremental : bool
        Write only what changed since this process's previous step: a leaf that is the
        same ``jax.Array`` object as last time is not copied, encoded or written, and an
        encoded chunk whose xxh3-128 equals the previous step's is not written; the step's
        chunk index points at the earlier bytes instead (format v2 only).  Deleting a
        step then removes its record, and its bytes only once no retained step, journal or
        in-flight save uses them (a mark-and-sweep gc; see docs/checkpointer.md).
    compact_below : float
        Incremental only: a save does not borrow from an earlier pack when what it would
        borrow is less than this fraction of the pack's bytes; it writes those chunks
        again, into a pack of its own, so the mostly-dead pack goes once the steps that
        use it are deleted (0: always borrow; stored bytes stay below about
        ``1 / compact_below`` times the live ones, docs/format.md).
    local : quire.LocalTier, optional
        A fast per-process tier saved whenever either tier's policy says so; ``root_url`` is
        then the persistent tier, written from the local tier's bytes (see ``docs/tiers.md``);
        with ``incremental``, a promotion uploads only what the persistent tier lacks.

    Raises
    ------
    ValueError
        ``step_format`` is invalid or differs from the one the root was written with.
    CorruptCheckpointError
        The root record is malformed.
    """

    def __init__(
        self,
        root_url: str | os.PathLike[str],
        *,
        save_policy: SavePolicy | None = None,
        keep: KeepPolicy | None = None,
        step_format: str | None = None,
        storage_options: dict[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        gc_grace_period: float | None = _gc.DEFAULT_GRACE_PERIOD,
        incremental: bool = False,
        compact_below: float = _inc.COMPACT_BELOW,
        local: LocalTier | None = None,
    ) -> None:
        if local is not None and not isinstance(local, LocalTier):
            raise TypeError(f"local must be a quire.LocalTier, got {local!r}")
        if save_policy is not None and not isinstance(save_policy, SavePolicy):
            raise TypeError(f"save_policy must be a quire.policies.SavePolicy, got {save_policy!r}")
        if keep is not None and not isinstance(keep, KeepPolicy):
            raise TypeError(f"keep must be a quire.policies.KeepPolicy, got {keep!r}")
        if gc_grace_period is not None and not gc_grace_period >= 0:
            raise ValueError(f"gc_grace_period must be >= 0 seconds or None, got {gc_grace_period}")
        self.root = normalize(root_url)
        self._storage_options = dict(storage_options) if storage_options else None
        self._backend = open_backend(self.root, self._storage_options)
        self._save_policy = save_policy
        self._keep = keep
        self._gc_grace = gc_grace_period
        self._metadata = dict(metadata or {})
        try:
            json.dumps(self._metadata, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"Checkpointer metadata must be JSON-serialisable: {e}") from e

        import jax

        self._primary = jax.process_index() == current().primary_process
        self._lock = threading.RLock()
        self._committed: dict[int, StepInfo | None] = {}  # None: record not read yet
        self._deleting: set[int] = set()
        self._pins: collections.Counter[int] = collections.Counter()
        self._deferred = False  # a deletion waits for a load to end
        self._inflight_step: int | None = None
        self._save_fut: concurrent.futures.Future[Any] | None = None
        self._tail: concurrent.futures.Future[Any] | None = None  # last background task
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._errors: list[BaseException] = []
        self._gc_done = False
        self._closed = False
        self._inc = _inc.Incremental(self.root, compact_below) if incremental else None
        # A multi-process local tier's root (set by quire._checkpointer.tiers): every process
        # saves into its own root, coordinated under this name.
        self._spread: str | None = None
        self._spread_seq = 0

        doc = self._run(_root.read_root_record(self._backend, self.root))
        if doc is not None and step_format is not None and doc["step_format"] != step_format:
            raise ValueError(
                f"{self.root} was written with step_format {doc['step_format']!r}, not "
                f"{step_format!r}; pass step_format={doc['step_format']!r} or leave it out"
            )
        if doc is not None and metadata is not None and doc.get("metadata") != self._metadata:
            log.warning(
                "%s: keeping the run metadata recorded by the first writer; the metadata "
                "passed to this Checkpointer differs and is not stored",
                self.root,
            )
        self._root_doc = doc
        self._fmt = _root.StepFormat(
            step_format or (doc["step_format"] if doc else _root.DEFAULT_STEP_FORMAT)
        )
        self._relist()
        self._last_saved_step: int | None = self._latest()
        self._last_save_time = time.monotonic()
        self._tier = None if local is None else _Tier(self, local, Checkpointer, gc_grace_period)
        if self._tier is not None:  # closed by this one, after the promotions that read it
            _open_checkpointers.discard(self._tier.inner)
        if save_policy is not None:
            save_policy.attach()
        _open_checkpointers.add(self)

    # ------------------------------------------------------------------ plumbing
    def _url(self, step: int) -> str:
        return f"{self.root}/{self._fmt.name(step)}"

    def _latest(self) -> int | None:
        with self._lock:
            live = [s for s in self._committed if s not in self._deleting]
            return max(live) if live else None

    def _relist(self) -> None:
        found = set(self._run(_root.committed_steps(self._backend, self._fmt)))
        with self._lock:
            self._committed = {s: self._committed.get(s) for s in sorted(found)}

    async def _load_infos(self) -> None:
        with self._lock:
            todo = [s for s, info in self._committed.items() if info is None]

        async def one(step: int) -> None:
            doc = await _gc.read_step_record(self._backend, self.root, self._fmt.name(step))
            with self._lock:
                if doc is None:  # deleted by someone else
                    self._committed.pop(step, None)
                elif step in self._committed:
                    self._committed[step] = StepInfo(
                        step, doc["_created"].timestamp(), _root.record_metrics(doc)
                    )

        await asyncio.gather(*(one(s) for s in todo))

    # ------------------------------------------------------------------ saving
    def save(
        self,
        step: int,
        tree: Any,
        *,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Save ``tree`` as ``step`` if the save policy says so; return whether it saves.

        Returns once the device-to-host copy is done; writing and committing go on in the
        background (see :meth:`wait`).  If a save is still in flight, waits for it first
        and raises its error, if any.

        Parameters
        ----------
        step : int
            The step number (non-negative).
        tree : pytree
            What ``quire.save`` accepts.
        metrics : dict, optional
            Numbers describing this step (e.g. ``{"val_loss": 0.31}``), stored in the step's
            metadata under ``"quire.metrics"`` and used by ``BestN``.
        metadata : dict, optional
            Other JSON metadata of this step (``quire.metadata(url).custom``).
        force : bool
            Save whatever the policy says, replacing a committed step of that number.

        Raises
        ------
        UnsupportedLeafError
            A leaf cannot be saved (raised at once).
        Exception
            The error of an earlier background save or deletion.
        """
        return self._save(step, {PYTREE: tree}, metrics, metadata, force, single=True)

    def save_checkpointables(
        self,
        step: int,
        checkpointables: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Like :meth:`save`, with several named units (see ``quire.save_checkpointables``).

        Parameters
        ----------
        step : int
            The step number (non-negative).
        checkpointables : mapping of str to unit
            Unit name -> pytree, JSON value or checkpointable object.
        metrics, metadata, force
            As for :meth:`save`.

        Returns
        -------
        bool
            Whether it saves.

        Raises
        ------
        SnapshotError
            A unit's state could not be captured at the call (see
            :mod:`quire.checkpointables`); nothing is saved.
        """
        return self._save(step, checkpointables, metrics, metadata, force, single=False)

    def _save(
        self,
        step: Any,
        units: Mapping[str, Any],
        metrics: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
        force: bool,
        *,
        single: bool,
    ) -> bool:
        if self._closed:
            raise ValueError(f"quire.Checkpointer({self.root!r}) is closed")
        self._raise_background()
        step = _as_step(step)
        if self._tier is not None:
            return self._tier.save(step, units, metrics, metadata, force, single)
        if not force and not self._decide(step):
            log.debug(
                "%s: not saving step %d (save policy, or not after the last save)", self.root, step
            )
            return False
        user = dict(metadata or {})
        if _root.METRICS_KEY in user:
            raise ValueError(
                f"metadata key {_root.METRICS_KEY!r} is reserved; pass metrics=... instead"
            )
        clean = _clean_metrics(metrics, step)
        if metrics is not None:
            user[_root.METRICS_KEY] = clean
        self._wait_save()  # at most one save in flight
        with self._lock:
            being_deleted = step in self._deleting
        if being_deleted:
            self._drain()
            self._raise_background()
        self._ensure_root_record()
        url = self._url(step)
        if self._inc is not None and not self._inc.started:
            latest = self._latest()  # an earlier run's last step: borrow its bytes
            self._run(
                self._inc.start(self._backend, None if latest is None else self._fmt.name(latest))
            )
        spread = None
        if self._spread is not None:
            self._spread_seq += 1
            spread = f"{self._spread}/{step}/{self._spread_seq}"
        resp = _api.save_units_async(
            url,
            units if single else as_mapping(units),
            self._inc,
            spread,
            metadata=user,
            overwrite=force,
            storage_options=self._storage_options,
        )
        with self._lock:
            self._inflight_step = step
            self._last_saved_step = step
            self._last_save_time = time.monotonic()
            self._save_fut = self._spawn(self._finish_save(resp, step, clean, url))
        return True

    async def _finish_save(
        self, resp: _api.AsyncResponse[Any], step: int, metrics: dict[str, Any], url: str
    ) -> None:
        try:
            await _await_response(resp)
        except BaseException as e:
            if self._inc is not None:
                self._inc.failed()
                await self._inc.release(self._backend)
            with self._lock:
                self._inflight_step = None
            e.add_note(f"(background save of step {step} to {url})")
            raise
        if self._inc is not None:
            self._inc.committed()
            await self._inc.release(self._backend)
        await self._after_commit(step, metrics)

    def _ensure_root_record(self) -> None:
        self._run(self._create_root_record())

    async def _create_root_record(self) -> None:
        if self._primary and self._root_doc is None:
            await _gc.create_root_record(self._backend, self._fmt.pattern, self._metadata)
            self._root_doc = await _root.read_root_record(self._backend, self.root)

    async def _after_commit(self, step: int, metrics: dict[str, Any]) -> None:
        """The step is committed (durably): count it, collect garbage once, run retention."""
        with self._lock:
            self._committed[step] = StepInfo(step, time.time(), metrics)
            self._inflight_step = None
            run_gc = self._primary and self._gc_grace is not None and not self._gc_done
            self._gc_done = True
        if run_gc:
            # Inside the save: the next save waits for it, so GC never races our own writes.
            try:
                await self._auto_gc()
            except Exception as e:  # the save did commit; GC can run again later
                log.warning("%s: automatic garbage collection failed: %r", self.root, e)
        if self._keep is not None:
            self._schedule(self._retain)

    def wait(self) -> None:
        """Wait for the save in flight and background deletions; raise their errors.

        With a local tier: its saves and deletions too, then the promotions.
        """
        try:
            if self._tier is not None:
                self._tier.inner.wait()
        finally:
            self._drain()
            self._raise_background()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Wait for background work, raise its errors, and release the save policy."""
        if self._closed:
            self._raise_background()
            return
        try:
            self.wait()
        finally:
            self._closed = True
            _open_checkpointers.discard(self)
            if self._save_policy is not None:
                self._save_policy.detach()
            if self._tier is not None:
                self._tier.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # the body's error wins; keep this one visible
            log.error("%s: background checkpoint work failed: %r", self.root, e)
            exc.add_note(f"also, background checkpoint work failed: {type(e).__name__}: {e}")

    def __repr__(self) -> str:
        return (
            f"Checkpointer({self.root!r}, step_format={self._fmt.pattern!r}, "
            f"save_policy={self._save_policy!r}, keep={self._keep!r})"
        )
