"""The worker's half of the multi-process harness (the parent's is ``harness.py``).

A worker script launched by ``harness.launch`` or ``harness.Group`` calls ``init()`` once,
before it uses JAX: it reads the process index, the process count, the coordinator's address
and the device count the harness put in its environment, and joins the others with
``jax.distributed.initialize`` (when there is more than one process).  It reports each result
with ``report(...)``: one ``QUIRE-MH {json}`` line on stdout, flushed at once, which the parent
collects.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

PREFIX = "QUIRE-MH "


@dataclass(frozen=True)
class Me:
    """This worker's place in its launch."""

    process: int
    processes: int
    devices: int | None


_me: Me | None = None


def init(**options: Any) -> Me:
    """Join the launch: ``jax.distributed.initialize`` on the harness's coordinator.

    ``options`` go to ``jax.distributed.initialize`` (``initialization_timeout``,
    ``heartbeat_timeout_seconds``, ...).  One process alone starts no distributed service.
    """
    global _me
    env = os.environ
    devices = env.get("QUIRE_MH_DEVICES")
    ndev = int(devices) if devices else None
    _me = Me(int(env["QUIRE_MH_PROCESS"]), int(env["QUIRE_MH_PROCESSES"]), ndev)
    import jax

    if _me.processes > 1:
        jax.distributed.initialize(
            env["QUIRE_MH_COORDINATOR"],
            num_processes=_me.processes,
            process_id=_me.process,
            **options,
        )
    return _me


def report(**fields: Any) -> None:
    """One result line for the parent: ``fields`` with this process's index as ``pid``."""
    assert _me is not None, "call init() first"
    print(PREFIX + json.dumps({"pid": _me.process, **fields}), flush=True)
