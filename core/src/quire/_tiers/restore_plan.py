"""The restore every process of a Checkpointer agrees on: each process's view of the tiers,
exchanged once with a deadline, and the step and sources every process computes from all
the views alike (the same answer everywhere, without further messages).

A **view** (one per process, as it sees the tiers right before the agreement):
``{"want": the step it asked for (None: the newest), "steps": {"<step>": {"d": record digest,
"need": owners, "held": owners held here}}, "persistent": [steps the persistent tier
lists]}``.  ``steps`` are the local tier's: with several processes, who holds what comes
only from each root's markers (``quire._tiers.ownership.holds``), never from where the
copies were meant to go (``quire._tiers.placement``): a copy that failed is simply not held.
A Checkpointer without a local tier has none; one process holds its local steps whole.

:func:`plan_restore` is the decision, a pure function of the views; :class:`Agreement`
exchanges them (through the key-value store, with quire's deadline) and decides.  Every
restore of a Checkpointer goes through it: the persistent root alone, a local tier of one
process, a local tier of several (``quire._tiers.spread``).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
from collections.abc import Sequence
from typing import Any

import jax

from quire._engine import commit as _commit
from quire._format import record as _records
from quire._format.untrusted import untrusted_json
from quire._runtime.collective import kv_exchange
from quire._runtime.config import current
from quire._runtime.multihost import Coordinator
from quire.errors import CorruptCheckpointError, MultiProcessError, QuireError

__all__ = [
    "PERSISTENT_SOURCE",
    "Agreement",
    "RestorePlan",
    "agreed_doc",
    "decide",
    "holders",
    "need",
    "parse_view",
    "plan_restore",
    "record_digest",
    "self_contained",
    "sources",
    "view",
]

log = logging.getLogger("quire")

PERSISTENT_SOURCE = -1  # a source meaning "the persistent tier"


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """A restore agreed by every process: the step, the record digest (None: the
    persistent tier's record, read at restore), and each process's view."""

    step: int
    digest: str | None
    views: tuple[dict[str, Any], ...]


def _owners(value: Any, count: int, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(j) is int and 0 <= j < count for j in value):
        raise ValueError(f"{what} is not a list of process indexes below {count}")
    return list(value)


def _steps(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(s) is int and s >= 0 for s in value):
        raise ValueError(f"{what} is not a list of step numbers")
    return list(value)


def parse_view(raw: bytes, process: int, count: int) -> dict[str, Any]:
    """The view process ``process`` (of ``count``) published, checked: its shape, the step
    it asks for, step numbers, digests as strings, owners as process indexes; nothing else.

    Raises
    ------
    MultiProcessError
        It is not such a view (the message names the process and what is wrong).
    """
    try:
        doc = untrusted_json(raw)
        if not isinstance(doc, dict) or set(doc) - {"want"} != {"steps", "persistent"}:
            raise ValueError("not an object of 'want', 'steps' and 'persistent'")
        want = doc.get("want")
        if want is not None and (type(want) is not int or want < 0):
            raise ValueError("'want' is not a step number")
        steps = doc["steps"]
        if not isinstance(steps, dict):
            raise ValueError("'steps' is not an object")
        out: dict[str, Any] = {}
        for s, info in steps.items():
            if not (s.isascii() and s.isdigit()) or str(int(s)) != s:
                raise ValueError(f"step {s[:40]!r} is not a step number")
            if not isinstance(info, dict) or set(info) != {"d", "need", "held"}:
                raise ValueError(f"step {s}: not an object of 'd', 'need' and 'held'")
            if not isinstance(info["d"], str) or len(info["d"]) > 128:
                raise ValueError(f"step {s}: its digest is not a short string")
            out[s] = {
                "d": info["d"],
                "need": _owners(info["need"], count, f"step {s}: 'need'"),
                "held": _owners(info["held"], count, f"step {s}: 'held'"),
            }
        persistent = _steps(doc["persistent"], "'persistent'")
    except ValueError as e:
        raise MultiProcessError(
            f"process {process} published a malformed view of its local tier ({e}); quire "
            "publishes JSON of its steps: does another program write to the run's "
            "coordination service?"
        ) from None
    asks = {"want": want} if "want" in doc else {}
    return {**asks, "steps": out, "persistent": persistent}


def record_digest(raw: bytes) -> str:
    """A commit record's digest, as processes compare them when agreeing on a step."""
    return hashlib.sha256(raw).hexdigest()[:32]


def agreed_doc(raw: bytes, digest: str, url: str, step: int) -> dict[str, Any]:
    """The commit record ``raw`` parsed, once checked to be the agreed one (``digest``)."""
    if record_digest(raw) != digest:
        raise CorruptCheckpointError(
            f"{url}: the commit record received for step {step} is not the agreed one"
        )
    doc = _records.parse(raw, url)
    _commit.check_locations(doc["units"], url)
    return doc


def holders(views: Sequence[dict[str, Any]], step: int, digest: str) -> dict[int, list[int]]:
    """owner -> the processes holding its objects of ``step`` with record ``digest``."""
    out: dict[int, list[int]] = {}
    for p, v in enumerate(views):
        info = v["steps"].get(str(step))
        if info is not None and info["d"] == digest:
            for j in info["held"]:
                out.setdefault(int(j), []).append(p)
    return out


def need(views: Sequence[dict[str, Any]], step: int, digest: str) -> list[int]:
    """The owners of ``step`` (with record ``digest``): every process with objects in it."""
    for v in views:
        info = v["steps"].get(str(step))
        if info is not None and info["d"] == digest:
            return sorted(int(j) for j in info["need"])
    return []


def sources(views: Sequence[dict[str, Any]], step: int, digest: str) -> dict[int, int]:
    """owner -> who sends its objects: the least-loaded holder, else the persistent tier."""
    held = holders(views, step, digest)
    load: dict[int, int] = {}
    out: dict[int, int] = {}
    for j in need(views, step, digest):
        hs = held.get(j, [])
        if not hs:
            out[j] = PERSISTENT_SOURCE
            continue
        who = min(hs, key=lambda p: (load.get(p, 0), p != j, p))
        load[who] = load.get(who, 0) + 1
        out[j] = who
    return out


def self_contained(plan: RestorePlan) -> bool:
    """Whether every process holds every owner's objects of the plan's step (then no
    process reads from another)."""
    if plan.digest is None:
        return False
    held = holders(plan.views, plan.step, plan.digest)
    everyone = set(range(len(plan.views)))
    return all(everyone <= set(held.get(j, ())) for j in need(plan.views, plan.step, plan.digest))


def decide(views: Sequence[dict[str, Any]], want: int | None, primary: int) -> RestorePlan | None:
    """The step to restore (``want``, or the newest restorable), the same in every process.

    A step is restorable from the local tier when, for one record digest, every owner's
    objects have a holder; else when the persistent tier (as the primary lists it) has it.
    Ties between digests go to the smallest, so the answer depends on the views' contents
    only, not on the order of their entries.
    """
    persistent = {int(s) for s in views[primary]["persistent"]}
    local: dict[int, set[str]] = {}
    for v in views:
        for s, info in v["steps"].items():
            local.setdefault(int(s), set()).add(info["d"])
    steps = sorted(set(local) | persistent, reverse=True) if want is None else [want]
    for s in steps:
        for d in sorted(local.get(s, ())):
            if all(v != PERSISTENT_SOURCE for v in sources(views, s, d).values()):
                return RestorePlan(s, d, tuple(views))
        if s in persistent:
            return RestorePlan(s, None, tuple(views))
    return None


def view(
    want: int | None, persistent: Sequence[int], steps: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A process's view (see the module docstring): ``steps`` of the local tier, if any."""
    return {"want": want, "steps": dict(steps or {}), "persistent": sorted(persistent)}


def plan_restore(views: Sequence[dict[str, Any]], primary: int, root: str) -> RestorePlan | None:
    """The restore every process agrees on, from every process's view (a pure function).

    Returns the plan of the step asked for (each view's ``want``; None: the newest step every
    process can restore), or None when no tier lists a restorable one (a step asked for
    explicitly may still be read from the persistent tier, which its listing may not show
    yet: the caller's choice).

    Raises
    ------
    QuireError
        The processes asked for steps that do not resolve to one (an explicit step here, another
        there, or the newest elsewhere): every process raises the same.
    """
    # (a view without "want" asks for nothing: one found malformed, treated as holding nothing)
    asked = {v["want"] for v in views if "want" in v} or {None}
    wants = sorted(asked, key=lambda w: -1 if w is None else w)
    plans = {w: decide(views, w, primary) for w in wants}
    chosen = {w: (p.step if p is not None else w) for w, p in plans.items()}
    if len(set(chosen.values())) > 1:
        who = collections.defaultdict(list)
        for i, v in enumerate(views):
            if "want" in v:
                who[v["want"]].append(i)
        said = "; ".join(
            f"process{'es' if len(ps) > 1 else ''} {', '.join(map(str, ps))} asked for "
            + (f"step {w}" if w is not None else f"the newest ({chosen[w] or 'none'})")
            for w, ps in who.items()
        )
        raise QuireError(
            f"processes disagree on the step of {root} to restore ({said}); they see "
            "different sets of steps: call reload() on every process, or pass the step "
            "explicitly, the same on every process"
        )
    return plans[wants[0]]


#: Agreements made per name, in call order: the same count in every process (Checkpointers
#: open in the same order everywhere), so that a later Checkpointer on the same root never
#: meets an earlier one's keys (they stay).
_opened: collections.Counter[str] = collections.Counter()


class Agreement:
    """The one way a Checkpointer's processes agree on a restore: every process's view,
    exchanged once through JAX's key-value store (a few kilobytes each, nothing to compile),
    within ``quire.configure(timeout=...)``; then :func:`plan_restore` in every process.
    Collective: every process calls :meth:`decide` the same number of times, in order.

    Parameters
    ----------
    name : str
        What the exchanges are named after, the same in every process (the root's URL).
    primary : int
        The process whose listing of the persistent tier counts.
    """

    def __init__(self, name: str, primary: int) -> None:
        _opened[name] += 1
        self.name = f"{name}#{_opened[name]}"
        self.primary = primary
        self._seq = 0

    def decide(self, mine: dict[str, Any], url: str, root: str, what: str) -> RestorePlan | None:
        """The agreed plan (see :func:`plan_restore`) from this process's view ``mine``
        (blocking; ``url``: this process's root, ``root``: the Checkpointer's, for messages).

        Raises
        ------
        MultiProcessError
            A process did not take part within the timeout (named; it is treated as lost).
        QuireError
            The processes asked for different steps.
        """
        self._seq += 1
        count = jax.process_count()
        if count == 1:
            return plan_restore([mine], self.primary, root)
        t = current().timeout
        t = t if t is not None else 365 * 86400.0
        key = Coordinator(
            self.name, "x", primary=self.primary, timeout=None, name=f"{self.name}/{self._seq}"
        ).key
        try:
            rows = kv_exchange(key, list(range(count)), json.dumps(mine).encode(), t, url, what)
        except MultiProcessError as e:
            raise MultiProcessError(
                f"{e}; it is treated as lost (quire.configure(timeout=...))"
            ) from e
        views = []
        for p, r in enumerate(rows):
            try:
                views.append(parse_view(r, p, count))
            except MultiProcessError as e:  # as in every process that reads this row
                log.warning("%s: %s; it is treated as holding nothing", url, e)
                views.append({"steps": {}, "persistent": []})
        return plan_restore(views, self.primary, root)
