"""Whether ``quire.Checkpointer`` saves at a step: its save policy (or, with a local tier,
either tier's), agreed by every process, and the preemption notice (mixed into
``Checkpointer``; see ``quire._checkpointer.checkpointer`` for threads and ordering)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.experimental import multihost_utils

from quire._checkpointer.retain import _as_step
from quire._checkpointer.save_policies import OnPreemption, SaveContext, SavePolicy

if TYPE_CHECKING:
    from quire._checkpointer.tiers import _Tier


class _DecideMixin:
    if TYPE_CHECKING:
        _lock: threading.RLock
        _save_policy: SavePolicy | None
        _last_saved_step: int | None
        _last_save_time: float
        _inflight_step: int | None
        _tier: _Tier | None

        def _latest(self) -> int | None: ...
        def _raise_background(self) -> None: ...

    def _decide(self, step: int, local_floor: int | None = None) -> bool:
        with self._lock:
            seen = (self._latest(), self._last_saved_step, self._inflight_step, local_floor)
            floor = max((s for s in seen if s is not None), default=None)
            ctx = SaveContext(step, self._last_saved_step, self._last_save_time, time.monotonic())
        if floor is not None and step <= floor:
            answer = False
        elif self._save_policy is None:
            answer = True
        else:
            answer = bool(self._save_policy.should_save(ctx))
        policy = self._save_policy
        if policy is not None and not policy.deterministic and jax.process_count() > 1:
            # Time- and signal-based answers may differ: every process follows process 0.
            answer = bool(multihost_utils.broadcast_one_to_all(np.asarray(answer)))
        return answer

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` would save at ``step``.

        False for a step at or below the latest committed or started one; otherwise the
        save policy's answer (True without a policy) or, with a local tier, either tier's
        policy's answer.  Asking has no side effect.

        Parameters
        ----------
        step : int
            The step number (non-negative).

        Returns
        -------
        bool
            Whether ``save(step, ...)`` would save (without ``force``).
        """
        self._raise_background()
        if self._tier is not None:
            return any(self._tier.due(_as_step(step)))
        return self._decide(_as_step(step))

    @property
    def preempted(self) -> bool:
        """Whether an :class:`~quire.policies.OnPreemption` policy received a notice.

        Check it right after a save: if it is True then, the saved state is the latest and
        the loop may stop (a notice arriving later makes the next step save).
        """
        ps = (self._save_policy, None if self._tier is None else self._tier.policy)
        parts = [q for p in ps for q in getattr(p, "policies", (p,))]
        return any(isinstance(q, OnPreemption) and q.preempted for q in parts)
