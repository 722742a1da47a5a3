"""One root of numbered step checkpoints, kept by this process: :class:`StepRoot`.

A ``quire.Checkpointer`` keeps its root with one; a local tier (``quire._tiers.two_tiers``)
keeps each process's local root with another, so both tiers share one save, commit,
retention and load path.  A StepRoot does not decide *whether* to save (the
Checkpointer's ``SaveDecider`` does); it saves when told, and holds its parts:

* the :class:`~quire._checkpointer.ledger.StepLedger` (which steps are committed,
  pinned, being deleted or saved),
* :class:`~quire._checkpointer.background.BackgroundTasks` (the save in flight, the retention
  chain, the kept errors),
* :class:`~quire._checkpointer.retain.Retention` (the keep policy, garbage collection),
* with ``incremental``, the root's ``quire._engine.incremental.Incremental``.

Threads and ordering:

* A save (:meth:`StepRoot.save`) waits for the previous one (one save in flight; a load
  waits for it too), creates the root record (``checkpointer.json``) if there is none and
  runs the device-to-host copy in the caller's thread (``quire.save_async``); then, on
  quire's event loop, the write and COMMIT (the step's ``quire.json``), and only then
  :meth:`StepRoot.after_commit`: the ledger counts the step, the first commit collects
  garbage (inside the save, so no later save races it).
* After each commit the keep policy runs as a background task of the chain: these tasks
  run one after another, never two at once.
* A background failure is kept and raised by the owner's next public call, by ``wait`` or
  ``close``, or when a ``with`` block exits - never dropped.  Checkpointers still open when
  the interpreter exits are closed then (``quire._runtime.exithook``; errors are logged),
  before quire's I/O threads stop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from quire import _api
from quire._checkpointer.background import BackgroundTasks
from quire._checkpointer.keep_policies import BestN, KeepPolicy, StepInfo
from quire._checkpointer.ledger import StepLedger, as_step, clean_metrics
from quire._checkpointer.retain import Retention
from quire._engine import garbage as _gc
from quire._engine import incremental as _inc
from quire._format import root as _root
from quire._handlers.units import as_mapping
from quire._store.url import normalize, open_backend
from quire.errors import CheckpointExistsError, CheckpointNotFoundError

if TYPE_CHECKING:
    import concurrent.futures
    import os

    from quire._engine.save import SaveScope
    from quire.metadata import CheckpointMetadata

log = logging.getLogger("quire")


@dataclasses.dataclass(frozen=True)
class StepPaths:
    """Where the steps of a root are: its URL, step names and storage options."""

    root: str
    fmt: _root.StepFormat
    options: dict[str, Any] | None

    def name(self, step: int) -> str:
        return self.fmt.name(step)

    def url(self, step: int) -> str:
        return f"{self.root}/{self.fmt.name(step)}"


async def _await_response(resp: _api.AsyncResponse[Any]) -> Any:
    """Await an AsyncResponse from a coroutine on quire's loop without blocking it."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def _set() -> None:
        if not done.done():
            done.set_result(None)

    def _wake(_r: Any) -> None:
        loop.call_soon_threadsafe(_set)

    resp.add_done_callback(_wake)
    await done
    return resp.result()


