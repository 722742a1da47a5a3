"""One process of a run where the processes must agree (tests/test_agreement_multihost.py).

    python agreement_worker.py <process id> <process count> <port> <json config>

Config: ``root`` (a persistent Checkpointer root shared by every process), ``timeout``
(quire's), ``absent`` (a process stuck before the agreement under test: it sleeps until the
test kills it), ``what``: ``decide`` (a save decision with a policy whose answer differs by process:
every process follows process 0's) or ``restore`` (``Checkpointer.load``).  Prints
``QUIRE-AGREE <json>`` lines: ``ok`` what the agreement gave, ``error`` what it raised and
after how many seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

pid, count, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cfg = json.loads(sys.argv[4])

import jax  # noqa: E402

jax.distributed.initialize(
    f"127.0.0.1:{port}", num_processes=count, process_id=pid, initialization_timeout=60
)

import numpy as np  # noqa: E402

import quire  # noqa: E402
from quire.policies import SaveContext, SavePolicy  # noqa: E402

quire.configure(timeout=cfg["timeout"])


def emit(**kw: object) -> None:
    print("QUIRE-AGREE " + json.dumps({"pid": pid, **kw}), flush=True)


class ByProcess(SavePolicy):
    """Says save on process 0 only: an answer that differs between processes, as a clock's."""

    deterministic = False

    def should_save(self, ctx: SaveContext) -> bool:
        return jax.process_index() == 0


def attempt(what: str, fn: object) -> None:
    t0 = time.monotonic()
    try:
        emit(check="ok", what=what, got=fn())  # type: ignore[operator]
    except quire.errors.QuireError as e:
        emit(check="error", what=what, type=type(e).__name__, error=str(e),
             seconds=time.monotonic() - t0)  # fmt: skip


try:
    c = quire.Checkpointer(cfg["root"], save_policy=ByProcess())
    attempt("first", lambda: c.should_save(1))  # every process present: process 0's answer
    c.save(1, {"x": np.arange(4) + 1})
    c.wait()
    if pid == cfg.get("absent"):  # stuck: never reaches the agreement (the test kills it)
        time.sleep(600)
    elif cfg["what"] == "decide":
        attempt("decide", lambda: c.should_save(2))
    else:
        attempt("restore", lambda: int(c.load()["x"].sum()))
except Exception:
    emit(check="failed", error=traceback.format_exc())
emit(check="done")
sys.stdout.flush()
os._exit(0)  # no jax.distributed.shutdown: the absent process may still be asleep
