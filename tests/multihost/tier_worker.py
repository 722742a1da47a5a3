"""One process of a multi-process local-tier run (tests/test_tiers_multihost.py).

    python tier_worker.py <json config>      (through harness.launch, 2 CPU devices each)

Config: ``persistent`` / ``options`` (the persistent tier and its storage options), ``local``,
``peers`` (default 1), ``every`` (the persistent tier's EveryNSteps, default 10),
``timeout`` (quire's), ``first`` / ``last`` (the steps to train), ``kill`` ([process, step]:
that process SIGKILLs itself in the middle of that step's local save, after writing its
packs), ``expect`` (the step the restore must agree on, or null), ``hang`` (a process that
sleeps instead of taking part in a final ``latest_step()``), ``silent`` (a process whose peer
server accepts connections and never answers), ``incremental`` (an incremental persistent
tier: its promotions borrow what the previous persistent step stores), ``frozen`` (the state
has a large leaf that never changes), ``wipe`` (a ``memory://`` local tier: after the saves
that process empties its own local root in its memory store, then every process restores the
last step again and says what it read, ``rerestored``; before that each says which markers
its root holds for the last step, ``markers``), ``local_seconds`` (the local tier's policy is
``EveryNSeconds(local_seconds)`` instead of every step), ``pause`` ([process, seconds]: that
process sleeps so long before each save, so its clock runs ahead of the others'), ``drop``
(``{"flat": j, "steps": {"<step>": "checked" | "unchecked"}}``: at those steps the array
writer of whichever process writes it loses chunk ``j`` of leaf ``w``
(``core/tests/dropchunk.py``), the local tier's completeness check on (``checked``) or off
(``unchecked``: the local step commits incomplete, as a quire without the check did, and
its promotion is what must refuse); each such step says ``dropped`` with what this process
lost and the error its save and wait raised).  Prints ``QUIRE-TIER <json>`` lines; the
``restored`` line says the bytes this process's peer server answered (``served``) and what
the restore read from others (``read``: bytes and requests per source).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

cfg = json.loads(sys.argv[1])

import jax  # noqa: E402
from worker_harness import init, report  # noqa: E402

pid = init(initialization_timeout=60).process

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "core" / "tests"))
from dropchunk import dropping, unchecked  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import quire  # noqa: E402
import quire.checkpointables  # noqa: E402
from quire._tiers import spread_save as _save  # noqa: E402
from quire.policies import EveryNSeconds, EveryNSteps, LatestN  # noqa: E402

quire.configure(timeout=cfg["timeout"])
mesh = Mesh(np.array(jax.devices()), ("d",))


def emit(**kw: object) -> None:
    report(**kw)


def put(a: np.ndarray, spec: PartitionSpec) -> jax.Array:
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])


def state(step: int) -> dict[str, object]:
    """The training state at ``step``: a deterministic function of the step."""
    rng = np.random.default_rng(step)
    return {
        "w": put(rng.standard_normal((96, 48), dtype=np.float32), PartitionSpec("d")),
        "b": put(rng.standard_normal((4096,), dtype=np.float32), PartitionSpec()),
        "opt": rng.integers(0, 1 << 30, 777, dtype=np.int64),
        "step": step,
    } | ({"frozen": FROZEN} if cfg.get("frozen") else {})


# With ``frozen``: a large leaf that never changes (an incremental step borrows it).
FROZEN = (
    put(
        np.random.default_rng(2**32 - 1).standard_normal((240, 512), np.float32), PartitionSpec("d")
    )
    if cfg.get("frozen")
    else None
)


class Loader:
    """A data iterator's position: a checkpointable unit with objects of its own."""

    def __init__(self, pos: int) -> None:
        self.pos = pos

    def quire_save(self, io: quire.checkpointables.UnitIO) -> object:
        io.write("position.bin", self.pos.to_bytes(8, "little") * 1000)
        return {"pos": self.pos}

    def quire_restore(self, io: quire.checkpointables.UnitIO, record: object) -> Loader:
        data = io.read("position.bin")
        assert data == int(record["pos"]).to_bytes(8, "little") * 1000  # type: ignore[index]
        return Loader(int(record["pos"]))  # type: ignore[index]


def same(a: dict[str, object], b: dict[str, object]) -> bool:
    for k in ("w", "b", "frozen") if "frozen" in b else ("w", "b"):
        x, y = a[k], b[k]
        assert isinstance(x, jax.Array) and isinstance(y, jax.Array)
        if x.sharding != y.sharding:
            return False
        for sx, sy in zip(x.addressable_shards, y.addressable_shards):
            if np.asarray(sx.data).tobytes() != np.asarray(sy.data).tobytes():
                return False
    return bool(np.asarray(a["opt"]).tobytes() == np.asarray(b["opt"]).tobytes()) and (
        a["step"] == b["step"]
    )


