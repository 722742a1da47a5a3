"""Multi-tier checkpoints: a fast local tier under the persistent one (``quire.LocalTier``).

A tier is a quire Checkpointer root.  The persistent tier is the Checkpointer's own root; the
local tier is a second root per process, ``<local url>/process_<index>``, kept by a
``StepRoot`` of its own (``quire._checkpointer.steproot``: the same format, commit protocol,
retention and garbage rules as the persistent root, so ``quire.load``, ``quire verify`` and
``quire cp`` work on it unchanged).  The Checkpointer holds the local tier as a ``TwoTiers``,
made by ``quire._checkpointer.tiering.arrange``, which hands it the roots and save decisions
(``contracts``: what it asks of them).

Order of a save of step S (``Checkpointer`` with ``TwoTiers.save`` and ``TwoTiers.promotion``), the
commit points marked:

1. decide: the local tier saves when either tier's policy says so (the persistent tier is only
   ever written from local bytes);
2. the local save (``quire.save_async`` through the local StepRoot): the one device-to-host
   copy, in the caller's thread; it returns;
3. background: LOCAL COMMIT (the local step's commit record);
4. when the persistent policy said so, background, after 3: ``quire._engine.copying`` copies the
   committed local step's stored bytes to ``<root>/<step>`` (an incremental root:
   ``quire._tiers.promotion`` uploads only the chunks its previous step lacks), checking
   every chunk's crc32c on the way, with the local step pinned against local retention;
   PERSISTENT COMMIT is the copy's conditional create of ``quire.json``, after the data is
   synced;
5. only then does the persistent tier count S (``latest_step``, ``steps``, ``tiers_of``) and
   its keep policy run.

At most one promotion (step 4) is in flight: a save due for the persistent tier waits for the
previous promotion first.  Local saves never wait for a promotion.

With several JAX processes, ``quire._tiers.spread`` adds what needs them all: each
local save is one collective save into every process's own root, followed by the peer copies;
``latest_step`` / ``load`` agree on a step and fill each root from peers or the persistent
tier; a promotion copies each process's own objects (``quire._tiers.ownership``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from quire._engine.copying import copy_checkpoint
from quire._runtime.config import current
from quire._runtime.multihost import Coordinator
from quire._tiers.contracts import Decider, LocalRoot, OpenRoot, PersistentRoot, TierSpec
from quire._tiers.ownership import promote_spread
from quire._tiers.promotion import promote
from quire._tiers.promotion import promote_spread as promote_spread_incremental
from quire._tiers.restore_plan import Agreement, RestorePlan, view
from quire._tiers.spread import Spread
from quire.errors import CorruptCheckpointError

__all__ = ["LOCAL", "PERSISTENT"]

log = logging.getLogger("quire")

LOCAL = "local"
PERSISTENT = "persistent"


class TwoTiers:
    """A Checkpointer's local tier over its persistent root: what the Checkpointer's saves,
    decisions and reads go through when it has one.

    It holds this process's local root, the local tier's save decision and, with several
    processes, its :class:`Spread`; it is given the Checkpointer's own root (``persistent``)
    and save decision (``decider``), and uses them only through their methods: it promotes
    to the persistent root, never writes it otherwise.

    Parameters
    ----------
    spec : TierSpec
        The tier's configuration (a ``quire.LocalTier``).
    persistent : PersistentRoot
        The Checkpointer's root.
    decider : Decider
        The Checkpointer's save decision.
    open_root : OpenRoot
        ``open_root(url, maintainer=...)``: the local root at ``url`` (``maintainer``:
        whether this process keeps its retention, garbage and root record).
    new_decider : callable
        ``new_decider(last_step)``: the local tier's save decision.
    """

    def __init__(
        self,
        spec: TierSpec,
        persistent: PersistentRoot,
        decider: Decider,
        open_root: OpenRoot,
        new_decider: Callable[[int | None], Decider],
    ) -> None:
        import jax

        self.spec = spec
        self.persistent = persistent
        self.outer_decider = decider
        self.url = spec.process_url(jax.process_index())
        several = jax.process_count() > 1  # every process its own root (.spread)
        if several and current().layout != "packed":
            raise NotImplementedError(
                f"quire.Checkpointer({persistent.root!r}, local=...): with several JAX processes "
                'the local tier saves packed checkpoints only; leave layout at "packed"'
            )
        # each process owns its root: retention, gc, root record
        self.inner: LocalRoot = open_root(
            self.url, maintainer=several or jax.process_index() == current().primary_process
        )
        self.agreement = Agreement(f"{persistent.root}/local", current().primary_process)
        self.spread = (
            Spread(spec, self.url, self.inner, persistent.paths, self.agreement)
            if several
            else None
        )
        if not several and spec.peers:
            log.warning(
                "%s: LocalTier(peers=%d) with one JAX process: no peer to copy to",
                self.url,
                spec.peers,
            )
        self.decider = new_decider(None if several else self.inner.latest())
        self.decider.attach()
        decider.attach()

    # ------------------------------------------------------------------ deciding
    def floor(self) -> int | None:
        """The highest step the local tier holds or is saving (with several processes: saved
        in this run or agreed for restore, the same in every process)."""
        got = [self.decider.last_step]
        got.append(self.spread.agreed if self.spread is not None else self.inner.floor())
        live = [s for s in got if s is not None]
        return max(live) if live else None

    def due(self, step: int) -> tuple[bool, bool]:
        """(local policy says save, persistent policy says save) at ``step``."""
        floor = self.floor()
        persistent = self.outer_decider.due(step, self.persistent.floor(), floor)
        return self.decider.due(step, floor), persistent

    def should_save(self, step: int) -> bool:
        return any(self.due(step))

    def policies(self) -> tuple[Any, ...]:
        return (self.outer_decider.policy, self.decider.policy)

    # ------------------------------------------------------------------ saving
    def save(
        self,
        step: int,
        units: Mapping[str, Any],
        metrics: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
        *,
        force: bool,
    ) -> bool:
        """Save ``step`` locally when either tier's policy says so (or ``force``), and promote
        it when the persistent policy does; return whether it saves."""
        local, persistent = self.due(step)
        if force:
            local = persistent = True
        if not (local or persistent):
            log.debug("%s: not saving step %d (neither tier's policy)", self.persistent.root, step)
            return False
        if persistent:
            self.persistent.wait_save()  # at most one promotion in flight
        spread = self.spread
        scope = None if spread is None else functools.partial(spread.save_scope, step)
        # overwrite: either tier decided; the local tier replaces whatever it holds.
        local_fut = self.inner.save(step, units, metrics, metadata, overwrite=True, scope=scope)
        seq = 0 if spread is None else spread.saves
        if spread is not None:
            # the next local save waits for this step's peer copies; a promotion does not
            self.inner.follow_save(spread.after_local(local_fut, step, seq))
        # A failed save does not count (one process: with several, every process must
        # keep deciding alike, so it counts there).
        self.decider.saved(step, local_fut if spread is None else None)
        if persistent:
            self.inner.pin(step)  # local retention must not delete what we copy
            promo = self.persistent.begin(
                step, self._promote(local_fut, step, overwrite=force, seq=seq)
            )
            self.outer_decider.saved(step, promo if spread is None else None)
        return True

    async def _promote(
        self, local_fut: concurrent.futures.Future[Any], step: int, *, overwrite: bool, seq: int
    ) -> dict[str, Any] | None:
        """Copy ``step`` to the persistent root once its local save commits; return its
        metrics (None: the local save failed).  The local step is pinned until it ends."""
        inner = self.inner
        src, dst = inner.url(step), self.persistent.url(step)
        try:
            try:
                await asyncio.wrap_future(local_fut)
            except BaseException:
                # The local save's own error is raised by the local tier (wait / next save).
                log.warning(
                    "%s: step %d not promoted: its local save failed", self.persistent.root, step
                )
                return None
            inc = await self.persistent.prepare()  # here, not in the loop's thread: S3 may be down
            src_opts, dst_opts = inner.paths.options, self.persistent.paths.options
            if self.spread is not None:  # every process promotes its own objects
                coord = Coordinator(
                    dst,
                    "promote",
                    primary=self.spread.primary,
                    timeout=current().timeout,
                    name=f"{self.spread.name}/{step}/{seq}/promote",
                )
                await (
                    promote_spread
                    if inc is None
                    else functools.partial(promote_spread_incremental, inc=inc)
                )(src, dst, coord, overwrite=overwrite, src_options=src_opts, dst_options=dst_opts)
            else:
                await (copy_checkpoint if inc is None else functools.partial(promote, inc=inc))(
                    src, dst, overwrite=overwrite, src_options=src_opts, dst_options=dst_opts
                )
            info = inner.info(step)
            return dict(info.metrics) if info is not None else {}
        except BaseException as e:
            e.add_note(f"(background promotion of step {step} from {src} to {dst})")
            raise
        finally:
            inner.unpin(step)

    # ------------------------------------------------------------------ reading
    def steps(self) -> list[int]:
        """Steps committed in either tier."""
        return sorted(set(self.persistent.steps()) | set(self.inner.steps()))

    def latest(self) -> int | None:
        """The highest step committed in either tier (with several processes: restorable
        by and agreed by every process, a collective)."""
        plan = self._agree(None)
        return None if plan is None else plan.step

    def _agree(self, want: int | None) -> RestorePlan | None:
        """The restore of ``want`` (None: the newest) every process agrees on."""
        if self.spread is not None:
            return self.spread.agree(want, self.persistent.steps())
        # One process holds its local steps whole; no record to compare with another's.
        local = {str(s): {"d": "", "need": [0], "held": [0]} for s in self.inner.steps()}
        what = "agreeing on the step to restore"
        mine = view(want, self.persistent.steps(), local)
        return self.agreement.decide(mine, self.url, self.persistent.root, what)

    def tiers_of(self, step: int) -> tuple[str, ...]:
        out = []
        if step in self.inner.steps():
            out.append(LOCAL)
        if step in self.persistent.steps():
            out.append(PERSISTENT)
        return tuple(out)

    def load(self, step: int | None, fn: Callable[[str], Any]) -> Any:
        """Load ``step`` (None: the latest of either tier) from the local tier if it holds it
        (with several processes: the agreed step, from wherever its bytes lie), else from the
        persistent root."""
        self.inner.wait_save()  # a step being saved locally counts once committed
        fallback = self.persistent.load
        if self.spread is not None:
            from_persistent = functools.partial(fallback, fn=fn)
            return self.spread.load(step, fn, from_persistent, self.persistent.steps())
        plan = self._agree(step)
        if plan is None or plan.digest is None:  # a step no listing shows: looked for there
            return fallback(step if plan is None else plan.step, fn)
        s = plan.step
        try:
            return self.inner.load(s, fn)
        except (CorruptCheckpointError, FileNotFoundError) as e:
            if s not in self.persistent.steps():
                raise
            log.warning(
                "%s: step %d is damaged in the local tier (%s); loading it from the persistent "
                "tier %s",
                self.url,
                s,
                e,
                self.persistent.root,
            )
            return fallback(s, fn)

    # ------------------------------------------------------------------ lifetime
    def reload(self) -> None:
        """Wait for the local tier's background work, then list both roots again."""
        self.inner.wait()
        self.inner.reload()
        self.wait()
        self.persistent.reload()

    def wait(self) -> None:
        """Wait for the local saves, deletions and peer copies, then the promotions, then the
        local deletions a promotion held up (its step was pinned until it ended)."""
        try:
            self.inner.wait()
        finally:
            try:
                self.persistent.wait()
            finally:
                self.inner.wait()

    def close(self) -> None:
        """After :meth:`wait`: let go of the policies and the peers."""
        self.outer_decider.detach()
        try:
            self.inner.wait()
        finally:
            if self.spread is not None:
                self.spread.close()
            self.decider.detach()
