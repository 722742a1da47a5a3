"""Whether a tier saves at a step: a :class:`SaveDecider` per tier (its save policy and
when it last saved), and the preemption notice of the policies."""

from __future__ import annotations

import time
from collections.abc import Iterable

import jax
import numpy as np
from jax.experimental import multihost_utils

from quire._checkpointer.save_policies import OnPreemption, SaveContext, SavePolicy


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
        collective, so every process must ask).
    """

    def __init__(
        self,
        policy: SavePolicy | None,
        last_step: int | None,
        *,
        without_policy: bool,
        follow_primary: bool,
    ) -> None:
        self.policy = policy
        self.last_step = last_step
        self.last_time = time.monotonic()
        self._without_policy = without_policy
        self._follow_primary = follow_primary

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
            answer = bool(multihost_utils.broadcast_one_to_all(np.asarray(answer)))
        return answer

    def saved(self, step: int) -> None:
        """A save of ``step`` started (what the policy sees as the last save from now on)."""
        self.last_step, self.last_time = step, time.monotonic()

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
