"""Retention and garbage collection of one Checkpointer root: :class:`Retention`.

It deletes what the keep policy leaves out (in the background, after a commit; the
ledger says which steps are live, pinned or being saved) and collects the root's garbage:
once automatically after the first commit, and on request (``Checkpointer.gc``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from quire._checkpointer.keep_policies import KeepPolicy, StepInfo
from quire._engine import garbage as _gc
from quire._format import root as _root

if TYPE_CHECKING:
    from quire._checkpointer.ledger import StepLedger
    from quire._store.base import Backend

log = logging.getLogger("quire")


class Retention:
    """The keep policy and the garbage rules of one root.

    Parameters
    ----------
    backend, root, fmt
        The root: its backend, URL and step names.
    ledger : StepLedger
        The root's steps (read; told which steps are deleted).
    keep : KeepPolicy or None
        Which committed steps survive (None: all).
    grace : float or None
        The garbage grace period in seconds; None: no automatic collection.
    maintainer : bool
        Whether this process deletes and collects (the primary process; each process for
        its own root of a multi-process local tier).  The others only forget the steps.
    incremental : bool
        The root's owner writes borrowed bytes (then deletion retires records only).
    """

    def __init__(
        self,
        backend: Backend,
        root: str,
        fmt: _root.StepFormat,
        ledger: StepLedger,
        keep: KeepPolicy | None,
        grace: float | None,
        *,
        maintainer: bool,
        incremental: bool,
    ) -> None:
        self._backend, self._root, self._fmt, self._ledger = backend, root, fmt, ledger
        self.keep = keep
        self.grace = grace
        self._maintainer = maintainer
        self._incremental = incremental
        self._collected = False

    async def after_commit(self) -> bool:
        """A step committed: collect garbage if this is the first commit; return whether
        the keep policy is to run (then schedule :meth:`retain` after earlier tasks)."""
        run_gc = self._maintainer and self.grace is not None and not self._collected
        self._collected = True
        if run_gc:
            # Inside the save: the next save waits for it, so GC never races our own writes.
            try:
                report = await self.collect(self.grace)
                for g in report.removable:
                    log.info("%s: removed %s garbage %s", self._root, g.kind, g.prefix)
            except Exception as e:  # the save did commit; GC can run again later
                log.warning("%s: automatic garbage collection failed: %r", self._root, e)
        return self.keep is not None

    async def retain(self) -> None:
        """Delete the live steps the keep policy leaves out (see ``StepLedger.choose_victims``)."""
        keep = self.keep
        if keep is None:
            return
        await self._ledger.fill(self.read_info)
        victims = self._ledger.choose_victims(lambda infos: keep.keep(infos, time.time()))
        # A root an incremental Checkpointer wrote may hold borrowed bytes, whoever prunes it.
        borrowing = self._incremental or (
            bool(victims) and await self._backend.exists(_root.INCREMENTAL_MARKER)
        )
        left = list(victims)  # marked "being deleted", record not removed yet
        try:
            for s in victims:
                name = self._fmt.name(s)
                if self._maintainer:
                    if borrowing:  # the record only: later steps may borrow its bytes
                        await _gc.retire_step(self._backend, self._root, name)
                    else:
                        await self._backend.delete([f"{name}/quire.json"])  # invisible now
                left.remove(s)
                self._ledger.deleted(s)
                if self._maintainer and not borrowing:
                    # A failure here leaves an incomplete step directory: garbage for gc().
                    await self._backend.delete_prefix(name)
                log.debug("%s: deleted step %d (keep policy)", self._root, s)
        finally:
            # On a failure the victims whose record is still there stay live: listed,
            # loadable, chosen again by the next run of the policy.
            for s in left:
                self._ledger.kept(s)
        if self._maintainer and borrowing and victims:
            grace = self.grace if self.grace is not None else _gc.DEFAULT_GRACE_PERIOD
            await _gc.sweep_retired(self._backend, self._root, self._fmt, grace)

    async def read_info(self, step: int) -> StepInfo | None:
        """``step``'s info from its commit record; None when it has none (deleted meanwhile)."""
        doc = await _gc.read_step_record(self._backend, self._root, self._fmt.name(step))
        if doc is None:
            return None
        return StepInfo(step, doc["_created"].timestamp(), _root.record_metrics(doc))

    async def collect(self, grace: float | None, *, dry_run: bool = False) -> _gc.GcReport:
        """Remove (or with ``dry_run`` list) the root's garbage older than ``grace`` seconds
        (None: the root's grace period, else one hour), sparing the protected steps."""
        if grace is None:
            grace = self.grace if self.grace is not None else _gc.DEFAULT_GRACE_PERIOD
        return await _gc.collect(
            self._backend,
            self._root,
            self._fmt,
            grace_period=grace,
            dry_run=dry_run,
            exclude=self._ledger.protected(),
        )
