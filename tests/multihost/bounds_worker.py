"""One JAX process of the record-bounds run (launched by ``tests/test_record_bounds_multihost.py``).

Usage (through ``harness.launch``, which gives each process its index and device count)::

    python tests/multihost/bounds_worker.py MODE WORKDIR

``save`` (4 processes x 2 devices): mesh (4, 2) ("data", "model"), "data" across the
processes; saves ``tree()`` (arrays whose replicated shards replica-parallel writes cut
into more pieces than the mesh has devices, odd and prime shapes, 0-d, size 0, inner
chunks) in both layouts, reports each array's chunk grid, then loads both back on the same
processes.  ``load`` (any topology): loads both checkpoints onto this process's devices and
verifies them.  Each load compares every addressable shard with the source, bit for bit.
Prints ``QUIRE-MH {...}`` lines.
"""

from __future__ import annotations

import math
import os
import sys
import traceback
from typing import Any

MODE, WORKDIR = sys.argv[1:3]

import jax  # noqa: E402
import worker_harness  # noqa: E402

ME = worker_harness.init(initialization_timeout=60)
PID_, NPROC_, NDEV_ = ME.process, ME.processes, ME.devices

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import quire  # noqa: E402

# name -> (shape, dtype, spec); "data" spans the processes, "model" the devices of one
ARRAYS: dict[str, tuple[tuple[int, ...], str, Any]] = {
    # the case: each half held by all 4 processes, cut into 5 pieces (2050 = 5 x 410)
    "params/proj": ((2050, 4096), "float32", P(None, "model")),
    # the same in small (10 rows = 5 x 2) and with inner chunks (chunk_bytes)
    "small/five": ((10, 6), "float32", P(None, "model")),
    "small/inner": ((60, 8), "float32", P(None, "model")),
    # prime rows: no exact divisor, ceil(n / k) pieces, the last one shorter
    "small/prime": ((1009, 2), "int32", P(None, "model")),
    # replicated on all 8 devices: 4 holders, 7 x 11 rows = 7 exact pieces
    "small/everywhere": ((77, 3), "float32", P()),
    # sharded over both axes: each shard on one device, nothing to share
    "small/sharded": ((8, 6), "float32", P("data", "model")),
    # 0-d and size 0: never split
    "small/scalar": ((), "float32", P()),
    "small/empty": ((0, 4), "float32", P(None, "model")),
}
STORAGE = {"small/inner": quire.StorageOptions(chunk_bytes=64)}


def emit(check: str, **kw: Any) -> None:
    worker_harness.report(check=check, **kw)


def source(name: str) -> np.ndarray:
    shape, dtype, _ = ARRAYS[name]
    n = math.prod(shape)
    return (np.arange(n, dtype=np.int64) * 7 + len(name)).astype(dtype).reshape(shape)


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


def tree() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (shape, _, spec) in ARRAYS.items():
        g = source(name)
        arr = jax.make_array_from_callback(shape, NamedSharding(mesh(), spec), lambda i, g=g: g[i])
        top, leaf = name.split("/")
        out.setdefault(top, {})[leaf] = arr
    return out


def target() -> dict[str, Any]:
    """The saved shardings on 8 devices (4 x 2 or 1 x 8: the same (4, 2) mesh)."""
    out: dict[str, Any] = {}
    for name, (shape, dtype, spec) in ARRAYS.items():
        top, leaf = name.split("/")
        out.setdefault(top, {})[leaf] = jax.ShapeDtypeStruct(
            shape, np.dtype(dtype), sharding=NamedSharding(mesh(), spec)
        )
    return out


def compare(loaded: dict[str, Any]) -> list[str]:
    bad = []
    for name in ARRAYS:
        top, leaf = name.split("/")
        arr, want = loaded[top][leaf], source(name)
        if arr.shape != want.shape:
            bad.append(f"{name}: shape {arr.shape}")
            continue
        for s in arr.addressable_shards:
            if not np.array_equal(np.asarray(s.data), want[s.index]):
                bad.append(f"{name}: shard {s.index} differs")
    return bad


def storage(path: tuple[Any, ...], leaf: Any) -> Any:
    return STORAGE.get("/".join(str(k) for k in path))


def url_of(layout: str) -> str:
    return os.path.join(WORKDIR, layout)


def load_all(where: str) -> None:
    for layout in ("packed", "chunks"):
        try:
            bad = compare(quire.load(url_of(layout), target()))
            emit("load", where=where, layout=layout, bad=bad)
        except Exception as e:
            emit("load", where=where, layout=layout, failed=f"{type(e).__name__}: {e}"[:600])


def save() -> None:
    t = tree()
    for layout in ("packed", "chunks"):
        # pieces of at least 16 bytes: the small arrays split like big ones
        with quire.Context(replica_piece_bytes=16, layout=layout):
            quire.save(url_of(layout), t, storage=storage)
    grids = {}
    for name in ARRAYS:
        top, leaf = name.split("/")
        m = quire.metadata(url_of("packed")).tree[top][leaf]
        grids[name] = [
            list(m.chunk_shape),
            math.prod(-(-n // c) for n, c in zip(m.shape, m.chunk_shape)),
        ]
    emit("saved", grids=grids)
    load_all("same processes")


def main() -> None:
    try:
        if MODE == "save":
            save()
        else:
            load_all(f"{NPROC_} x {NDEV_}")
            for layout in ("packed", "chunks"):
                report = quire.verify(url_of(layout))
                emit("verify", layout=layout, problems=[str(p) for p in report.problems])
    except BaseException as e:
        emit("crashed", failed=f"{type(e).__name__}: {e}"[:2000], tb=traceback.format_exc()[-3000:])
        sys.stdout.flush()
        os._exit(2)
    emit("done")
    if NPROC_ > 1:
        jax.distributed.shutdown()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
