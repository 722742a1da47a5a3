"""Retention, garbage collection, loading and inspection for ``quire.Checkpointer``.

Split out of ``quire._checkpointer.checkpointer`` (see there for threads and ordering); the methods
here are mixed into ``Checkpointer``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import operator
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, overload

from quire import _api
from quire._checkpointer.keep_policies import BestN, KeepPolicy, StepInfo
from quire._engine import garbage as _gc
from quire._engine import incremental as _inc
from quire._format import root as _root
from quire.errors import CheckpointNotFoundError, QuireError

if TYPE_CHECKING:
    from quire._store.base import Backend
    from quire.metadata import CheckpointMetadata

log = logging.getLogger("quire")


def _as_step(step: Any) -> int:
    try:
        s = operator.index(step)
    except TypeError:
        raise TypeError(f"a step must be an int, got {type(step).__name__} {step!r}") from None
    if s < 0:
        raise ValueError(f"steps are non-negative ints, got {s}")
    return s


def _clean_metrics(metrics: Mapping[str, Any] | None, step: int) -> dict[str, Any]:
    """Metrics as JSON: numbers (numpy / JAX scalars included) become Python numbers."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a dict of {{name: number}}, got {type(metrics).__name__}")
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise TypeError(f"metric names must be str, got {k!r}")
        if v is None or isinstance(v, bool | str):
            out[k] = v
            continue
        if hasattr(v, "item") and getattr(v, "size", 1) == 1:
            v = v.item()  # numpy / JAX scalars
        if isinstance(v, int):
            out[k] = v
        elif isinstance(v, float):
            if not math.isfinite(v):
                log.warning("step %d: metric %r is %r; stored as null", step, k, v)
                out[k] = None
            else:
                out[k] = v
        else:
            raise TypeError(
                f"metric {k!r} must be a number (or str, bool, None), got {type(v).__name__}"
            )
    return out


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


