"""The local tier with several JAX processes: peer copies, the agreed step, per-owner restore.

Every process keeps its own local root (``LocalTier.process_url``); a step is saved by all
of them together (``quire._tiers.spread_save``), and its objects are split by **owner**
process (``quire._tiers.ownership``).  This module adds what needs every process:

* **Peer copies** (``LocalTier(peers=k)``), after each local commit, in the background: each
  owner's objects are pulled over TCP by its ``k`` holders (``quire._tiers.peer_copies``;
  who holds whom: ``quire._tiers.placement``, spread over failure domains), which
  check them against the commit record and the chunk index before writing them at the same
  paths in their own root (:meth:`Spread.after_local`).
* **The agreed step** (:meth:`Spread.agree`, behind ``latest_step()`` and ``load()``): each
  process publishes the step it asks for and, for every local step, its commit record's
  digest and which owners' objects it holds whole, plus the persistent steps it lists
  (``quire._tiers.restore_plan.Agreement``); every process computes the same answer
  (``quire._tiers.restore_plan.plan_restore``): the newest step for which every owner's
  objects have a live holder (with the same record), or which the persistent tier holds.  A
  step some owner's objects were never completed for (a process killed mid-save) has no
  holder for them and is never chosen.
* **Restore** (:meth:`Spread.load`): with ``peers > 0`` (TCP), the normal load reads the
  chosen step through a read-only view (``quire._tiers.restore_reader``): only the byte
  ranges its shards need, each owner's from this root when it holds them, else from a live
  holder over TCP (the next one when one fails), else from the persistent tier (only when it
  holds the step with the same record); then every process waits until all are done reading.
  With ``peers=0``, every process first gets what it lacks of the step - the record, then
  each owner's objects - from the least-loaded live holder (an exchange among the holder and
  the processes lacking them), or from the persistent tier for owners no live holder has
  (only when that tier has the step, with the same record); then it loads from its own local
  root, which now holds the whole step.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from quire._engine import commit as _commit
from quire._engine.save import SaveScope
from quire._runtime.collective import exchange, kv_exchange
from quire._runtime.config import current
from quire._runtime.ioloop import run_blocking
from quire._runtime.multihost import Coordinator
from quire._store.url import mounted, normalize, open_backend
from quire._tiers import ownership
from quire._tiers.peer_copies import PeerCopies
from quire._tiers.placement import domain_of
from quire._tiers.restore_plan import (
    PERSISTENT_SOURCE,
    Agreement,
    RestorePlan,
    agreed_doc,
    holders,
    record_digest,
    self_contained,
    sources,
    view,
)
from quire._tiers.restore_reader import (
    Holder,
    Provider,
    RestoreReader,
    agreed_record,
    local_provider,
    peer_provider,
    persistent_provider,
    read_record,
)
from quire._tiers.spread_save import save_spread
from quire.errors import CheckpointNotFoundError, MultiProcessError

if TYPE_CHECKING:
    from quire._tiers.contracts import Paths, RestoringRoot, TierSpec

__all__ = ["Spread"]

log = logging.getLogger("quire")

#: Spreads opened per coordination name, in call order: the same count in every process
#: (Checkpointers open in the same order everywhere), so that the key-value exchanges of a
#: later Checkpointer on the same root never meet an earlier one's keys (they stay).
_opened: collections.Counter[str] = collections.Counter()


class Spread:
    """The multi-process part of a local tier (``quire._tiers.two_tiers.TwoTiers``).

    Parameters
    ----------
    spec : TierSpec
        The tier's configuration (a ``quire.LocalTier``).
    url : str
        This process's local root.
    local : RestoringRoot
        What keeps that root (pins, loads, listings).
    persistent : Paths
        Where the persistent tier's steps are.
    agreement : Agreement
        How the processes agree on a restore.
    """

    def __init__(
        self,
        spec: TierSpec,
        url: str,
        local: RestoringRoot,
        persistent: Paths,
        agreement: Agreement,
    ) -> None:
        import jax

        self.spec, self.url, self.local, self.persistent = spec, url, local, persistent
        self.agreement = agreement
        self.me, self.count = jax.process_index(), jax.process_count()
        self.primary = current().primary_process
        self.name = f"{persistent.root}/local"  # the coordination name, the same everywhere
        _opened[self.name] += 1
        self._kvname = f"{self.name}#{_opened[self.name]}"  # this Spread's key-value keys
        self.peers = min(spec.peers, self.count - 1)
        if self.peers < spec.peers:
            log.warning(
                "%s: LocalTier(peers=%d) with %d processes: each step is copied to the %d other "
                "processes only",
                url,
                spec.peers,
                self.count,
                self.peers,
            )
        self.agreed: int | None = None
        self._seq = 0
        self.saves = 0  # local saves so far: the same count in every process
        self.copies: PeerCopies | None = None
        self.last_restore: dict[str, tuple[int, int]] = {}  # the last TCP restore's reads
        if self.peers:
            self.copies = PeerCopies(
                url,
                self.name,
                self.me,
                self.count,
                self.peers,
                spec.peer_host,
                self._timeout(),
                domain_of(spec.failure_domain),
                spec.peer_tls,
            )

    def save_scope(self, step: int) -> SaveScope:
        """The next local save (of ``step``): every process saves into its own root,
        together (``quire._tiers.spread_save``), under a name of its own."""
        self.saves += 1
        return SaveScope(f"{self.name}/{step}/{self.saves}", save_spread)

    def _timeout(self) -> float:
        t = current().timeout
        return t if t is not None else 365 * 86400.0

    def _key(self, name: str) -> str:
        return Coordinator(self.name, "x", primary=self.primary, timeout=None, name=name).key

    def _exchange(
        self,
        what: str,
        name: str,
        group: list[int],
        payload: bytes,
        url: str,
        timeout: float | None = None,
    ) -> Any:
        """``exchange`` with a message naming what the processes were doing (blocking)."""
        t = self._timeout() if timeout is None else timeout
        try:
            return exchange(self._key(name), group, payload, t, url)
        except MultiProcessError as e:
            raise MultiProcessError(
                f"{url}: {what}: a process did not take part within {t:g}s and is treated as "
                f"lost (quire.configure(timeout=...)); {e}"
            ) from e

    def _kv(
        self, what: str, name: str, payload: bytes, url: str, timeout: float | None = None
    ) -> list[bytes]:
        """``kv_exchange`` among all processes (blocking): small payloads and barriers
        through the key-value store, with nothing to compile."""
        t = self._timeout() if timeout is None else timeout
        try:
            return kv_exchange(self._key(name), list(range(self.count)), payload, t, url, what)
        except MultiProcessError as e:
            raise MultiProcessError(
                f"{e}; it is treated as lost (quire.configure(timeout=...))"
            ) from e

    # ------------------------------------------------------------------ saving
    async def after_local(self, local_fut: Any, step: int, seq: int) -> None:
        """After the local commit of ``step`` (save number ``seq``): mark this process's own
        objects held, then the peer copies.  A local save is collective: when it failed
        here it failed everywhere (the rare exception, a process that could not commit the
        record the others did, makes them fail the peer copy after the timeout)."""
        url = self.local.url(step)
        backend = open_backend(url, self.local.paths.options)
        try:
            await asyncio.wrap_future(local_fut)
        except BaseException:  # the save's own error is raised by the local tier
            log.warning("%s: step %d: local save failed; no peer copies", url, step)
            return
        doc = (await _commit.read(backend, url)).doc
        await ownership.mark_own(backend, url, doc, self.me, self.primary)
        if self.copies is not None:
            rel = self.local.paths.name(step)
            await self.copies.after_commit(backend, url, rel, doc, self.primary, f"{step}/{seq}")

    def close(self) -> None:
        if self.copies is not None:
            self.copies.close()

    # ------------------------------------------------------------------ agreeing
    async def _view(self, want: int | None, persistent: list[int]) -> dict[str, Any]:
        steps: dict[str, Any] = {}
        for s in self.local.steps():
            url = self.local.url(s)
            backend = open_backend(url, self.local.paths.options)
            try:
                rec = await _commit.read_if_exists(backend, url)
            except Exception as e:  # a damaged record: this process does not hold the step
                log.warning("%s: %s; not offered for restore", url, e)
                continue
            if rec is None:
                continue
            need = ownership.owners(rec.doc, self.primary)
            held = [j for j in need if await ownership.holds(backend, rec.doc, j)]
            steps[str(s)] = {"d": record_digest(rec.raw), "need": need, "held": held}
        return view(want, persistent, steps)

    def agree(self, want: int | None, persistent: list[int]) -> RestorePlan | None:
        """Every process's holdings, listed afresh and exchanged; the same
        :class:`RestorePlan` everywhere (blocking, collective: every process calls it)."""
        self.local.wait()  # this process's local saves and peer copies
        self.local.reload()
        self._seq += 1
        mine = self.local.run(self._view(want, persistent))
        what = "agreeing on the local tier step to restore"
        plan = self.agreement.decide(mine, self.url, self.persistent.root, what)
        if plan is not None:
            self.agreed = max(plan.step, self.agreed or 0)
        return plan

    # ------------------------------------------------------------------ restoring
    def load(
        self,
        step: int | None,
        fn: Callable[[str], Any],
        fallback: Callable[[int], Any],
        persistent: list[int],
    ) -> Any:
        plan = self.agree(step, persistent)
        if plan is None:
            raise CheckpointNotFoundError(
                f"{self.persistent.root}: no step {'' if step is None else step} restorable "
                f"from the local tier {self.spec.url} (some process's objects have no "
                "live holder) nor from the persistent tier"
            )
        local = self.local
        if self.copies is not None:  # TCP: read each range the load needs where it lies
            return local.load(plan.step, lambda u: self._through(plan, u, fn, fallback))
        local.pin(plan.step)
        try:
            whole = local.run(self._assemble(plan))
        finally:
            local.unpin(plan.step)
        if not whole:
            return fallback(plan.step)
        local.relist()
        return local.load(plan.step, fn)

    def _through(
        self, plan: RestorePlan, url: str, fn: Callable[[str], Any], fallback: Callable[[int], Any]
    ) -> Any:
        """``fn(url)`` with ``url`` read through the :class:`RestoreReader` (step pinned)."""
        failed, t0 = True, time.monotonic()
        reader: RestoreReader | None = None
        try:
            reader = self.local.run(self._reader(plan))
            if reader is None:
                out = fallback(plan.step)
            else:
                with mounted(normalize(url), reader):
                    out = fn(url)
            failed = False
        finally:
            if reader is not None:
                reader.close_peers()  # this load's connections to its holders
            # Every process serves the others until all are done reading: a process that
            # went on (closing its server, or its retention deleting the step) would cut off
            # a slower one.  A failing process takes part too, then raises its own error.
            # The others wait for it twice this process's restore time, plus one deadline
            # per other process (each may have waited out one lost peer).  Not needed when
            # every process holds every owner's objects (the same answer everywhere).
            try:
                if not self_contained(plan):
                    self._kv(
                        f"restoring step {plan.step}: waiting for every process to finish reading",
                        f"{self._kvname}/restored/{self._seq}",
                        b"",
                        url,
                        2 * (time.monotonic() - t0) + self.count * self._timeout(),
                    )
            except MultiProcessError:
                if not failed:
                    raise
        if reader is None:
            return out
        self.last_restore = reader.stats()
        log.info(
            "%s: step %d restored; read from others (bytes, requests): %s",
            url,
            plan.step,
            self.last_restore or "nothing",
        )
        return out

    async def _assemble(self, plan: RestorePlan) -> bool:
        """Get what this process lacks of ``plan.step`` into its local root; False when the
        whole step is to be read from the persistent tier instead."""
        s = plan.step
        url = self.local.url(s)
        backend = open_backend(url, self.local.paths.options)
        purl = self.persistent.url(s)
        pb = open_backend(purl, self.persistent.options)
        views = plan.views
        digest, raw = plan.digest, None
        if digest is None:  # the persistent tier's record: local holders of it help
            raw = (await _commit.read(pb, purl)).raw
            digest = record_digest(raw)
        held = holders(views, s, digest)
        if raw is not None and not any(held.values()):  # read from the persistent tier
            return False
        src = sources(views, s, digest)
        has_rec = [p for p, v in enumerate(views) if v["steps"].get(str(s), {}).get("d") == digest]
        key = f"{self.name}/restore/{self._seq}/{s}"
        if raw is None:
            lacking = [p for p in range(self.count) if p not in has_rec]
            if lacking:
                sender = has_rec[0]
                group = sorted({sender, *lacking})
                mine = b""
                if self.me == sender:
                    mine = (await _commit.read(backend, url)).raw
                if self.me in group:
                    rows = await run_blocking(
                        self._exchange,
                        f"restoring step {s}: its commit record",
                        f"{key}/record",
                        group,
                        mine,
                        url,
                    )
                    raw = bytes(rows[group.index(sender)])
            if raw is None:
                raw = (await _commit.read(backend, url)).raw
        doc = agreed_doc(raw, digest, url, s)
        for j, who in sorted(src.items()):
            lacking = [p for p in range(self.count) if p not in held.get(j, [])]
            if not lacking:
                continue
            if who == PERSISTENT_SOURCE:  # one process reads them, then sends them on
                who = lacking[j % len(lacking)]
                if self.me == who:
                    n = await ownership.fetch_owner(pb, purl, backend, url, doc, j, self.primary)
                    log.info(
                        "%s: step %d: process %d's objects read from the persistent tier %s "
                        "(%d bytes)", url, s, j, purl, n,
                    )  # fmt: skip
                lacking.remove(who)
                if not lacking:
                    continue
            group = sorted({who, *lacking})
            if self.me not in group:
                continue
            payload = b""
            if self.me == who:
                payload = ownership.encode(await ownership.read_owned(backend, doc, j))
            rows = await run_blocking(
                self._exchange,
                f"restoring step {s}: process {j}'s objects from process {who}",
                f"{key}/{j}",
                group,
                payload,
                url,
            )
            if self.me in lacking:
                objects = ownership.decode(rows[group.index(who)], url, f"process {who}", j)
                await ownership.receive(
                    backend, url, doc, j, self.primary, objects, f"process {who}"
                )
        if self.me not in has_rec:
            await _commit.publish(backend, url, raw, doc["txids"], overwrite=True)
        return True

    async def _reader(self, plan: RestorePlan) -> RestoreReader | None:
        """Over TCP (``peers > 0``): the read-only view the load reads ``plan.step``
        through, each owner's objects from this root, else the live holders (nearest and
        least asked first), else the persistent tier; None when no live holder has any
        of the persistent tier's record (then it is loaded from there as any checkpoint)."""
        copies = self.copies
        assert copies is not None
        s, views = plan.step, plan.views
        url, purl, rel = self.local.url(s), self.persistent.url(s), self.local.paths.name(s)
        backend = open_backend(url, self.local.paths.options)
        pb = open_backend(purl, self.persistent.options)
        digest, raw, praw = plan.digest, None, None
        if digest is None:  # the persistent tier's record: local holders of it help
            raw = praw = (await _commit.read(pb, purl)).raw
            digest = record_digest(raw)
        held = holders(views, s, digest)
        if praw is not None and not any(held.values()):
            return None
        has_rec = [p for p, v in enumerate(views) if v["steps"].get(str(s), {}).get("d") == digest]
        slots = {h: Holder(copies, h) for h in range(self.count)}
        # Per owner, the peers to ask, in order (rotated per process and owner, so that
        # processes spread over them).  The first of each owner this process does not
        # hold opens its connections now: their handshakes run while the record is
        # fetched and the load plans its reads.
        asked = {}
        for j, hs in held.items():
            others = [h for h in hs if h != self.me]
            k = (self.me + j) % len(others) if others else 0
            asked[j] = others[k:] + others[:k]
            if self.me not in hs and others:
                slots[asked[j][0]].warm()
        if raw is None:
            raw = await agreed_record(slots, self.me, backend, url, digest, has_rec, rel)
        doc = agreed_doc(raw, digest, url, s)
        in_persistent = s in {int(x) for x in views[self.primary]["persistent"]}
        by_owner: dict[int, list[Provider]] = {}
        for j in ownership.owners(doc, self.primary):
            hs = held.get(j, [])
            srcs = [local_provider(backend, doc, j)] if self.me in hs else []
            srcs += [peer_provider(copies, h, rel, doc, j, slots[h]) for h in asked.get(j, [])]
            if in_persistent:
                srcs.append(persistent_provider(pb, purl, doc, j, self.primary))
            by_owner[j] = srcs

        async def persistent_record() -> bytes:
            return praw if praw is not None else await read_record(pb, purl)

        return RestoreReader(
            url,
            raw,
            doc,
            self.primary,
            by_owner,
            persistent_record if in_persistent else None,
            getattr(backend, "keep_open", None),
        )
