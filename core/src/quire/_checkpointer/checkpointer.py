"""``quire.Checkpointer``: a sequence of step checkpoints under one root, for training loops.

The Checkpointer holds its parts: its root (``quire._checkpointer.steproot``, where the
threads and the order of a save are described) and its ``Tiers`` (the save decision, and
a local tier if any: ``quire._tiers.two_tiers``, configured by ``localtier``).  Garbage
rules: ``quire._engine.garbage``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, overload

from quire import _api
from quire._checkpointer.deciding import preempted
from quire._checkpointer.keep_policies import KeepPolicy
from quire._checkpointer.ledger import as_step
from quire._checkpointer.localtier import LocalTier
from quire._checkpointer.save_policies import SavePolicy
from quire._checkpointer.steproot import StepRoot
from quire._checkpointer.tiering import arrange, check_arguments
from quire._engine import garbage as _gc
from quire._engine import incremental as _inc
from quire._format.record import PYTREE
from quire._runtime import exithook as _exit
from quire._runtime.config import current

if TYPE_CHECKING:
    import os
    import types

    from quire.metadata import CheckpointMetadata
    from quire.options import CastingSpec

__all__ = ["Checkpointer"]

log = logging.getLogger("quire")


class Checkpointer:
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
        steps being loaded are never deleted.  With ``local``: the persistent tier's steps
        (the local tier's own is ``LocalTier(keep=...)``).
    step_format : str, optional
        Directory name of a step, a ``str.format`` pattern with one int field; default
        the root's recorded one, else ``"step_{:08d}"``; a pattern whose names do not
        parse back to their step (``"{:x}"``, ``"{:,}"``) is a ``ValueError``.  Names that do
        not parse back to a step are ignored.
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
        check_arguments(save_policy, local)
        import jax

        self._closed = False
        self._main = StepRoot(
            root_url,
            storage_options,
            step_format=step_format,
            metadata=metadata,
            keep=keep,
            gc_grace_period=gc_grace_period,
            incremental=incremental,
            compact_below=compact_below,
            maintainer=jax.process_index() == current().primary_process,
        )
        self.root = self._main.root
        self._tier = arrange(self._main, save_policy, local, gc_grace_period)
        _exit.close_at_exit(self)  # if still open then (errors are logged)

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
        self._check_open()
        return self._tier.save(as_step(step), {PYTREE: tree}, metrics, metadata, force=force)

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
        self._check_open()
        return self._tier.save(as_step(step), checkpointables, metrics, metadata, force=force)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"quire.Checkpointer({self.root!r}) is closed")
        self._main.raise_errors()

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` would save at ``step``.

        False for a step at or below the latest committed one or the one being saved (a
        save that failed does not count); otherwise the save policy's answer (True without a
        policy) or, with a local tier, either tier's policy's answer.  Asking has no effect.

        Parameters
        ----------
        step : int
            The step number (non-negative).

        Returns
        -------
        bool
            Whether ``save(step, ...)`` would save (without ``force``).
        """
        self._main.raise_errors()
        return self._tier.should_save(as_step(step))

    @property
    def preempted(self) -> bool:
        """Whether an :class:`~quire.policies.OnPreemption` policy received a notice.

        Check it right after a save: if it is True then, the saved state is the latest and
        the loop may stop (a notice arriving later makes the next step save).
        """
        return preempted(self._tier.policies())

    def wait(self) -> None:
        """Wait for the save in flight and background deletions; raise their errors.

        With a local tier: its saves and deletions too, then the promotions, then the local
        deletions a promotion held up (its step stayed pinned until it ended).
        """
        self._tier.wait()

    # ------------------------------------------------------------------ reading
    def steps(self) -> list[int]:
        """Committed steps, ascending, in any tier (as of the last listing plus own saves).

        With a local tier: both tiers' steps, each tier's kept by its own keep policy, so
        more than either policy keeps (``tiers_of`` says which tier holds a step).
        """
        return self._tier.steps()

    def latest_step(self) -> int | None:
        """The highest step committed in any tier (its local tier included), or None."""
        return self._tier.latest()

    def tiers_of(self, step: int) -> tuple[str, ...]:
        """The tiers that hold ``step`` committed: ``"local"`` and/or ``"persistent"``.

        Parameters
        ----------
        step : int
            The step number.

        Returns
        -------
        tuple of str
            Fastest first; empty if no tier holds it.
        """
        return self._tier.tiers_of(as_step(step))

    def reload(self) -> None:
        """List the roots again (every tier), to see steps written or deleted by others.

        Waits for this Checkpointer's background work first (see :meth:`wait`).
        """
        self._tier.reload()

    def load(
        self,
        step: int | None = None,
        abstract: Any = None,
        *,
        partial: bool = False,
        transform: Any = None,
        shardings: Any = None,
        casting: CastingSpec = None,
    ) -> Any:
        """Load ``step`` (default: the latest committed one), as ``quire.load`` does.

        Waits for a save in flight first; every process agrees on the step with the others
        (a collective).  The step cannot be deleted while it is being loaded.

        Parameters
        ----------
        step : int, optional
            The step; None for the latest committed step.
        abstract : pytree, optional
            The target tree (see ``quire.load``).
        partial : bool
            Load only the keys in ``abstract``, ignoring the others (e.g. only the params
            of another run's checkpoint).
        transform, shardings, casting
            Model surgery, shardings / partition rules and the casts to ``abstract``'s
            dtypes allowed, as for ``quire.load``.

        Raises
        ------
        CheckpointNotFoundError
            No such committed step (or none at all), or one of several named units (its
            message names :meth:`load_checkpointables`; one pytree unit loads).
        TreeMismatchError
            ``abstract`` does not match, or asks for a lossy cast (see ``quire.load``).
        QuireError
            Processes disagree on the step to restore.
        MultiProcessError
            A process did not take part in the agreement within ``quire.configure(timeout=...)``.
        """
        kw: dict[str, Any] = {"partial": partial, "transform": transform, "shardings": shardings}
        kw.update(casting=casting, storage_options=self._main.paths.options)
        return self._tier.load(
            None if step is None else as_step(step), lambda url: _api.load(url, abstract, **kw)
        )

    def load_checkpointables(
        self,
        step: int | None = None,
        abstract: Mapping[str, Any] | None = None,
        *,
        partial: bool = False,
        casting: CastingSpec = None,
    ) -> dict[str, Any]:
        """Load named units of ``step`` (default: latest); see ``quire.load_checkpointables``.

        Parameters
        ----------
        step : int, optional
            The step (default: the latest committed one).
        abstract : mapping of str to target, optional
            Unit name -> target, as for ``quire.load_checkpointables`` (None: every unit,
            as saved).
        partial, casting
            For pytree units: load only the keys present in the target; the casts to the
            targets' dtypes allowed (see :meth:`load`).

        Returns
        -------
        dict
            Unit name -> loaded value.

        Raises
        ------
        CheckpointNotFoundError
            No committed step (or not that one).
        """
        opts = self._main.paths.options
        return self._tier.load(  # type: ignore[no-any-return]
            None if step is None else as_step(step),
            lambda url: _api.load_checkpointables(
                url, abstract, partial=partial, storage_options=opts, casting=casting
            ),
        )

    # ------------------------------------------------------------------ inspection
    @overload
    def metadata(self, step: None = None) -> dict[str, Any]: ...

    @overload
    def metadata(self, step: int) -> CheckpointMetadata: ...

    def metadata(self, step: int | None = None) -> dict[str, Any] | CheckpointMetadata:
        """A step's :class:`~quire.metadata.CheckpointMetadata`, or the run's metadata (a dict).

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
        self._main.raise_errors()
        if step is None:
            return self._main.run_metadata()
        return self._main.step_metadata(as_step(step))

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
        self._main.raise_errors()
        return self._main.metrics(as_step(step))

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
        self._main.raise_errors()
        return self._main.best(metric, mode)

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
        return self._main.gc(grace_period, dry_run=dry_run)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Wait for background work, raise its errors, and release the save policy."""
        if self._closed:
            self._main.raise_errors()
            return
        try:
            self.wait()
        finally:
            self._closed = True
            _exit.closed(self)
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
            f"Checkpointer({self.root!r}, step_format={self._main.paths.fmt.pattern!r}, "
            f"save_policy={self._tier.policies()[0]!r}, keep={self._main.keep!r})"
        )