kill = cfg.get("kill")
if kill and kill[0] == pid:  # fault injection: die in the middle of that local save
    real = _save.write_units

    async def write_units(url, backend, prep, **kw):  # type: ignore[no-untyped-def]
        out = await real(url, backend, prep, **kw)
        if url.endswith(f"{kill[1]:08d}"):
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    _save.write_units = write_units  # type: ignore[assignment]


def checkpointer() -> quire.Checkpointer:
    return quire.Checkpointer(
        cfg["persistent"],
        save_policy=EveryNSteps(cfg.get("every", 10)),
        storage_options=cfg["options"],
        incremental=cfg.get("incremental", False),
        local=quire.LocalTier(
            cfg["local"],
            save_policy=(
                EveryNSeconds(cfg["local_seconds"]) if "local_seconds" in cfg else EveryNSteps(1)
            ),
            keep=LatestN(cfg.get("keep", 3)),
            peers=cfg.get("peers", 1),
        ),
    )


try:
    with checkpointer() as c:
        if cfg.get("silent") == pid:  # a peer that accepts connections and never answers
            import socket

            server = c._tier.spread.copies.server  # type: ignore[union-attr]
            address = server.address
            server.close()
            silent = socket.socket()
            silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            silent.bind(address)
            silent.listen(64)
        t0 = time.monotonic()
        got = c.latest_step()
        emit(check="agreed", step=got, seconds=time.monotonic() - t0)
        start = 1
        if got is not None:
            t0 = time.monotonic()
            units = c.load_checkpointables(got, {"state": state(0), "loader": Loader(0)})
            ok = same(units["state"], state(got)) and units["loader"].pos == got
            spread = c._tier.spread  # type: ignore[union-attr]
            served = spread.copies.server.served if spread.copies else None  # type: ignore[union-attr]
            emit(check="restored", step=got, same=ok, seconds=time.monotonic() - t0,
                 served=served, read=spread.last_restore)  # fmt: skip
            start = got + 1
        pause = cfg.get("pause")
        drop = cfg.get("drop") or {"steps": {}}
        for step in range(max(start, cfg["first"]), cfg["last"] + 1):
            if pause and pause[0] == pid:
                time.sleep(pause[1])
            how = drop["steps"].get(str(step))
            if how is None:
                c.save_checkpointables(step, {"state": state(step), "loader": Loader(step)})
                continue
            off = unchecked(cfg["local"]) if how == "unchecked" else contextlib.nullcontext()
            with dropping(("w",), drop["flat"]) as lost, off:
                try:
                    c.save_checkpointables(step, {"state": state(step), "loader": Loader(step)})
                    c.wait()
                    error = None
                except Exception as e:
                    error = f"{type(e).__name__}: {e}"
            emit(check="dropped", step=step, lost=len(lost), error=error)
        c.wait()
        emit(check="saved", last=cfg["last"], tiers={s: c.tiers_of(s) for s in c.steps()})
        if cfg.get("wipe") is not None:  # a memory:// local tier: its roots live in this process
            from fsspec.implementations.memory import MemoryFileSystem
            from jax.experimental import multihost_utils

            from quire._store.memory import forget

            # every process has pulled its copies (c.wait() above) before one wipes its root
            multihost_utils.sync_global_devices("quire-test: copies pulled")
            mine = c._tier.url  # type: ignore[union-attr]
            root = mine.removeprefix("memory://")
            found = [k for k in MemoryFileSystem.store if "/%tier/" in k and root in k]
            step_dir = f"step_{cfg['last']:08d}/"
            emit(check="markers", names=sorted(k.rsplit("/", 1)[1] for k in found if step_dir in k))
            if pid == cfg["wipe"]:
                forget(mine)
            c.reload()
            got = c.latest_step()
            units = c.load_checkpointables(got, {"state": state(0), "loader": Loader(0)})
            ok = same(units["state"], state(got)) and units["loader"].pos == got
            spread = c._tier.spread  # type: ignore[union-attr]
            emit(check="rerestored", step=got, same=ok, read=spread.last_restore)
        if cfg.get("hang") is not None:
            if pid == cfg["hang"]:
                time.sleep(cfg["timeout"] + 3)
            else:
                t0 = time.monotonic()
                try:
                    c.latest_step()
                    emit(check="hang", error=None)
                except quire.errors.MultiProcessError as e:
                    emit(check="hang", error=str(e), seconds=time.monotonic() - t0)
    if cfg.get("reopen"):  # a second Checkpointer on the same roots, in the same job
        with checkpointer() as c:
            got = c.latest_step()
            units = c.load_checkpointables(got, {"state": state(0), "loader": Loader(0)})
            emit(check="reopened", step=got,
                 same=same(units["state"], state(got)) and units["loader"].pos == got)  # fmt: skip
except Exception:
    emit(check="failed", error=traceback.format_exc())
emit(check="done")
try:
    jax.distributed.shutdown()
finally:
    sys.stdout.flush()
    os._exit(0)
