"""One process of a run where the processes must agree (tests/test_agreement_multihost.py).

    python agreement_worker.py <json config>   (started by harness.launch)

Config: ``root`` (a persistent Checkpointer root shared by every process), ``timeout``
(quire's), ``absent`` (a process stuck before the agreement under test: it sleeps until the
test kills it), ``what``: ``decide`` (a save decision with a policy whose answer differs by process:
every process follows process 0's) or ``restore`` (``Checkpointer.load``: first of another
step in each process, then of the newest, then the one under test).  Reports
(``worker_harness.report``): ``ok`` what the agreement gave, ``error`` what it raised and
after how many seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import worker_harness

cfg = json.loads(sys.argv[1])
me = worker_harness.init(initialization_timeout=60)
pid = me.process

import jax  # noqa: E402
import numpy as np  # noqa: E402

import quire  # noqa: E402
from quire.policies import SaveContext, SavePolicy  # noqa: E402

quire.configure(timeout=cfg["timeout"])


emit = worker_harness.report


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
    for step in (1, 2):
        c.save(step, {"x": np.arange(4) + step})
    c.wait()
    if cfg["what"] == "restore":
        attempt("different steps", lambda: int(c.load(1 + pid)["x"].sum()))
        attempt("newest", lambda: int(c.load()["x"].sum()))
    if pid == cfg.get("absent"):  # stuck: never reaches the agreement (the test kills it)
        time.sleep(600)
    elif cfg["what"] == "decide":
        attempt("decide", lambda: c.should_save(3))
    else:
        attempt("restore", lambda: int(c.load()["x"].sum()))
except Exception:
    emit(check="failed", error=traceback.format_exc())
emit(check="done")
sys.stdout.flush()
os._exit(0)  # no jax.distributed.shutdown: the absent process may still be asleep
