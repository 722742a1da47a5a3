"""What the completeness check costs a save: ``quire.save`` with and without it, same run.

Run from the repository root::

    .venv/bin/python benchmarks/bench_completeness.py             # 2.16 GB tree, 3 reps
    .venv/bin/python benchmarks/bench_completeness.py --quick     # ~270 MB, for smoke runs
    .venv/bin/python benchmarks/bench_completeness.py --reps 5 --dir /mnt/scratch

Before a record is published, the primary checks that every chunk of every array is in a
chunk index the record names (format v2) or stored as an object (format v1) -
``quire._engine.completeness``, docs/commit-protocol.md.  This saves the same tree to a
local directory with the check on and off (``off`` swaps the check for a no-op), alternating
which goes first in each repetition, and times the check alone on each committed record.

The tree is ``bench_s3.py``'s "standard" one (4 arrays of 256 MiB, 32 of 32 MiB, 400 of
4-64 KiB, float32 and bfloat16, 3 scalars: 2.16 GB of arrays, 439 leaves).  Variants:
``numpy`` (one chunk per array) and ``sharded`` (the 36 large arrays as ``jax.Array`` s split
over 8 CPU devices along axis 0: 8 chunks each).  Layouts: ``packed`` (format v2, the
default) and ``chunks`` (format v1).  One untimed save of each comes first (first-call
costs).  Checkpoints are deleted after each save; fsync is on;
the page cache is not dropped.  Reported: the median and minimum save time per mode, the
ratio of medians (on / off), and the check's own time (median).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_s3 import build_tree

import quire
from quire._engine import commit as _commit
from quire._engine import completeness as _completeness
from quire._store.local import LocalBackend


def sharded(tree: dict[str, Any]) -> dict[str, Any]:
    """The large arrays split over 8 devices along axis 0 (8 chunks each)."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    for group in ("big", "mid"):
        for k, a in out[group].items():
            if a.ndim == 2 and a.shape[0] % 8 == 0:
                out[group][k] = jax.device_put(a, NamedSharding(mesh, PartitionSpec("x")))
    return out


async def check_alone(url: str) -> float:
    backend = LocalBackend(url)
    doc = (await _commit.read(backend, url)).doc
    trees, indexes = _completeness.record_parts(doc)
    t0 = time.perf_counter()
    await _completeness.check(backend, url, "quire.json", trees, indexes)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tree at 1/8 size")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to save (default: a temporary dir)")
    ap.add_argument("--variants", default="numpy,sharded")
    ap.add_argument("--layouts", default="packed,chunks")
    args = ap.parse_args(argv)
    base = build_tree(args.quick)
    payload = sum(
        v.nbytes
        for g in base.values()
        if isinstance(g, dict)
        for v in g.values()
        if hasattr(v, "nbytes")
    )
    leaves = len(jax.tree.leaves(base))
    print(f"tree: {payload / 1e9:.2f} GB of arrays, {leaves} leaves; load: {os.getloadavg()}")
    real = _completeness.check

    async def off(*a: Any, **kw: Any) -> None:
        return None

    where = tempfile.mkdtemp(prefix="quire-complete-", dir=args.dir)
    rows = []
    try:
        for variant in args.variants.split(","):
            tree = sharded(base) if variant == "sharded" else base
            for layout in args.layouts.split(","):
                times: dict[str, list[float]] = {"on": [], "off": []}
                alone: list[float] = []
                warm = os.path.join(where, f"{variant}-{layout}-warm-up")
                quire.save(warm, tree, layout=layout)  # not timed: first-call costs
                shutil.rmtree(warm)
                for rep in range(args.reps):
                    order = ("on", "off") if rep % 2 == 0 else ("off", "on")
                    for mode in order:
                        url = os.path.join(where, f"{variant}-{layout}-{mode}-{rep}")
                        _completeness.check = real if mode == "on" else off  # type: ignore[assignment]
                        try:
                            t0 = time.perf_counter()
                            quire.save(url, tree, layout=layout)
                            times[mode].append(time.perf_counter() - t0)
                        finally:
                            _completeness.check = real
                        if mode == "on":
                            alone.append(asyncio.run(check_alone(url)))
                        shutil.rmtree(url)
                on, off_ = statistics.median(times["on"]), statistics.median(times["off"])
                rows.append(
                    (
                        variant,
                        layout,
                        on,
                        min(times["on"]),
                        off_,
                        min(times["off"]),
                        on / off_,
                        statistics.median(alone),
                    )
                )
                print(f"  {variant}/{layout}: on {times['on']}, off {times['off']}", flush=True)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    print(
        f"\n== {args.reps} reps; seconds; load after: {os.getloadavg()}\n"
        "| tree | layout | save, check on (median / min) | save, check off (median / min) "
        "| on / off (medians) | the check alone (median) |\n|---|---|---|---|---|---|"
    )
    for v, lay, on, on_min, off_, off_min, ratio, al in rows:
        print(
            f"| {v} | {lay} | {on:.2f} / {on_min:.2f} | {off_:.2f} / {off_min:.2f} "
            f"| {ratio:.3f} | {al * 1e3:.1f} ms ({al / on * 100:.2f} % of the save) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