class StepRoot:
    """The numbered steps under one root URL, kept by this process.

    Parameters
    ----------
    root_url : str or path
        The root URL.
    storage_options : dict or None
        fsspec options for its backend.
    step_format : str or None
        As for ``quire.Checkpointer`` (None: the recorded one, else the default).
    metadata : mapping or None
        The run's metadata for the root record (None: none given).
    keep, gc_grace_period, incremental, compact_below
        As for ``quire.Checkpointer``.
    maintainer : bool
        Whether this process creates the root record, deletes steps and collects garbage.

    Raises
    ------
    TypeError
        ``keep`` is not a keep policy, or ``metadata`` is not JSON.
    ValueError
        ``gc_grace_period`` is negative, or ``step_format`` differs from the recorded one.
    """

    def __init__(
        self,
        root_url: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None,
        *,
        step_format: str | None,
        metadata: Mapping[str, Any] | None,
        keep: KeepPolicy | None,
        gc_grace_period: float | None,
        incremental: bool,
        compact_below: float,
        maintainer: bool,
    ) -> None:
        if keep is not None and not isinstance(keep, KeepPolicy):
            raise TypeError(f"keep must be a quire.policies.KeepPolicy, got {keep!r}")
        if gc_grace_period is not None and not gc_grace_period >= 0:
            raise ValueError(f"gc_grace_period must be >= 0 seconds or None, got {gc_grace_period}")
        self.root = root = normalize(root_url)
        options = dict(storage_options) if storage_options else None
        self._backend = open_backend(root, options)
        self._metadata = dict(metadata or {})
        try:
            json.dumps(self._metadata, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"Checkpointer metadata must be JSON-serialisable: {e}") from e
        self._maintainer = maintainer
        self._tasks = BackgroundTasks(root)
        self._ledger = StepLedger()
        self.inc = _inc.Incremental(root, compact_below) if incremental else None
        doc = self.run(_root.read_root_record(self._backend, root))
        if doc is not None and step_format is not None and doc["step_format"] != step_format:
            raise ValueError(
                f"{root} was written with step_format {doc['step_format']!r}, not "
                f"{step_format!r}; pass step_format={doc['step_format']!r} or leave it out"
            )
        if doc is not None and metadata is not None and doc.get("metadata") != self._metadata:
            log.warning(
                "%s: keeping the run metadata recorded by the first writer; the metadata "
                "passed to this Checkpointer differs and is not stored",
                root,
            )
        self._root_doc = doc
        fmt = _root.StepFormat(
            step_format or (doc["step_format"] if doc else _root.DEFAULT_STEP_FORMAT)
        )
        self.paths = StepPaths(root, fmt, options)
        self._retention = Retention(
            self._backend,
            root,
            fmt,
            self._ledger,
            keep,
            gc_grace_period,
            maintainer=maintainer,
            incremental=incremental,
        )
        self.relist()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on quire's event loop and wait for its result."""
        return self._tasks.run(coro)

    @property
    def keep(self) -> KeepPolicy | None:
        return self._retention.keep

    def url(self, step: int) -> str:
        return self.paths.url(step)

    # ------------------------------------------------------------------ listing
    def relist(self) -> None:
        """List the committed steps again."""
        self._ledger.replace(self.run(_root.committed_steps(self._backend, self.paths.fmt)))

    def reload(self) -> None:
        """Read the root record and list the steps again (the caller waited first)."""
        self._root_doc = self.run(_root.read_root_record(self._backend, self.root))
        self.relist()

    def steps(self) -> list[int]:
        """The live steps, ascending (raises a kept background error first)."""
        self._tasks.raise_errors()
        return self._ledger.live()

    def latest(self) -> int | None:
        return self._ledger.latest()

    def floor(self) -> int | None:
        """The highest step committed or being saved."""
        return self._ledger.floor()

    def info(self, step: int) -> StepInfo | None:
        return self._ledger.info(step)

    def run_metadata(self) -> dict[str, Any]:
        """The run's metadata: recorded in the root record, else the one given."""
        if self._root_doc is not None:
            return dict(self._root_doc.get("metadata", {}))
        return dict(self._metadata)

    # ------------------------------------------------------------------ background
    def raise_errors(self) -> None:
        self._tasks.raise_errors()

    def wait_save(self) -> None:
        """Wait for the save in flight; raise the kept errors."""
        self._tasks.wait_save()

    def wait(self) -> None:
        """Wait for every background task; raise the kept errors."""
        try:
            self._tasks.drain()
        finally:
            self._tasks.raise_errors()

    def follow_save(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in the background as part of the save in flight: the next save (and
        :meth:`wait_save`) waits for it."""
        self._tasks.start_save(coro)

    # ------------------------------------------------------------------ saving
    def save(
        self,
        step: int,
        units: Mapping[str, Any],
        metrics: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
        *,
        overwrite: bool,
        scope: Callable[[], SaveScope] | None = None,
    ) -> concurrent.futures.Future[Any]:
        """Save ``units`` as ``step`` (no decision: the caller made it); return the
        background future of the write, the commit and :meth:`after_commit`.

        ``scope``: gives the
        ``quire._engine.save.SaveScope`` of a save in which every process saves into a
        root of its own (a multi-process local tier), asked right before the save starts
        (not when an earlier check raises: the names stay in step).
        """
        self._tasks.raise_errors()
        user = dict(metadata or {})
        if _root.METRICS_KEY in user:
            raise ValueError(
                f"metadata key {_root.METRICS_KEY!r} is reserved; pass metrics=... instead"
            )
        clean = clean_metrics(metrics, step)
        if metrics is not None:
            user[_root.METRICS_KEY] = clean
        self._tasks.wait_save()  # at most one save in flight
        if self._ledger.being_deleted(step):
            self.wait()
        inc = self.run(self.prepare())
        url = self.url(step)
        resp = _api.save_units_async(
            url,
            as_mapping(units),
            incremental=inc,
            scope=None if scope is None else scope(),
            metadata=user,
            overwrite=overwrite,
            storage_options=self.paths.options,
        )
        self._ledger.start(step)  # before the background may commit it
        return self._tasks.start_save(self._finish_save(resp, step, clean, url))

    async def _finish_save(
        self, resp: _api.AsyncResponse[Any], step: int, metrics: dict[str, Any], url: str
    ) -> None:
        try:
            await _await_response(resp)
        except BaseException as e:
            if self.inc is not None:
                self.inc.failed()
                await self.inc.release(self._backend)
            self._ledger.abandoned()
            if isinstance(e, CheckpointExistsError):  # quire.save's fix is not this API's
                raise CheckpointExistsError(
                    f"{url}: step {step} is already committed (another writer on this root, "
                    "or a step this Checkpointer had not listed); pass force=True to "
                    "Checkpointer.save to replace it, or reload() to list it"
                ) from e
            e.add_note(f"(background save of step {step} to {url})")
            raise
        if self.inc is not None:
            self.inc.committed()
            await self.inc.release(self._backend)
        await self.after_commit(step, metrics)

    def begin(
        self, step: int, commit: Coroutine[Any, Any, dict[str, Any] | None]
    ) -> concurrent.futures.Future[Any]:
        """Run ``commit`` in the background as the save of ``step`` (a promotion from a
        local tier): it commits the step and returns its metrics, or None when it did not
        save (then nothing is counted and the future's result is False)."""
        self._ledger.start(step)

        async def run() -> bool:
            try:
                metrics = await commit
            except BaseException:
                self._ledger.abandoned()
                raise
            if metrics is None:
                self._ledger.abandoned()
                return False
            await self.after_commit(step, metrics)
            return True

        return self._tasks.start_save(run())

    async def prepare(self) -> _inc.Incremental | None:
        """Before a step is written: the root record exists (created by the maintainer)
        and an incremental root knows the previous step; return the root's Incremental."""
        if self._maintainer and self._root_doc is None:
            await _gc.create_root_record(self._backend, self.paths.fmt.pattern, self._metadata)
            self._root_doc = await _root.read_root_record(self._backend, self.root)
        inc = self.inc
        if inc is not None and not inc.started:
            latest = self._ledger.latest()  # an earlier run's last step: borrow its bytes
            await inc.start(self._backend, None if latest is None else self.paths.name(latest))
        return inc

    async def after_commit(self, step: int, metrics: dict[str, Any]) -> None:
        """``step`` is committed (durably): count it, collect garbage once, run retention."""
        self._ledger.committed(StepInfo(step, time.time(), metrics))
        if await self._retention.after_commit():
            self._tasks.schedule(self._retention.retain)

    # ------------------------------------------------------------------ loading
    def pin(self, step: int) -> None:
        """Keep ``step`` from being deleted until :meth:`unpin`."""
        self._ledger.pin(step)

    def unpin(self, step: int) -> None:
        """Drop one pin of ``step``; the last pin gone runs a deletion deferred for it."""
        if self._ledger.unpin(step):
            self._tasks.schedule(self._retention.retain)

    def load(self, step: int | None, fn: Callable[[str], Any]) -> Any:
        """``fn(url of step)`` (None: the latest), the step pinned.  With several processes
        the caller has agreed on ``step`` first (``quire._tiers.restore_plan.Agreement``)."""
        self._tasks.wait_save()
        s, deleting = self._ledger.pin(None if step is None else as_step(step))
        try:
            if s is None:
                raise CheckpointNotFoundError(
                    f"no committed step under {self.root} (step format "
                    f"{self.paths.fmt.pattern!r}); call reload() if another process wrote one"
                )
            if deleting:
                raise CheckpointNotFoundError(
                    f"step {s} of {self.root} is being deleted by the keep policy"
                )
            return fn(self.url(s))
        finally:
            if s is not None:
                self.unpin(s)

    # ------------------------------------------------------------------ inspection
    def metrics(self, step: int) -> dict[str, Any]:
        info = self._ledger.info(step)
        if info is None:
            doc = self.run(_gc.read_step_record(self._backend, self.root, self.paths.name(step)))
            if doc is None:
                raise CheckpointNotFoundError(f"no committed step {step} under {self.root}")
            return _root.record_metrics(doc)
        return dict(info.metrics)

    def infos(self) -> list[StepInfo]:
        """The infos of the live steps (records read where not read yet)."""
        self.run(self._ledger.fill(self._retention.read_info))
        return self._ledger.infos()

    def best(self, metric: str, mode: str) -> int | None:
        """The live step with the best ``metric`` (``BestN``'s ranking), or None."""
        ranked = BestN(1, metric=metric, mode=mode).ranked(self.infos())
        return ranked[0] if ranked else None

    def step_metadata(self, step: int) -> CheckpointMetadata:
        """``quire.metadata`` of ``step``."""
        m: CheckpointMetadata = _api.metadata(self.url(step), storage_options=self.paths.options)
        return m

    def gc(self, grace_period: float | None, *, dry_run: bool) -> _gc.GcReport:
        self._tasks.wait_save()
        report: _gc.GcReport = self.run(self._retention.collect(grace_period, dry_run=dry_run))
        return report
