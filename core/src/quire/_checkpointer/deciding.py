"""Whether a tier saves at a step: a :class:`SaveDecider` per tier (its save policy and
when it last saved), and the preemption notice of the policies."""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import threading
import time
from collections.abc import Iterable
from typing import Any

import jax

from quire._checkpointer.save_policies import OnPreemption, SaveContext, SavePolicy
from quire._runtime.collective import kv_broadcast
from quire._runtime.config import current

#: Deciders made per name, in call order: the same count in every process (Checkpointers
#: open in the same order everywhere), so that two on one root never share their keys.
_opened: collections.Counter[str] = collections.Counter()


class SaveDecider:
    """A tier's save decision: its policy, asked with the steps the caller has seen.

    Parameters
    ----------
    policy : SavePolicy or None
        The tier's save policy.
    last_step : int or None
        What the policy sees as the last saved step until the first :meth:`saved` (the
        latest step found at opening).
    without_policy : bool
        The answer for a step above the floor when ``policy`` is None.
    follow_primary : bool
        With several JAX processes, a policy that is not ``deterministic`` (time, signals)
        may answer differently in each: every process then follows process 0's answer (a
        collective, so every process must ask; a process that does not within
        ``quire.configure(timeout=...)`` makes the others raise ``MultiProcessError``
        naming it).
    name : str
        What the processes' agreement is named after (the root's URL), the same in every
        process.
    """

    def __init__(
        self,
        policy: SavePolicy | None,
        last_step: int | None,
        *,
        without_policy: bool,
        follow_primary: bool,
        name: str = "",
    ) -> None:
        self.policy = policy
        self.last_step = last_step
        self.last_time = time.monotonic()
        self._lock = threading.Lock()  # saved() and a failed save's undo (quire's loop)
        self._without_policy = without_policy
        self._follow_primary = follow_primary
        self._name = name
        _opened[name] += 1
        tag = f"{name}#{_opened[name]}".encode()
        self._key = f"quire/decide/{hashlib.sha256(tag).hexdigest()[:16]}"
        self._round = 0

    def due(self, step: int, *floors: int | None) -> bool:
        """Whether to save at ``step``: never at or below a floor (the highest step the
        caller holds or is saving; None: none) or the last saved step, else the policy's
        answer.  Asking has no side effect (but may be a collective: ``follow_primary``)."""
        seen = [s for s in (*floors, self.last_step) if s is not None]
        ctx = SaveContext(step, self.last_step, self.last_time, time.monotonic())
        if seen and step <= max(seen):
            answer = False
        elif self.policy is None:
            answer = self._without_policy
        else:
            answer = bool(self.policy.should_save(ctx))
        policy = self.policy
        if (
            self._follow_primary
            and policy is not None
            and not policy.deterministic
            and jax.process_count() > 1
        ):
            # Time- and signal-based answers may differ: every process follows process 0.
            answer = self._follow(answer)
        return answer

    def _follow(self, answer: bool) -> bool:
        """Process 0's answer, once every process has asked (through the key-value store,
        with quire's deadline)."""
        self._round += 1
        key = f"{self._key}/{self._round}"
        drop = f"{self._key}/{self._round - 1}" if self._round > 1 else None
        timeout = current().timeout
        got = kv_broadcast(
            key,
            b"1" if answer else b"0",
            0,
            timeout if timeout is not None else 365 * 86400.0,
            self._name,
            "the save decision (every process follows process 0's policy: each must ask "
            "should_save / save at the same steps)",
            drop=drop,
        )
        return got == b"1"

    def saved(self, step: int, outcome: concurrent.futures.Future[Any] | None = None) -> None:
        """A save of ``step`` started (what the policy sees as the last save from now on).

        ``outcome``: the save's background future.  When it fails (raises, or returns
        False: nothing committed), the save does not count: unless a later save started
        meanwhile, the last save is again the one before."""
        with self._lock:
            before = (self.last_step, self.last_time)
            self.last_step, self.last_time = step, time.monotonic()
        if outcome is None:
            return

        def undo(fut: concurrent.futures.Future[Any]) -> None:
            if not fut.cancelled() and fut.exception() is None and fut.result() is not False:
                return
            with self._lock:
                if self.last_step == step:
                    self.last_step, self.last_time = before

        outcome.add_done_callback(undo)

    def attach(self) -> None:
        if self.policy is not None:
            self.policy.attach()

    def detach(self) -> None:
        if self.policy is not None:
            self.policy.detach()


def preempted(policies: Iterable[SavePolicy | None]) -> bool:
    """Whether an :class:`~quire.policies.OnPreemption` among ``policies`` (or inside a
    combination of them) received a notice."""
    parts = [q for p in policies for q in getattr(p, "policies", (p,))]
    return any(isinstance(q, OnPreemption) and q.preempted for q in parts)
