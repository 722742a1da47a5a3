"""One JAX process of a long-lived group that runs generated cases (``tests/test_props_multihost.py``).

Usage (through ``harness.Group``, which gives each process its index and device count)::

    python tests/multihost/props_worker.py

Joins the group with ``worker_harness.init()`` (``jax.distributed.initialize``), then reads
one JSON command per line from stdin and answers each with one line on stdout::

    QUIRE-MH {"pid": 0, "op": "...", "problems": [...], ...}

Every process of the group gets the same commands in the same order (the parent writes each
line to all of them), so a collective save or load runs in all at once.  Commands:

``{"op": "hello"}``                        this process's index and global device ids
``{"op": "save", "case": ..., "url": ...}``  save the case's tree (``quire.save`` or, for the
                                           ``save_async`` path, ``quire.save_async`` followed
                                           by a donating step and an in-place overwrite)
``{"op": "load", "case": ..., "url": ...}``  load onto the case's target and compare this
                                           process's shards with numpy's values
``{"op": "save", ..., "drop": [i, j]}``      save over the checkpoint at ``url``
                                           (``overwrite=True``) with an array writer that
                                           loses chunk ``j`` of leaf ``i`` in whichever
                                           process writes it (``core/tests/dropchunk.py``);
                                           answers ``"lost"``: what this process lost
``{"op": "quit"}``                           leave the group and exit

A failing command answers ``{"failed": "...", "tb": "..."}`` and the worker reads on; quire's
collective timeout is set short (``TIMEOUT``) so that one process's failure reaches the others
as quire's error instead of a hang.  Values and the oracle are ``core/tests/propcase.py``'s:
every process rebuilds them from the case.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

TIMEOUT = 90.0  # quire's barrier deadline inside a command (the parent waits longer)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "core" / "tests"))

import jax  # noqa: E402
from worker_harness import init, report  # noqa: E402

ME = init()
NPROC = ME.processes

from dropchunk import dropping  # noqa: E402
from propcase import Case, build_tree, check_loaded, context, donate, storage_of  # noqa: E402
from propcase import load as load_case  # noqa: E402

import quire  # noqa: E402


def answer(op: str, **kw: Any) -> None:
    report(op=op, **kw)


def save(case: Case, url: str, drop: list[int] | None = None) -> dict[str, Any]:
    tree = build_tree(case)
    if drop is not None:
        i, j = drop
        with (
            context(case),
            quire.Context(timeout=TIMEOUT),
            dropping(case.leaves[i].path, j) as lost,
        ):
            try:
                quire.save(url, tree, storage=storage_of(case), overwrite=True)
            except Exception as e:
                return {"lost": lost, "failed": f"{type(e).__name__}: {e}"}
        return {"lost": lost}
    with context(case), quire.Context(timeout=TIMEOUT):
        if case.path == "save_async":
            pending = quire.save_async(url, tree, storage=storage_of(case))
            donate(tree)
            pending.result()
        else:
            quire.save(url, tree, storage=storage_of(case))
    return {}


def load(case: Case, url: str) -> dict[str, Any]:
    with context(case), quire.Context(timeout=TIMEOUT):
        got = load_case(url, case)
    return {"problems": check_loaded(case, got)}


def main() -> None:
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        try:
            if op == "hello":
                mine = [d.id for d in jax.local_devices()]
                answer(op, process=jax.process_index(), devices=mine, count=jax.device_count())
                continue
            case = Case.from_json(cmd["case"])
            if op == "save" and "drop" in cmd:
                out = save(case, cmd["url"], cmd["drop"])
            else:
                out = {"save": save, "load": load}[op](case, cmd["url"])
            answer(op, **out)
        except Exception as e:
            answer(op, failed=f"{type(e).__name__}: {e}", tb=traceback.format_exc()[-4000:])
    if NPROC > 1:
        jax.distributed.shutdown()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
