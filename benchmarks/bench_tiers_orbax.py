"""Orbax's emergency ``CheckpointManager`` rows of ``bench_tiers_multi.py`` (one worker process).

Imported by ``bench_tiers_multi.py``'s worker for the ``orbax-*`` phases; not run on its own.

Orbax's emergency manager (``orbax.checkpoint.experimental.emergency.checkpoint_manager``,
orbax-checkpoint 0.12.8) needs a global mesh with at least 2 data-parallel replicas along one
axis: the state is replicated over that axis and sharded within a replica.  So its state here
has the same arrays and values as quire's rows (``w``: the ``--mib`` MiB float32 array, ``r``:
1/16 of it, ``step``) on the mesh ``(replicas, 2 * processes / replicas)`` = ``("replica",
"d")`` (``cfg["replicas"]``): each replica holds the whole state, ``w`` split over its devices,
``r`` and ``step`` replicated.  Replica 0 saves to the persistent tier only, the other replicas
to their local directories only (Orbax's design).  A restore reads the step on one replica
(one whose every process has it locally, else replica 0 from the persistent tier) and
broadcasts it to the other replicas with a jitted sum over the replica axis: a cross-process
collective, gloo on CPU.

The persistent tier is a local directory (``base/orbax-persistent``), not S3: see
``docs/tiers.md`` (Orbax rows) for why.
"""

from __future__ import annotations

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
    options = ecm.CheckpointManagerOptions(
        local=ecm.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=2),
        persistent=ecm.PersistentCheckpointOptions(save_interval_steps=2),
    )
    logger = Entries()

    def manager() -> Any:
        return ecm.CheckpointManager(
            local, persistent, mesh, abstract, options=options, logger=logger
        )

    def timed_save(m: Any, step: int) -> tuple[float, float]:
        s = state(step)
        multihost_utils.sync_global_devices(f"orbax-save{step}")
        t0 = time.perf_counter()
        m.save(step, ocp_args.Composite(state=ocp_args.PyTreeSave(s)))
        t1 = time.perf_counter()
        m.wait_until_finished()
        return t1 - t0, time.perf_counter() - t0

    def timed_restore(m: Any, step: int) -> dict[str, Any]:
        multihost_utils.sync_global_devices(f"orbax-load{step}")
        t0 = time.perf_counter()
        got = m.restore(step).state
        jax.block_until_ready(got)
        wall = time.perf_counter() - t0
        flipped = compare(got, state(step))
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
            m.save(1, ocp_args.Composite(state=ocp_args.PyTreeSave(state(1))))  # warm-up
            m.wait_until_finished()
            out["promoted"] = timed_save(m, 2)  # replica 0: persistent; others: local
            out["local"] = timed_save(m, 3)  # replicas 1..: local; replica 0: nothing
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
