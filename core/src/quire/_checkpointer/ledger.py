"""What one Checkpointer root holds, as this process knows it: the :class:`StepLedger`.

The ledger is state only (no I/O, no background work): the committed steps (with their
:class:`~quire.policies.StepInfo` once read), the steps being deleted, the pins of steps
being loaded, the step being saved.  Its owner (``quire._checkpointer.steproot.StepRoot``)
reads and writes the storage and tells the ledger what happened; every method takes the
ledger's own lock, so the caller's thread and quire's event loop may both use it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import operator
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from quire._checkpointer.keep_policies import StepInfo

log = logging.getLogger("quire")


def as_step(step: Any) -> int:
    """``step`` as a non-negative int (``TypeError`` / ``ValueError`` otherwise; a bool is
    an argument slip, not step 0 or 1)."""
    try:
        if isinstance(step, bool):  # (numpy's bool has no __index__)
            raise TypeError
        s = operator.index(step)
    except TypeError:
        raise TypeError(f"a step must be an int, got {type(step).__name__} {step!r}") from None
    if s < 0:
        raise ValueError(f"steps are non-negative ints, got {s}")
    return s


_MAX_FLOAT = int(sys.float_info.max)


def clean_metrics(metrics: Mapping[str, Any] | None, step: int) -> dict[str, Any]:
    """Metrics as JSON: numbers (numpy / JAX scalars included) become Python numbers; one
    that is not a finite float (NaN, ±inf, an int past float's range) is stored as null,
    with a warning."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a dict of {{name: number}}, got {type(metrics).__name__}")
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise TypeError(f"metric names must be str, got {k!r}")
        if v is None or isinstance(v, bool | str):
            out[k] = v
            continue
        if hasattr(v, "item") and getattr(v, "size", 1) == 1:
            v = v.item()  # numpy / JAX scalars
        if (isinstance(v, int) and abs(v) <= _MAX_FLOAT) or (
            isinstance(v, float) and math.isfinite(v)
        ):
            out[k] = v
        elif isinstance(v, int | float):  # NaN, ±inf, an int no float holds
            what = f"an int of {v.bit_length()} bits" if isinstance(v, int) else repr(v)
            log.warning("step %d: metric %r is %s; stored as null", step, k, what)
            out[k] = None
        else:
            raise TypeError(
                f"metric {k!r} must be a number (or str, bool, None), got {type(v).__name__}"
            )
    return out


class StepLedger:
    """The steps of one root: committed, being deleted, pinned, being saved.

    A step is *live* when it is committed and not being deleted.  A pinned step (being
    loaded) is never chosen for deletion; a deletion that had to pass one over is
    *deferred*, and :meth:`unpin` says when it is due again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._committed: dict[int, StepInfo | None] = {}  # None: record not read yet
        self._deleting: set[int] = set()
        self._pins: collections.Counter[int] = collections.Counter()
        self._deferred = False
        self._inflight: int | None = None

    # ------------------------------------------------------------------ listing
    def replace(self, found: Iterable[int]) -> None:
        """The root was listed: these steps are committed (infos already read are kept)."""
        with self._lock:
            self._committed = {s: self._committed.get(s) for s in sorted(set(found))}

    async def fill(self, read: Callable[[int], Awaitable[StepInfo | None]]) -> None:
        """Read the infos not read yet with ``read(step)`` (None: the step is gone)."""
        with self._lock:
            todo = [s for s, info in self._committed.items() if info is None]

        async def one(step: int) -> None:
            info = await read(step)
            with self._lock:
                if info is None:  # deleted by someone else
                    self._committed.pop(step, None)
                elif step in self._committed:
                    self._committed[step] = info

        await asyncio.gather(*(one(s) for s in todo))

    def live(self) -> list[int]:
        """Committed steps not being deleted, ascending."""
        with self._lock:
            return sorted(s for s in self._committed if s not in self._deleting)

    def latest(self) -> int | None:
        """The highest live step, or None."""
        with self._lock:
            return self._latest()

    def _latest(self) -> int | None:
        live = [s for s in self._committed if s not in self._deleting]
        return max(live) if live else None

    def floor(self) -> int | None:
        """The highest step committed or being saved (no save may go at or below it)."""
        with self._lock:
            seen = [s for s in (self._latest(), self._inflight) if s is not None]
            return max(seen) if seen else None

    def info(self, step: int) -> StepInfo | None:
        """``step``'s info, or None if it is not read yet or not committed."""
        with self._lock:
            return self._committed.get(step)

    def infos(self) -> list[StepInfo]:
        """The infos read of the live steps."""
        with self._lock:
            return [
                i for s, i in self._committed.items() if i is not None and s not in self._deleting
            ]

    def being_deleted(self, step: int) -> bool:
        with self._lock:
            return step in self._deleting

    # ------------------------------------------------------------------ saving
    def start(self, step: int) -> None:
        """A save of ``step`` is in flight (before it may finish: call first)."""
        with self._lock:
            self._inflight = step

    def committed(self, info: StepInfo) -> None:
        """The save in flight committed ``info.step``."""
        with self._lock:
            self._committed[info.step] = info
            self._inflight = None

    def abandoned(self) -> None:
        """The save in flight did not commit."""
        with self._lock:
            self._inflight = None

    # ------------------------------------------------------------------ loading
    def pin(self, step: int | None) -> tuple[int | None, bool]:
        """Pin ``step`` (None: the latest) against deletion; return it (None: no step, not
        pinned) and whether it was already being deleted.  Undo with :meth:`unpin`."""
        with self._lock:
            s = step if step is not None else self._latest()
            if s is None:
                return None, False
            self._pins[s] += 1
            return s, s in self._deleting

    def unpin(self, step: int) -> bool:
        """Drop one pin of ``step``; True when a deferred deletion is due now (no pin left)."""
        with self._lock:
            self._pins[step] -= 1
            if not self._pins[step]:
                del self._pins[step]
            retry = self._deferred and not self._pins
            if retry:
                self._deferred = False
            return retry

    def protected(self) -> set[int]:
        """Steps garbage collection must leave alone: deleting, pinned, being saved."""
        with self._lock:
            out = set(self._deleting) | {s for s, n in self._pins.items() if n}
            if self._inflight is not None:
                out.add(self._inflight)
            return out

    # ------------------------------------------------------------------ deleting
    def choose_victims(self, keep: Callable[[list[StepInfo]], set[int]]) -> list[int]:
        """Mark for deletion the live steps ``keep(infos of the live steps)`` leaves out,
        except the latest, the one being saved and the pinned ones (then the deletion is
        deferred: :meth:`unpin` says when); return them, ascending."""
        with self._lock:
            live = sorted(s for s in self._committed if s not in self._deleting)
            if not live:
                return []
            kept = set(keep([i for s in live if (i := self._committed[s]) is not None]))
            kept.add(live[-1])  # never the latest committed step
            if self._inflight is not None:
                kept.add(self._inflight)
            victims = [s for s in live if s not in kept]
            self._deferred = any(self._pins[s] for s in victims)
            victims = [s for s in victims if not self._pins[s]]
            self._deleting.update(victims)
            return victims

    def deleted(self, step: int) -> None:
        """``step`` is gone (its record deleted)."""
        with self._lock:
            self._committed.pop(step, None)
            self._deleting.discard(step)

    def kept(self, step: int) -> None:
        """The deletion of ``step`` failed: it is live again."""
        with self._lock:
            self._deleting.discard(step)
