"""Multi-tier checkpoints: a fast local tier under the persistent one (``quire.LocalTier``).

A tier is a quire Checkpointer root.  The persistent tier is the Checkpointer's own root; the
local tier is a second root per process, ``<local url>/process_<index>``, kept by an inner
Checkpointer (same format, commit protocol, retention and garbage rules, so ``quire.load``,
``quire verify`` and ``quire cp`` work on it unchanged).

Order of a save of step S (``_Tier.save``), the commit points marked:

1. decide: the local tier saves when either tier's policy says so (the persistent tier is only
   ever written from local bytes);
2. the local save (``quire.save_async`` through the inner Checkpointer): the one device-to-host
   copy, in the caller's thread; it returns;
3. background: LOCAL COMMIT (the inner Checkpointer's commit record);
4. when the persistent policy said so, background, after 3: ``quire._engine.copying`` copies the
   committed local step's stored bytes to ``<root>/<step>`` (an incremental root:
   ``quire._engine.promotion`` uploads only the chunks its previous step lacks), checking
   every chunk's crc32c on the way, with the local step pinned against local retention; PERSISTENT COMMIT is the copy's
   conditional create of ``quire.json``, after the data is synced;
5. only then does the persistent tier count S (``latest_step``, ``steps``, ``tiers_of``) and
   its keep policy run.

At most one promotion (step 4) is in flight: a save due for the persistent tier waits for the
previous promotion first.  Local saves never wait for a promotion.

With several JAX processes, ``quire._checkpointer.tiermulti`` adds what needs them all: each
local save is one collective save into every process's own root, followed by the peer copies;
``latest_step`` / ``load`` agree on a step and fill each root from peers or the persistent
tier; a promotion copies each process's own objects (``quire._engine.tierpeers``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from quire._checkpointer.keep_policies import KeepPolicy
from quire._checkpointer.retain import _as_step
from quire._checkpointer.save_policies import SaveContext, SavePolicy
from quire._checkpointer.tiermulti import Spread
from quire._engine.copying import copy_checkpoint
from quire._engine.promotion import promote
from quire._engine.promotion import promote_spread as promote_spread_incremental
from quire._engine.tierpeers import promote_spread
from quire._runtime.config import current
from quire._runtime.multihost import Coordinator
from quire._runtime.peertls import PeerTLS, require_cryptography
from quire._store.url import normalize
from quire.errors import CorruptCheckpointError

if TYPE_CHECKING:
    from quire._checkpointer.checkpointer import Checkpointer

__all__ = ["LOCAL", "PERSISTENT", "LocalTier"]

log = logging.getLogger("quire")

LOCAL = "local"
PERSISTENT = "persistent"


@dataclasses.dataclass(frozen=True)
class LocalTier:
    """A fast per-process tier for :class:`quire.Checkpointer` (``local=LocalTier(...)``).

    Each process keeps its own quire Checkpointer root at ``<url>/process_<index>`` (so
    processes sharing a machine never share a directory), written whenever either tier's save
    policy says so; steps due for the persistent tier are copied there from these local bytes.
    See ``docs/tiers.md``.

    Parameters
    ----------
    url : str or path
        The local tier's base URL: a local disk, tmpfs or ``memory://`` URL.
    save_policy : quire.policies.SavePolicy, optional
        When the local tier saves (default: never on its own; it then saves only the steps
        the persistent policy saves).
    keep : quire.policies.KeepPolicy, optional
        Which local steps survive (default: all).
    peers : int
        With several JAX processes: copies of each process's objects of each local step on
        ``peers`` other processes (checked on arrival), in other failure domains whenever
        enough processes lie outside this one's, so a lost local directory (or host) is
        restored from its peers (default 0: from the persistent tier).
    storage_options : dict, optional
        fsspec options for the local tier's backend.
    peer_host : str
        The interface each process serves its local tier on to its peers (read-only, over
        TLS 1.3 with mutual authentication); ``127.0.0.1`` by default: this machine only.
        Give the address other hosts reach this one at for multi-host runs.
    peer_tls : quire.PeerTLS, optional
        This process's certificate, key and CA from your own PKI for the peer link
        (default: an ephemeral key and self-signed certificate per process, made with the
        ``cryptography`` package of the ``quire[peers]`` extra and pinned through
        ``jax.distributed``'s key-value store; see ``docs/peers.md``).
    failure_domain : str, optional
        What this process dies with (a host, a rack), for choosing where its peer copies go:
        each process's copies go to processes of other domains whenever enough exist
        (default: ``$QUIRE_FAILURE_DOMAIN``, else the host name).

    Raises
    ------
    TypeError, ValueError
        An argument has the wrong type or value.
    quire.PluginError
        ``peers > 0`` without ``peer_tls`` and ``cryptography`` is not installed (install
        ``quire[peers]``).
    """

    url: str | os.PathLike[str]
    save_policy: SavePolicy | None = None
    keep: KeepPolicy | None = None
    peers: int = 0
    storage_options: Mapping[str, Any] | None = None
    peer_host: str = "127.0.0.1"
    failure_domain: str | None = None
    peer_tls: PeerTLS | None = None

    def __post_init__(self) -> None:
        if self.save_policy is not None and not isinstance(self.save_policy, SavePolicy):
            raise TypeError(f"save_policy must be a SavePolicy, got {self.save_policy!r}")
        if self.keep is not None and not isinstance(self.keep, KeepPolicy):
            raise TypeError(f"keep must be a KeepPolicy, got {self.keep!r}")
        if isinstance(self.peers, bool) or not isinstance(self.peers, int) or self.peers < 0:
            raise ValueError(f"peers must be an int >= 0, got {self.peers!r}")
        if not isinstance(self.peer_host, str) or not self.peer_host:
            raise TypeError(f"peer_host must be a host name or address, got {self.peer_host!r}")
        if self.failure_domain is not None and (
            not isinstance(self.failure_domain, str) or not self.failure_domain
        ):
            raise TypeError(
                f"failure_domain must be a non-empty string, got {self.failure_domain!r}"
            )
        object.__setattr__(self, "url", normalize(self.url))
        if self.peer_tls is not None and not isinstance(self.peer_tls, PeerTLS):
            raise TypeError(f"peer_tls must be a quire.PeerTLS, got {self.peer_tls!r}")
        if self.peers and self.peer_tls is None:  # at configuration, not at the first copy
            require_cryptography(f"LocalTier({str(self.url)!r}, peers={self.peers})")

    def process_url(self, index: int) -> str:
        """The local tier root of process ``index``.

        Parameters
        ----------
        index : int
            A JAX process index.

        Returns
        -------
        str
            ``<url>/process_<index, five digits>``.
        """
        return f"{self.url}/process_{index:05d}"


class _Tier:
    """The local tier of one Checkpointer (the ``outer`` one, whose root is persistent)."""

    def __init__(
        self,
        outer: Checkpointer,
        spec: LocalTier,
        make: Callable[..., Checkpointer],
        gc_grace_period: float | None,
    ) -> None:
        import jax

        self.outer = outer
        self.spec = spec
        self.url = spec.process_url(jax.process_index())
        opts = dict(spec.storage_options) if spec.storage_options else None
        self.inner = make(
            self.url, keep=spec.keep, storage_options=opts, gc_grace_period=gc_grace_period
        )
        self.policy = spec.save_policy
        self.spread: Spread | None = None
        self.last_step: int | None = None
        if jax.process_count() > 1:  # every process its own root (quire._checkpointer.tiermulti)
            if current().layout != "packed":
                raise NotImplementedError(
                    f"quire.Checkpointer({outer.root!r}, local=...): with several JAX processes "
                    'the local tier saves packed checkpoints only; leave layout at "packed"'
                )
            self.spread = Spread(self)
        else:
            self.last_step = self.inner.latest_step()
            if spec.peers:
                log.warning(
                    "%s: LocalTier(peers=%d) with one JAX process: no peer to copy to",
                    self.url,
                    spec.peers,
                )
        self.last_time = time.monotonic()
        if self.policy is not None:
            self.policy.attach()

    # ------------------------------------------------------------------ deciding
    def floor(self) -> int | None:
        """The highest step the local tier holds or is saving (with several processes: saved
        in this run or agreed for restore, the same in every process)."""
        if self.spread is not None:
            got = [self.last_step, self.spread.agreed]
            live = [s for s in got if s is not None]
            return max(live) if live else None
        with self.inner._lock:
            got = [self.last_step, self.inner._latest(), self.inner._inflight_step]
        live = [s for s in got if s is not None]
        return max(live) if live else None

    def due(self, step: int) -> tuple[bool, bool]:
        """(local policy says save, persistent policy says save) at ``step``."""
        floor = self.floor()
        persistent = self.outer._decide(step, floor)
        if floor is not None and step <= floor:
            return False, persistent
        if self.policy is None:
            return False, persistent
        ctx = SaveContext(step, self.last_step, self.last_time, time.monotonic())
        return bool(self.policy.should_save(ctx)), persistent

    # ------------------------------------------------------------------ saving
    def save(
        self,
        step: int,
        units: Mapping[str, Any],
        metrics: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
        force: bool,
        single: bool,
    ) -> bool:
        local, persistent = self.due(step)
        if force:
            local = persistent = True
        if not (local or persistent):
            log.debug("%s: not saving step %d (neither tier's policy)", self.outer.root, step)
            return False
        inner, outer = self.inner, self.outer
        if persistent:
            outer._wait_save()  # at most one promotion in flight
        # force: the outer Checkpointer decided; the local tier saves whatever it holds.
        inner._save(step, units, metrics, metadata, True, single=single)
        with inner._lock:
            local_fut = inner._save_fut
        seq = inner._spread_seq
        if self.spread is not None and local_fut is not None:
            # the next local save waits for this step's peer copies; a promotion does not
            copies = inner._spawn(self.spread.after_local(local_fut, step, seq))
            with inner._lock:
                inner._save_fut = copies
        self.last_step, self.last_time = step, time.monotonic()
        if persistent and local_fut is not None:
            with inner._lock:
                inner._pins[step] += 1  # local retention must not delete what we copy
            with outer._lock:
                outer._inflight_step = step
                outer._last_saved_step = step
                outer._last_save_time = time.monotonic()
                outer._save_fut = outer._spawn(self._promote(local_fut, step, force, seq))
        return True

    async def _promote(self, local_fut: Any, step: int, overwrite: bool, seq: int) -> None:
        inner, outer = self.inner, self.outer
        src, dst = inner._url(step), outer._url(step)
        try:
            try:
                await asyncio.wrap_future(local_fut)
            except BaseException:
                # The local save's own error is raised by the local tier (wait / next save).
                log.warning("%s: step %d not promoted: its local save failed", outer.root, step)
                return
            await outer._create_root_record()  # here, not in the loop's thread: S3 may be down
            inc = outer._inc  # incremental: upload only what the persistent tier lacks
            if inc is not None and not inc.started:
                latest = outer._latest()
                name = None if latest is None else outer._fmt.name(latest)
                await inc.start(outer._backend, name)
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
                )(
                    src,
                    dst,
                    coord,
                    overwrite=overwrite,
                    src_options=inner._storage_options,
                    dst_options=outer._storage_options,
                )
            else:
                await (copy_checkpoint if inc is None else functools.partial(promote, inc=inc))(
                    src,
                    dst,
                    overwrite=overwrite,
                    src_options=inner._storage_options,
                    dst_options=outer._storage_options,
                )
            with inner._lock:
                info = inner._committed.get(step)
            metrics = dict(info.metrics) if info is not None else {}
        except BaseException as e:
            e.add_note(f"(background promotion of step {step} from {src} to {dst})")
            raise
        finally:
            with outer._lock:
                outer._inflight_step = None
            self.inner._unpin(step)
        await outer._after_commit(step, metrics)  # the persistent tier counts the step now

    # ------------------------------------------------------------------ reading
    def steps(self) -> list[int]:
        return self.inner.steps()

    def load(
        self, step: int | None, fn: Callable[[str], Any], fallback: Callable[[int], Any]
    ) -> Any:
        """Load ``step`` from the local tier if it holds it, else ``fallback(step)``."""
        if step is None or step not in self.inner.steps():
            return fallback(step)  # type: ignore[arg-type]
        try:
            return self.inner._load(step, fn)
        except (CorruptCheckpointError, FileNotFoundError) as e:
            if step not in self.outer.steps():
                raise
            log.warning(
                "%s: step %d is damaged in the local tier (%s); loading it from the persistent "
                "tier %s",
                self.url,
                step,
                e,
                self.outer.root,
            )
            return fallback(step)

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            if self.spread is not None:
                self.spread.close()
            if self.policy is not None:
                self.policy.detach()


class _TierMixin:
    """The tier-aware reading methods of ``Checkpointer`` (the plain ones without a tier)."""

    if TYPE_CHECKING:
        _tier: _Tier | None

    def steps(self) -> list[int]:
        """Committed steps, ascending, in any tier (as of the last listing plus own saves)."""
        own: list[int] = super().steps()  # type: ignore[misc]
        if self._tier is None:
            return own
        return sorted(set(own) | set(self._tier.steps()))

    def latest_step(self) -> int | None:
        """The highest step committed in any tier (its local tier included), or None."""
        if self._tier is None:
            return super().latest_step()  # type: ignore[misc, no-any-return]
        if self._tier.spread is not None:  # agreed by every process (collective)
            plan = self._tier.spread.agree(None, super().steps())  # type: ignore[misc]
            return None if plan is None else plan.step
        steps = self.steps()
        return steps[-1] if steps else None

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
        step = _as_step(step)
        out = []
        if self._tier is not None and step in self._tier.steps():
            out.append(LOCAL)
        if step in super().steps():  # type: ignore[misc]
            out.append(PERSISTENT)
        return tuple(out)

    def reload(self) -> None:
        """List the roots again (every tier), to see steps written or deleted by others."""
        if self._tier is not None:
            self._tier.inner.reload()
        super().reload()  # type: ignore[misc]

    def _load(self, step: Any, fn: Callable[[str], Any], *, agreed: bool = False) -> Any:
        plain = super()._load  # type: ignore[misc]
        if self._tier is None:
            return plain(step, fn, agreed=agreed)
        self._tier.inner._wait_save()  # a step being saved locally counts once committed
        if self._tier.spread is not None:
            s = _as_step(step) if step is not None else None
            persistent = super().steps()  # type: ignore[misc]
            return self._tier.spread.load(s, fn, lambda st: plain(st, fn, agreed=True), persistent)
        s = _as_step(step) if step is not None else self.latest_step()
        return self._tier.load(s, fn, lambda st: plain(st, fn))
