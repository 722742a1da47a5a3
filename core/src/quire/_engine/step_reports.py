"""What ``quire ls`` reports of a Checkpointer root's steps: state, size, age, metrics
(reads listings and commit records only; garbage is ``quire._engine.garbage``'s)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from quire._engine import commit as _commit
from quire._format.root import (
    StepDir,
    StepFormat,
    folders,
    list_root,
    newest,
    record_metrics,
    sizes,
)
from quire._store.base import Backend
from quire.errors import QuireError


async def read_step_record(backend: Backend, url: str, name: str) -> dict[str, Any] | None:
    """The parsed ``quire.json`` of step directory ``name``; None if it vanished."""
    rec = await _commit.read_if_exists(backend, url, under=name)
    return rec.doc if rec is not None else None


# ----------------------------------------------------------------------------- quire ls
@dataclass(frozen=True)
class StepReport:
    """One line of ``quire ls``."""

    name: str
    step: int
    state: str
    nbytes: int
    age: float | None  # seconds since commit (committed) or since the newest write
    metrics: dict[str, Any]
    error: str = ""


async def describe(backend: Backend, url: str, fmt: StepFormat) -> list[StepReport]:
    listing = await list_root(backend, fmt)
    now = time.time()

    async def one(sd: StepDir) -> StepReport:
        nbytes = await sizes(backend, sd.keys)
        metrics: dict[str, Any] = {}
        age: float | None = None
        error = ""
        state = sd.state
        if state == "committed":
            try:
                doc = await read_step_record(backend, url, sd.name)
            except QuireError as e:
                doc, error = None, str(e).splitlines()[0]
            if doc is not None:
                metrics = record_metrics(doc)
                age = now - doc["_created"].timestamp()
        else:  # folders holding no object (a save killed as it made them): their age
            t = await newest(backend, sd.keys or await folders(backend, sd.name))
            age = None if t is None else now - t
        return StepReport(sd.name, sd.step, state, nbytes, age, metrics, error)

    return list(await asyncio.gather(*(one(sd) for sd in listing.steps)))
