"""Keep policies of :class:`quire.Checkpointer` ("which committed steps survive?"),
published by :mod:`quire.policies` with the save policies (``save_policies``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from quire._checkpointer.save_policies import _positive_float, _positive_int


# ----------------------------------------------------------------------------- keeping
@dataclass(frozen=True)
class StepInfo:
    """A committed step, as keep policies see it.

    Attributes
    ----------
    step : int
    created : float
        Commit time (POSIX seconds).
    metrics : dict
        The ``metrics`` passed to ``Checkpointer.save`` (empty if none).
    """

    step: int
    created: float
    metrics: Mapping[str, Any] = field(default_factory=dict)


class KeepPolicy:
    """Base class of keep policies: override :meth:`keep`."""

    def keep(self, steps: Sequence[StepInfo], now: float) -> set[int]:
        """The steps this policy keeps.

        Subclasses override this method; their docstrings inherit this description.

        Parameters
        ----------
        steps : sequence of StepInfo
            The committed steps, sorted by step, with their commit time and metrics.
        now : float
            POSIX time.

        Returns
        -------
        set of int
            The step numbers to keep (the Checkpointer always keeps the latest too).
        """
        raise NotImplementedError

    def __or__(self, other: KeepPolicy) -> AnyKeep:
        if not isinstance(other, KeepPolicy):
            return NotImplemented
        return AnyKeep(self, other)


class AnyKeep(KeepPolicy):
    """Keep a step if any of ``policies`` keeps it (what ``a | b`` builds).

    Parameters
    ----------
    *policies : KeepPolicy
        The policies to combine.
    """

    policies: tuple[KeepPolicy, ...]

    def __init__(self, *policies: KeepPolicy) -> None:
        flat: list[KeepPolicy] = []
        for p in policies:
            if not isinstance(p, KeepPolicy):
                raise TypeError(f"not a keep policy: {p!r}")
            flat.extend(p.policies if isinstance(p, AnyKeep) else [p])
        self.policies = tuple(flat)

    def keep(self, steps: Sequence[StepInfo], now: float) -> set[int]:
        out: set[int] = set()
        for p in self.policies:
            out |= p.keep(steps, now)
        return out

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.policies))


class LatestN(KeepPolicy):
    """Keep the ``n`` highest steps.

    Parameters
    ----------
    n : int
        How many steps to keep (positive).
    """

    def __init__(self, n: int) -> None:
        self.n = _positive_int("LatestN(n)", n)

    def keep(self, steps: Sequence[StepInfo], now: float) -> set[int]:
        return {s.step for s in sorted(steps, key=lambda s: s.step)[-self.n :]}

    def __repr__(self) -> str:
        return f"LatestN({self.n})"


def _metric_value(info: StepInfo, metric: str) -> float | None:
    v = info.metrics.get(metric)
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        f = float(v)  # a record of an earlier version may hold an int no float holds
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


class BestN(KeepPolicy):
    """Keep the ``n`` steps with the best value of ``metric`` (``mode`` "max" or "min").

    Steps saved without that metric (or with one that was not a finite number: NaN, ±inf,
    an int no float holds, all stored as null) are not kept by this policy; ties go to the
    later step.

    Parameters
    ----------
    n : int
        How many steps to keep (positive).
    metric : str
        The name of a metric passed to ``Checkpointer.save``.
    mode : {"max", "min"}
        Whether a higher or a lower value is better.
    """

    def __init__(self, n: int, *, metric: str, mode: str = "max") -> None:
        self.n = _positive_int("BestN(n)", n)
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"BestN(metric=...) must name a metric, got {metric!r}")
        if mode not in ("max", "min"):
            raise ValueError(f"BestN(mode=...) must be 'max' or 'min', got {mode!r}")
        self.metric = metric
        self.mode = mode

    def ranked(self, steps: Sequence[StepInfo]) -> list[int]:
        """Steps having the metric, best first.

        Parameters
        ----------
        steps : sequence of StepInfo
            Committed steps with their metrics.

        Returns
        -------
        list of int
            Step numbers, best first; steps without the metric are left out.
        """
        scored = [(v, s.step) for s in steps if (v := _metric_value(s, self.metric)) is not None]
        sign = -1.0 if self.mode == "max" else 1.0
        scored.sort(key=lambda vs: (sign * vs[0], -vs[1]))
        return [step for _, step in scored]

    def keep(self, steps: Sequence[StepInfo], now: float) -> set[int]:
        return set(self.ranked(steps)[: self.n])

    def __repr__(self) -> str:
        return f"BestN({self.n}, metric={self.metric!r}, mode={self.mode!r})"


class KeepEveryNSteps(KeepPolicy):
    """Keep for good every step that is a multiple of ``n``.

    Parameters
    ----------
    n : int
        The interval in steps (positive).
    """

    def __init__(self, n: int) -> None:
        self.n = _positive_int("KeepEveryNSteps(n)", n)

    def keep(self, steps: Sequence[StepInfo], now: float) -> set[int]:
        return {s.step for s in steps if s.step % self.n == 0}

    def __repr__(self) -> str:
        return f"KeepEveryNSteps({self.n})"


class KeepForSeconds(KeepPolicy):
    """Keep every step committed less than ``seconds`` ago.

    Parameters
    ----------
    seconds : float
        The age limit (positive).
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = _positive_float("KeepForSeconds(seconds)", seconds)

    def keep(self, steps: Sequence[StepInfo], now: float) -> set[int]:
        return {s.step for s in steps if now - s.created < self.seconds}

    def __repr__(self) -> str:
        return f"KeepForSeconds({self.seconds:g})"
