"""Save policies of :class:`quire.Checkpointer` ("save at this step?"), published by
:mod:`quire.policies` with the keep policies (``keep_policies``)."""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("quire")


def _positive_int(name: str, n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must be a positive int, got {n!r}")
    return n


def _positive_float(name: str, s: Any) -> float:
    if isinstance(s, bool) or not isinstance(s, int | float) or not s > 0 or math.isinf(s):
        raise ValueError(f"{name} must be a positive number of seconds, got {s!r}")
    return float(s)


# ----------------------------------------------------------------------------- saving
@dataclass(frozen=True)
class SaveContext:
    """What a save policy sees.

    Attributes
    ----------
    step : int
        The step asked about.
    last_saved_step : int or None
        The last step this Checkpointer saved (or, before its first save, the latest
        committed step found under the root).
    last_save_time : float
        ``time.monotonic()`` of this Checkpointer's last save, or of its opening.
    now : float
        ``time.monotonic()`` now.
    """

    step: int
    last_saved_step: int | None
    last_save_time: float
    now: float


class SavePolicy:
    """Base class of save policies: override :meth:`should_save`.

    ``deterministic`` is False for policies whose answer may differ between processes
    (time, signals); the Checkpointer then takes process 0's answer in multi-process runs.
    """

    deterministic: bool = True

    def should_save(self, ctx: SaveContext) -> bool:
        """Whether to save at ``ctx.step``. Must not change state: it may be asked twice.

        Subclasses override this method; their docstrings inherit this description.

        Parameters
        ----------
        ctx : SaveContext
            The step, the time now and of the last save, and the latest committed step.

        Returns
        -------
        bool
            True to save at this step.
        """
        raise NotImplementedError

    def attach(self) -> None:
        """Called when a Checkpointer starts using the policy (e.g. install a handler)."""

    def detach(self) -> None:
        """Called when that Checkpointer closes."""

    def __or__(self, other: SavePolicy) -> AnySave:
        if not isinstance(other, SavePolicy):
            return NotImplemented
        return AnySave(self, other)


class AnySave(SavePolicy):
    """Save when any of ``policies`` says so (what ``a | b`` builds).

    Parameters
    ----------
    *policies : SavePolicy
        The policies to combine.
    """

    policies: tuple[SavePolicy, ...]

    def __init__(self, *policies: SavePolicy) -> None:
        flat: list[SavePolicy] = []
        for p in policies:
            if not isinstance(p, SavePolicy):
                raise TypeError(f"not a save policy: {p!r}")
            flat.extend(p.policies if isinstance(p, AnySave) else [p])
        self.policies = tuple(flat)
        self.deterministic = all(p.deterministic for p in flat)

    def should_save(self, ctx: SaveContext) -> bool:
        # Ask every policy (no short-circuit): some keep per-step caches of collective answers.
        answers = [p.should_save(ctx) for p in self.policies]
        return any(answers)

    def attach(self) -> None:
        for p in self.policies:
            p.attach()

    def detach(self) -> None:
        for p in self.policies:
            p.detach()

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.policies))


class EveryNSteps(SavePolicy):
    """Save at every step that is a multiple of ``n``.

    Parameters
    ----------
    n : int
        The interval in steps (positive).
    """

    def __init__(self, n: int) -> None:
        self.n = _positive_int("EveryNSteps(n)", n)

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step % self.n == 0

    def __repr__(self) -> str:
        return f"EveryNSteps({self.n})"


class EveryNSeconds(SavePolicy):
    """Save at the first step at least ``seconds`` after the previous save (or the start).

    Parameters
    ----------
    seconds : float
        The minimum time between saves (positive).
    """

    deterministic = False

    def __init__(self, seconds: float) -> None:
        self.seconds = _positive_float("EveryNSeconds(seconds)", seconds)

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.now - ctx.last_save_time >= self.seconds

    def __repr__(self) -> str:
        return f"EveryNSeconds({self.seconds:g})"


class SpecificSteps(SavePolicy):
    """Save at exactly these steps (e.g. the last one).

    Parameters
    ----------
    steps : iterable of int
        The steps to save at.
    """

    def __init__(self, steps: Iterable[int]) -> None:
        self.steps = frozenset(int(s) for s in steps)

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step in self.steps

    def __repr__(self) -> str:
        return f"SpecificSteps({sorted(self.steps)})"


class OnPreemption(SavePolicy):
    """Save at the next step after a preemption notice.

    A notice is a SIGTERM to this process (a handler is installed while a Checkpointer uses
    the policy; a Python handler that was there before is still called), or JAX's
    preemption sync point (``multihost_utils.reached_preemption_sync_point``) when the
    distributed runtime's preemption service is on — then JAX owns SIGTERM and all
    processes agree on the step.  SIGTERM no longer ends the process: check
    :attr:`quire.Checkpointer.preempted` and leave the training loop after the save.
    """

    deterministic = False

    def __init__(self) -> None:
        self.notice_time: float | None = None  # time.monotonic() of the last notice
        self._previous: Any = None
        self._installed = False
        self._attached = 0
        self._sync_unavailable = False
        self._sync_cache: tuple[int, bool] | None = None

    # -- SIGTERM -----------------------------------------------------------------
    def _handler(self, signum: int, frame: Any) -> None:
        self.notice_time = time.monotonic()
        prev = self._previous
        if callable(prev):
            prev(signum, frame)

    @staticmethod
    def _jax_owns_sigterm() -> bool:
        try:
            from jax._src import distributed

            return distributed.global_state.preemption_sync_manager is not None
        except (ImportError, AttributeError):  # a JAX without that (private) manager
            return False

    def attach(self) -> None:
        self._attached += 1
        if self._installed or self._jax_owns_sigterm():
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "OnPreemption: not in the main thread, so no SIGTERM handler was installed; "
                "only JAX's preemption sync point is consulted"
            )
            return
        self._previous = signal.signal(signal.SIGTERM, self._handler)
        self._installed = True

    def detach(self) -> None:
        self._attached = max(0, self._attached - 1)
        if self._attached or not self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            return
        # Put the old handler back only if nobody installed theirs on top of ours since.
        if signal.getsignal(signal.SIGTERM) == self._handler:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def notify(self) -> None:
        """Record a preemption notice by hand (what the SIGTERM handler does)."""
        self.notice_time = time.monotonic()

    # -- JAX's preemption service ------------------------------------------------
    def _reached_sync_point(self, step: int) -> bool:
        if self._sync_unavailable:
            return False
        if self._sync_cache is not None and self._sync_cache[0] == step:
            return self._sync_cache[1]
        try:
            from jax.experimental import multihost_utils

            got = bool(multihost_utils.reached_preemption_sync_point(step))
        except Exception:  # no distributed runtime, or no preemption service
            self._sync_unavailable = True
            return False
        self._sync_cache = (step, got)
        return got

    @property
    def preempted(self) -> bool:
        """Whether a preemption notice arrived (SIGTERM or JAX's sync point)."""
        return self.notice_time is not None

    def should_save(self, ctx: SaveContext) -> bool:
        if self._reached_sync_point(ctx.step):
            self.notice_time = self.notice_time or time.monotonic()
            return True
        t = self.notice_time
        return t is not None and t >= ctx.last_save_time

    def __repr__(self) -> str:
        return "OnPreemption()"