class _RetainLoadMixin:
    """The retention, loading and inspection methods of ``Checkpointer``."""

    if TYPE_CHECKING:
        root: str
        _storage_options: dict[str, Any] | None
        _backend: Backend
        _keep: KeepPolicy | None
        _gc_grace: float | None
        _metadata: dict[str, Any]
        _primary: bool
        _lock: threading.RLock
        _committed: dict[int, StepInfo | None]
        _deleting: set[int]
        _pins: collections.Counter[int]
        _deferred: bool
        _inflight_step: int | None
        _root_doc: dict[str, Any] | None
        _fmt: _root.StepFormat
        _inc: Any

        def _run(self, coro: Coroutine[Any, Any, Any]) -> Any: ...
        def _schedule(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> None: ...
        def _raise_background(self) -> None: ...
        def _wait_save(self) -> None: ...
        def _url(self, step: int) -> str: ...
        def _latest(self) -> int | None: ...
        def _relist(self) -> None: ...
        async def _load_infos(self) -> None: ...
        def wait(self) -> None: ...

    # ------------------------------------------------------------------ retention
    async def _retain(self) -> None:
        if self._keep is None:
            return
        await self._load_infos()
        with self._lock:
            live = sorted(s for s in self._committed if s not in self._deleting)
            if not live:
                return
            infos = [i for s in live if (i := self._committed[s]) is not None]
            keep = set(self._keep.keep(infos, time.time()))
            keep.add(live[-1])  # never the latest committed step
            if self._inflight_step is not None:
                keep.add(self._inflight_step)
            victims = [s for s in live if s not in keep]
            self._deferred = any(self._pins[s] for s in victims)
            victims = [s for s in victims if not self._pins[s]]
            self._deleting.update(victims)
        # A root an incremental Checkpointer wrote may hold borrowed bytes, whoever prunes it.
        borrowing = self._inc is not None or (
            bool(victims) and await self._backend.exists(_inc.MARKER)
        )
        for s in victims:
            name = self._fmt.name(s)
            if self._primary:
                try:
                    if borrowing:  # the record only: later steps may borrow its bytes
                        await _gc.retire_step(self._backend, self.root, name)
                    else:
                        await self._backend.delete([f"{name}/quire.json"])  # invisible now
                except BaseException:
                    with self._lock:
                        self._deleting.discard(s)
                    raise
            with self._lock:
                self._committed.pop(s, None)
                self._deleting.discard(s)
            if self._primary and not borrowing:
                # A failure here leaves an incomplete step directory: garbage for gc().
                await self._backend.delete_prefix(name)
            log.debug("%s: deleted step %d (keep policy)", self.root, s)
        if self._primary and borrowing and victims:
            grace = self._gc_grace if self._gc_grace is not None else _gc.DEFAULT_GRACE_PERIOD
            await _gc.sweep_retired(self._backend, self.root, self._fmt, grace)

    def _protected(self) -> set[int]:
        with self._lock:
            out = set(self._deleting) | {s for s, n in self._pins.items() if n}
            if self._inflight_step is not None:
                out.add(self._inflight_step)
            return out

    async def _auto_gc(self) -> None:
        assert self._gc_grace is not None
        report = await _gc.collect(
            self._backend,
            self.root,
            self._fmt,
            grace_period=self._gc_grace,
            exclude=self._protected(),
        )
        for g in report.removable:
            log.info("%s: removed %s garbage %s", self.root, g.kind, g.prefix)

    def gc(self, grace_period: float | None = None, *, dry_run: bool = False) -> _gc.GcReport:
        """Remove uncommitted steps and superseded data older than ``grace_period`` seconds.

        Parameters
        ----------
        grace_period : float, optional
            Default: the Checkpointer's ``gc_grace_period`` (one hour if that is None).
            Data younger than this may belong to a writer still in flight.
        dry_run : bool
            Only report what would be removed.

        Returns
        -------
        GcReport
            ``removable`` (removed unless ``dry_run``) and ``kept`` (too young, or of
            unknown age on backends that do not report modification times).
        """
        self._wait_save()
        grace = grace_period if grace_period is not None else self._gc_grace
        if grace is None:
            grace = _gc.DEFAULT_GRACE_PERIOD
        return self._run(
            _gc.collect(
                self._backend,
                self.root,
                self._fmt,
                grace_period=grace,
                dry_run=dry_run,
                exclude=self._protected(),
            )
        )

    # ------------------------------------------------------------------ loading
    def _agree(self, step: int | None) -> None:
        """Check that every process is about to restore the same step (no-op for one)."""
        import numpy as np
        from jax.experimental import multihost_utils

        try:
            multihost_utils.assert_equal(
                np.asarray(-1 if step is None else step, np.int64),
                fail_message=f"processes would restore different steps of {self.root}",
            )
        except AssertionError as e:
            raise QuireError(
                f"processes disagree on the step of {self.root} to restore (this one: {step}); "
                "they see different sets of steps: call reload() on every process, or pass "
                f"the step explicitly. {e}"
            ) from e

    def _load(self, step: Any, fn: Callable[[str], Any], *, agreed: bool = False) -> Any:
        """``fn(url of step)``, the step pinned; ``agreed``: the caller has checked that
        every process restores this step (no second check)."""
        self._wait_save()
        with self._lock:
            s = _as_step(step) if step is not None else self._latest()
            deleting = s is not None and s in self._deleting
            if s is not None:
                self._pins[s] += 1
        try:
            if not agreed:
                self._agree(s)
            if s is None:
                raise CheckpointNotFoundError(
                    f"no committed step under {self.root} (step format {self._fmt.pattern!r}); "
                    "call reload() if another process wrote one"
                )
            if deleting:
                raise CheckpointNotFoundError(
                    f"step {s} of {self.root} is being deleted by the keep policy"
                )
            return fn(self._url(s))
        finally:
            if s is not None:
                self._unpin(s)

    def _unpin(self, step: int) -> None:
        """Drop one pin of ``step``; the last pin gone runs a deletion deferred for it."""
        with self._lock:
            self._pins[step] -= 1
            if not self._pins[step]:
                del self._pins[step]
            retry = self._deferred and not self._pins
            if retry:
                self._deferred = False
        if retry:
            self._schedule(self._retain)

    def load(
        self,
        step: int | None = None,
        abstract: Any = None,
        *,
        partial: bool = False,
        transform: Any = None,
        shardings: Any = None,
    ) -> Any:
        """Load ``step`` (default: the latest committed one), as ``quire.load`` does.

        Waits for a save in flight first.  Every process checks that all processes
        restore the same step.  The step cannot be deleted while it is being loaded.

        Parameters
        ----------
        step : int, optional
            The step; None for the latest committed step.
        abstract : pytree, optional
            The target tree (see ``quire.load``).
        partial : bool
            Load only the keys in ``abstract``, ignoring the others (e.g. only the params
            of another run's checkpoint).
        transform, shardings
            Model surgery and shardings / partition rules, as for ``quire.load``.

        Raises
        ------
        CheckpointNotFoundError
            No such committed step (or none at all).
        TreeMismatchError
            ``abstract`` does not match (see ``quire.load``).
        QuireError
            Processes disagree on the step to restore.
        """
        return self._load(
            step,
            lambda url: _api.load(
                url,
                abstract,
                partial=partial,
                storage_options=self._storage_options,
                transform=transform,
                shardings=shardings,
            ),
        )

    def load_checkpointables(
        self,
        step: int | None = None,
        abstract: Mapping[str, Any] | None = None,
        *,
        partial: bool = False,
    ) -> dict[str, Any]:
        """Load named units of ``step`` (default: latest); see ``quire.load_checkpointables``.

        Parameters
        ----------
        step : int, optional
            The step (default: the latest committed one).
        abstract : mapping of str to target, optional
            Unit name -> target, as for ``quire.load_checkpointables`` (None: every unit,
            as saved).
        partial : bool
            For pytree units, load only the keys present in the target.

        Returns
        -------
        dict
            Unit name -> loaded value.

        Raises
        ------
        CheckpointNotFoundError
            No committed step (or not that one).
        """
        return self._load(  # type: ignore[no-any-return]
            step,
            lambda url: _api.load_checkpointables(
                url, abstract, partial=partial, storage_options=self._storage_options
            ),
        )

    # ------------------------------------------------------------------ inspection
    def steps(self) -> list[int]:
        """Committed steps, ascending (as of the last listing plus this process's saves)."""
        self._raise_background()
        with self._lock:
            return sorted(s for s in self._committed if s not in self._deleting)

    def latest_step(self) -> int | None:
        """The highest committed step, or None."""
        self._raise_background()
        return self._latest()

    def reload(self) -> None:
        """List the root again, to see steps written or deleted by other processes.

        Waits for this Checkpointer's background work first (see :meth:`wait`).
        """
        self.wait()
        self._root_doc = self._run(_root.read_root_record(self._backend, self.root))
        self._relist()

    @overload
    def metadata(self, step: None = None) -> dict[str, Any]: ...

    @overload
    def metadata(self, step: int) -> CheckpointMetadata: ...

    def metadata(self, step: int | None = None) -> dict[str, Any] | CheckpointMetadata:
        """A step's :class:`~quire.CheckpointMetadata`, or the run's metadata (a dict).

        ``step=None`` returns the ``metadata`` stored in ``checkpointer.json`` (or, before
        the first save, the one passed to the constructor).

        Parameters
        ----------
        step : int, optional
            A committed step; None for the run's metadata.

        Returns
        -------
        CheckpointMetadata or dict
            The step's metadata, or the run's (a dict) when ``step`` is None.
        """
        self._raise_background()
        if step is None:
            if self._root_doc is not None:
                return dict(self._root_doc.get("metadata", {}))
            return dict(self._metadata)
        m: CheckpointMetadata = _api.metadata(
            self._url(_as_step(step)), storage_options=self._storage_options
        )
        return m

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics saved with ``step`` (empty if none); reads only ``quire.json``.

        Parameters
        ----------
        step : int
            A committed step.

        Returns
        -------
        dict
            The ``metrics`` given to :meth:`save` for that step.

        Raises
        ------
        CheckpointNotFoundError
            No committed step ``step``.
        """
        self._raise_background()
        s = _as_step(step)
        with self._lock:
            info = self._committed.get(s)
        if info is None:
            doc = self._run(_gc.read_step_record(self._backend, self.root, self._fmt.name(s)))
            if doc is None:
                raise CheckpointNotFoundError(f"no committed step {s} under {self.root}")
            return _root.record_metrics(doc)
        return dict(info.metrics)

    def best_step(self, metric: str, *, mode: str = "max") -> int | None:
        """The committed step with the best ``metric``, or None.

        Parameters
        ----------
        metric : str
            The name of a metric passed to :meth:`save`; steps without it are ignored.
        mode : {"max", "min"}
            Whether a higher or a lower value is better.

        Returns
        -------
        int or None
            The best step, or None when no committed step has ``metric``.
        """
        self._raise_background()
        ranker = BestN(1, metric=metric, mode=mode)
        self._run(self._load_infos())
        with self._lock:
            infos = [
                i for s, i in self._committed.items() if i is not None and s not in self._deleting
            ]
        ranked = ranker.ranked(infos)
        return ranked[0] if ranked else None
