"""One process of a run with a Grain iterator per process (tests/test_perprocess_multihost.py).

    python perproc_worker.py <json config>      (through harness.launch, 2 CPU devices each)

Config: ``root`` (a folder for every checkpoint), ``phase`` (``save`` or ``restore``),
``timeout`` (quire's).  Every process has its own Grain pipeline (its elements depend on the
process index) and advances it by its own schedule (:func:`position`), so no two processes
are ever at the same position; each case saves ``{"data": iterator, ...}`` in every process:

``blocking``    ``quire.save_checkpointables``;
``async``       ``quire.save_checkpointables_async``, the loop moving on 5 batches before
                ``result()``;
``ckpt``        a persistent ``Checkpointer``, async steps 1..3;
``tier``        a ``Checkpointer`` with a local tier (``peers=1``, every step; the persistent
                tier every 2nd), steps 1..3, numpy state only: process 1 owns nothing of a
                step but its iterator's folder;
``tier-inc``    the same over an incremental persistent root (``peers=0``), a sharded array
                in the state, steps 1..2 (step 2 promoted by re-packing).

``restore`` (fresh processes): each case loads into a fresh iterator of its own pipeline and
checks it resumes at its own position; ``tier`` restores its latest step from the local tier
(the test wipes process 1's local root first: its objects come from process 0's peer copy)
and step 2 from the persistent tier; ``one`` (a checkpoint the test saved with one process)
must be refused naming the unit.  Prints ``QUIRE-MH <json>`` lines.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

cfg = json.loads(sys.argv[1])

import jax  # noqa: E402
from worker_harness import init, report  # noqa: E402

pid = init(initialization_timeout=60).process

import grain  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import quire  # noqa: E402
from quire.policies import EveryNSteps  # noqa: E402

quire.configure(timeout=cfg["timeout"])
ROOT = cfg["root"]
mesh = Mesh(np.array(jax.devices()), ("d",))


def emit(**kw: object) -> None:
    report(**kw)


def pipeline(p: int = pid) -> grain.DatasetIterator:
    """Process ``p``'s iterator: its own elements, read by a thread pool (as in training)."""
    ds = grain.MapDataset.range(10_000).map(lambda i: i * 10 + p)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=2)))


def position(case: str, step: int = 0) -> int:
    """Where process ``pid``'s iterator is when ``case`` (at ``step``) is saved."""
    base = {"blocking": 3, "async": 5, "ckpt": 7, "tier": 11, "tier-inc": 13}[case]
    return base + 4 * pid + (1 + pid) * step


def advance(it: grain.DatasetIterator, n: int) -> grain.DatasetIterator:
    for _ in range(n):
        next(it)
    return it


def moved_to(it: grain.DatasetIterator, case: str, step: int = 0) -> grain.DatasetIterator:
    return advance(it, position(case, step) - int(it.get_state()["next_index"]))


def sharded(step: int) -> jax.Array:
    a = np.arange(64, dtype=np.float32).reshape(16, 4) + step
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, PartitionSpec("d")),
                                        lambda i: a[i])  # fmt: skip


def check(case: str, it: grain.DatasetIterator, step: int = 0) -> None:
    """``it`` restored: at this process's position of ``case``, yielding its elements."""
    want = position(case, step)
    got = int(it.get_state()["next_index"])
    first = int(next(it))
    emit(check="restored", case=case, step=step, pos=got, want=want, first=first,
         ok=got == want and first == want * 10 + pid)  # fmt: skip


def tiered(case: str) -> quire.Checkpointer:
    return quire.Checkpointer(
        f"{ROOT}/{case}",
        save_policy=EveryNSteps(2),
        incremental=case == "tier-inc",
        local=quire.LocalTier(
            f"{ROOT}/{case}-local", save_policy=EveryNSteps(1), peers=int(case == "tier")
        ),
    )


def save() -> None:
    it = pipeline()
    quire.save_checkpointables(f"{ROOT}/blocking", {"data": moved_to(it, "blocking")})
    r = quire.save_checkpointables_async(f"{ROOT}/async", {"data": moved_to(it, "async"),
                                                           "n": {"x": np.arange(3)}})  # fmt: skip
    advance(it, 5)  # the loop moves on while the save is written
    r.result(timeout=120)
    with quire.Checkpointer(f"{ROOT}/ckpt") as ck:
        it = pipeline()
        for step in (1, 2, 3):
            ck.save_checkpointables(step, {"data": moved_to(it, "ckpt", step), "w": sharded(step)})
            next(it)  # the loop moves on at once
        ck.wait()
    for case, steps in (("tier", (1, 2, 3)), ("tier-inc", (1, 2))):
        with tiered(case) as ck:
            it = pipeline()
            for step in steps:
                state = {"step": np.int64(step)}
                if case == "tier-inc":
                    state["w"] = sharded(step)
                ck.save_checkpointables(step, {"data": moved_to(it, case, step), "state": state})
                next(it)
            ck.wait()
            emit(check="saved", case=case, tiers={s: ck.tiers_of(s) for s in ck.steps()})


def restore() -> None:
    for case in ("blocking", "async"):
        check(case, quire.load_checkpointables(f"{ROOT}/{case}", {"data": pipeline()})["data"])
    with quire.Checkpointer(f"{ROOT}/ckpt") as ck:
        step = ck.latest_step()
        check("ckpt", ck.load_checkpointables(step, {"data": pipeline()})["data"], step)
        check("ckpt", ck.load_checkpointables(2, {"data": pipeline()})["data"], 2)
    with tiered("tier") as ck:
        step = ck.latest_step()
        check("tier", ck.load_checkpointables(step, {"data": pipeline()})["data"], step)
        spread = ck._tier.spread  # type: ignore[union-attr]
        emit(check="tier-read", step=step, read=spread.last_restore)
    for case in ("tier", "tier-inc"):  # promoted: each process's own folder, from its own root
        url = f"{ROOT}/{case}/step_{2:08d}"
        check(case, quire.load_checkpointables(url, {"data": pipeline()})["data"], 2)
    try:
        quire.load_checkpointables(f"{ROOT}/one", {"data": pipeline()})
        emit(check="one", error=None)
    except quire.TreeMismatchError as e:
        emit(check="one", error=str(e))


try:
    {"save": save, "restore": restore}[cfg["phase"]]()
except Exception:
    emit(check="failed", error=traceback.format_exc())
emit(check="done")
try:
    jax.distributed.shutdown()
finally:
    sys.stdout.flush()
    os._exit(0)
