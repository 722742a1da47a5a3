"""The agreed restore of a multi-process local tier, as data: each process's view of its
holdings, and the step and sources every process computes from all the views (the same
answer everywhere, without further messages).

A **view** (one per process, exchanged by ``quire._tiers.spread.Spread.agree``):
``{"steps": {"<step>": {"d": record digest, "need": owners, "held": owners held here}},
"persistent": [steps the persistent tier lists]}``.  Who holds what comes only from the
views, that is from each root's markers (``quire._tiers.ownership.holds``), never from
where the copies were meant to go (``quire._tiers.placement``): a copy that failed
is simply not held.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

from quire._engine import commit as _commit
from quire._format import record as _records
from quire._format.untrusted import untrusted_json
from quire.errors import CorruptCheckpointError, MultiProcessError

__all__ = [
    "PERSISTENT_SOURCE",
    "RestorePlan",
    "agreed_doc",
    "decide",
    "holders",
    "need",
    "parse_view",
    "record_digest",
    "self_contained",
    "sources",
]

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
    """The view process ``process`` (of ``count``) published, checked: its shape, step
    numbers, digests as strings, owners as process indexes; nothing else.

    Raises
    ------
    MultiProcessError
        It is not such a view (the message names the process and what is wrong).
    """
    try:
        doc = untrusted_json(raw)
        if not isinstance(doc, dict) or set(doc) != {"steps", "persistent"}:
            raise ValueError("not an object of 'steps' and 'persistent'")
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
    return {"steps": out, "persistent": persistent}


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
            return [int(j) for j in info["need"]]
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
