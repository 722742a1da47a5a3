"""Orbax's rows of ``bench_tiers_multi.py``: one worker process of an ``orbax-*`` phase.

Imported by ``bench_tiers_multi.py``'s worker; not run on its own.  ``cfg["kind"]`` picks the
manager (orbax-checkpoint 0.12.8):

* ``emergency``: ``orbax.checkpoint.experimental.emergency.checkpoint_manager.CheckpointManager``.
  Replica 0 saves to the persistent tier only, the other replicas to their local directories
  only.  A restore reads the step on one replica (one whose every process has it locally, else
  replica 0 from the persistent tier) and broadcasts it to the other replicas with a jitted
  sum over the replica axis: a cross-process collective, gloo on CPU.
* ``p2p``: ``orbax.checkpoint.experimental.emergency.p2p.checkpoint_manager.CheckpointManager``.
  Every process saves its own shards to its local directory, replica 0 also to the persistent
  tier when due.  A restore reads each process's shards from its local directory, else fetches
  them from a peer holding the same shards (another replica) over TCP, else (on every process,
  when one lacks them) from the persistent tier, broadcast from replica 0.

Both need a global mesh with at least 2 data-parallel replicas along one axis: the state is
replicated over that axis and sharded within a replica.  So the state here has the same arrays
and values as quire's rows (``w``: the ``--mib`` MiB float32 array, ``r``: 1/16 of it,
``step``) on the mesh ``(replicas, 2 * processes / replicas)`` = ``("replica", "d")``
(``cfg["replicas"]``): each replica holds the whole state, ``w`` split over its devices, ``r``
and ``step`` replicated.

The persistent tier is a local directory, not S3: see ``docs/tiers.md`` (Orbax rows) for why.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any


def worker(pid: int, n: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one ``orbax-*`` phase in this process (jax.distributed is initialized); its numbers."""
    import jax
    import numpy as np
    from absl import flags
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from orbax.checkpoint import args as ocp_args
    from orbax.checkpoint._src.logging import abstract_logger
    from orbax.checkpoint._src.multihost import multihost as ocp_multihost
    from orbax.checkpoint.experimental.emergency import checkpoint_manager as ecm
    from orbax.checkpoint.experimental.emergency.p2p import args as p2p_args
    from orbax.checkpoint.experimental.emergency.p2p import checkpoint_manager as p2p_cm
    from orbax.checkpoint.experimental.emergency.p2p import options as p2p_options

    # The restore reads absl flags (mesh consistency); the emergency manager's save and
    # restore need Orbax's process-to-device map (its own benchmarks set both up so).
    flags.FLAGS.mark_as_parsed()
    ocp_multihost.initialize_runtime_to_distributed_ids()
    ocp_multihost.initialize_distributed_to_device_ids()

    replicas = cfg["replicas"]  # each of n // replicas processes
    mesh = Mesh(np.array(jax.devices()).reshape(replicas, -1), ("replica", "d"))
    replica = pid // (n // replicas)  # jax.devices() is in process order

    def put(a: np.ndarray, spec: PartitionSpec) -> Any:
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])

    def state(step: int) -> dict[str, Any]:
        rng = np.random.default_rng(step)  # the same values as quire's rows
        rows = 2 * n * 64
        cols = max(1, (cfg["mib"] << 20) // 4 // rows)
        big = rng.standard_normal((rows, cols), dtype=np.float32)
        rep = rng.standard_normal(big.size // 16, dtype=np.float32)
        return {
            "w": put(big, PartitionSpec("d")),
            "r": put(rep, PartitionSpec()),
            "step": put(np.asarray(step, np.int32), PartitionSpec()),
        }

    def compare(got: dict[str, Any], want: dict[str, Any]) -> int:
        """Check the restore bit for bit; the count of -0.0 restored as +0.0 (the only
        difference allowed: the broadcast sums over the replica axis, and -0.0 + 0.0 is +0.0)."""
        flipped = 0
        for k in ("w", "r", "step"):
            a = sorted(got[k].addressable_shards, key=lambda s: s.device.id)
            b = sorted(want[k].addressable_shards, key=lambda s: s.device.id)
            assert [(s.device, s.index) for s in a] == [(s.device, s.index) for s in b], k
            for x, y in zip(a, b):
                xa, ya = np.asarray(x.data), np.asarray(y.data)
                assert xa.dtype == ya.dtype and xa.shape == ya.shape, k
                if xa.tobytes() == ya.tobytes():
                    continue
                differ = xa.view(np.uint8).reshape(xa.size, -1) != ya.view(np.uint8).reshape(
                    ya.size, -1
                )
                differ = differ.any(axis=1).reshape(xa.shape)
                neg_zero = (ya == 0) & np.signbit(ya) & (xa == 0) & ~np.signbit(xa)
                assert not (differ & ~neg_zero).any(), f"{k}: restored bits differ"
                flipped += int(differ.sum())
        return flipped

    class Entries(abstract_logger.AbstractLogger):
        """Keeps Orbax's structured log entries (the restore's source and broadcast time)."""

        def __init__(self) -> None:
            self.entries: list[Any] = []

        def log_entry(self, msg: Any, *args: Any, **kwargs: Any) -> None:
            self.entries.append(msg)

    base = cfg["orbax"]
    local = os.path.join(base, "local", f"process_{pid:05d}")
    persistent = os.path.join(base, "persistent")
    os.makedirs(local, exist_ok=True)  # Orbax requires both to exist
    os.makedirs(persistent, exist_ok=True)
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state(0)
    )
    logger = Entries()
    p2p = cfg["kind"] == "p2p"

    class Messages(logging.Handler):
        """Keeps the P2P manager's log lines that say where its restore read."""

        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.said: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.said.append(record.getMessage())

    said = Messages()
    if p2p:
        logging.getLogger("absl").addHandler(said)
        logging.getLogger("absl").setLevel(logging.INFO)

    def manager() -> Any:
        if p2p:
            return p2p_cm.CheckpointManager(
                mesh,
                abstract,
                local,
                persistent,
                options=p2p_options.CheckpointManagerOptions(
                    local=p2p_options.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=2),
                    persistent=p2p_options.PersistentCheckpointOptions(save_interval_steps=2),
                ),
            )
        options = ecm.CheckpointManagerOptions(
            local=ecm.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=2),
            persistent=ecm.PersistentCheckpointOptions(save_interval_steps=2),
        )
        return ecm.CheckpointManager(
            local, persistent, mesh, abstract, options=options, logger=logger
        )

    def composite(**kw: Any) -> Any:
        return (p2p_args.Composite if p2p else ocp_args.Composite)(**kw)

    def timed_save(m: Any, step: int) -> tuple[float, float]:
        s = state(step)
        multihost_utils.sync_global_devices(f"orbax-save{step}")
        t0 = time.perf_counter()
        m.save(step, composite(state=ocp_args.PyTreeSave(s)))
        t1 = time.perf_counter()
        m.wait_until_finished()
        return t1 - t0, time.perf_counter() - t0

    def timed_restore(m: Any, step: int) -> dict[str, Any]:
        multihost_utils.sync_global_devices(f"orbax-load{step}")
        t0 = time.perf_counter()
        said.said.clear()
        if p2p:
            got = m.restore(step, composite(state=ocp_args.PyTreeRestore(item=abstract))).state
        else:
            got = m.restore(step).state
        jax.block_until_ready(got)
        wall = time.perf_counter() - t0
        flipped = compare(got, state(step))
        if p2p:  # every process reads its own shards: where from, in its log lines
            text = "\n".join(said.said)
            if "All hosts falling back to persistent storage" in text:
                source = "persistent"
            elif "fetching from P2P" in text:
                source = f"peers (process {pid})"
            else:
                assert "found in local storage" in text, text
                source = "local"
            return {"wall": wall, "source": source, "broadcast": None, "flipped": flipped}
        entry = logger.entries[-1]
        if not entry.get("is_restoring_slice"):
            source = None  # this replica received the broadcast
        elif entry.get("in_primary_slice"):
            source = "persistent"
        else:
            source = f"local, replica {replica}"
        return {
            "wall": wall,
            "source": source,
            "broadcast": entry["broadcast_duration_secs"],
            "flipped": flipped,  # on this process's shards
        }

    def wipe(path: str) -> None:  # a replaced host: an empty directory, as Orbax requires
        shutil.rmtree(path)
        os.makedirs(path)

    phase = cfg["phase"]
    out: dict[str, Any] = {}
    if phase == "orbax-save":
        with manager() as m:
            m.save(1, composite(state=ocp_args.PyTreeSave(state(1))))  # warm-up
            m.wait_until_finished()
            # emergency: replica 0 saves persistent only, the others local only; P2P: every
            # process saves locally, replica 0 also to the persistent tier when due
            out["promoted"] = timed_save(m, 2)
            out["local"] = timed_save(m, 3)
    elif phase == "orbax-restore-local":
        with manager() as m:
            out.update(timed_restore(m, 3))
    elif phase == "orbax-restore-lost":
        if pid == n // replicas:  # the first process of replica 1 (replica 0 has no local steps)
            wipe(local)
        multihost_utils.sync_global_devices("orbax-wiped")
        with manager() as m:
            out.update(timed_restore(m, 2))
    elif phase == "orbax-restore-persistent":
        wipe(local)
        multihost_utils.sync_global_devices("orbax-wiped-all")
        with manager() as m:
            out.update(timed_restore(m, 2))
    else:
        raise ValueError(phase)
    return out
