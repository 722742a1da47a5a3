"""Async-save benchmark (issue 20): how long ``save_async`` blocks the caller, what it costs
the training steps that run during the background write, and the host memory it adds.

Run from the repository root::

    .venv/bin/python benchmarks/bench_async.py             # bench_local's tree (1.26 GiB), 3 reps
    .venv/bin/python benchmarks/bench_async.py --quick     # ~170 MiB, for a smoke run
    .venv/bin/python benchmarks/bench_async.py --variants jax-8dev --peers quire

The tree is ``bench_local.py``'s (2 x 256 MiB, 24 x 32 MiB, 400 small arrays, 4 scalars;
float32 and bfloat16).  Variants (one process, 8 CPU devices via
``XLA_FLAGS=--xla_force_host_platform_device_count=8``):

* ``jax-1dev`` - every array a ``jax.Array`` on one CPU device (a training state);
* ``jax-8dev`` - the 26 big arrays sharded along axis 0 over 8 CPU devices, the small ones
  ``jax.Array``s on device 0;
* ``numpy``    - every array a ``numpy.ndarray`` (mutable: these must be copied).

Rows, per variant, each the best (minimum) of ``--reps`` reps, interleaved inside each rep:

* ``bare d2h``  - ``copy_to_host_async()`` on every array, then ``numpy.asarray`` of every
  addressable shard (the bare device-to-host transfer; on CPU a zero-copy view);
* ``bare copy`` - ``numpy.array(shard, copy=True)`` of every shard in one thread (the full
  host copy ``save_async`` made before issue 20, there spread over its I/O threads);
* ``quire``     - ``quire.save_async``: ``blocked`` until it returns, ``total`` until
  ``.result()``;
* ``no save``   - the control: nothing in the background for 2 s, the steps measured the
  same way (its ``steps`` column is the noise floor of this machine);
* ``quire pinned`` / ``quire pageable`` (``--peers ...,pinned,pageable``) - ``save_async``
  with ``pinned_staging`` forced on / off (the default, ``quire``, is on for GPU devices);
* ``orbax v1``  - ``orbax.checkpoint.v1.save_pytree_async`` with ``use_compression=False``
  (OCDBT + zarr3, the v1 defaults otherwise), then ``.result()``.

``steps`` is the training-step slowdown: a jitted 1024x1024 float32 matmul step (its input
donated) run back to back while the save writes in the background, its mean step time
against the same loop with nothing in the background (the mean of 30 steps right before and
30 right after, same rep): ``+x%``, the median over reps.  ``dRSS`` is the peak RSS growth
from the call until ``.result()`` returns (sampled every 5 ms, max over reps).  Memory is
pre-warmed before every timed phase as in
``bench_local.py``.  The machine is shared: differences under ~30% are noise.

On few cores the step slowdown is a trade against the write's speed: once ``save_async`` has
returned, quire's writer uses ``QUIRE_BACKGROUND_THREADS`` threads (half the cores by default)
at the lowest priority (``QUIRE_BACKGROUND_NICE``), each using at most
``QUIRE_BACKGROUND_DUTY`` of a CPU (0.5 when JAX computes on the CPU, as here); more threads
or a higher duty finish the write sooner and slow the steps more (run with a few values to
see it on yours, e.g. ``QUIRE_BACKGROUND_DUTY=1``).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import argparse
import logging
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import bench_local as bl  # first: it sets XLA_FLAGS (8 CPU devices) before jax loads
import jax
import numpy as np
import psutil

VARIANTS = "jax-1dev,jax-8dev,numpy"
PEERS = "nothing,quire,orbax"


def build(variant: str, quick: bool) -> dict[str, Any]:
    tree = bl.build_tree(quick, sharded=variant == "jax-8dev")
    if variant == "numpy":
        return tree
    dev0 = jax.devices()[0]
    for g, sub in tree.items():
        if g == "scalars":
            continue
        for k, v in sub.items():
            if isinstance(v, np.ndarray):
                sub[k] = jax.device_put(v, dev0)
    jax.block_until_ready(tree)
    return tree


def _arrays(tree: dict[str, Any]) -> list[Any]:
    return [v for _, v in bl.leaves(tree) if hasattr(v, "shape")]


def bare_d2h(tree: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    arrs = _arrays(tree)
    for a in arrs:
        if isinstance(a, jax.Array):
            a.copy_to_host_async()
    host = [
        np.asarray(s.data) if isinstance(a, jax.Array) else a
        for a in arrs
        for s in (a.addressable_shards if isinstance(a, jax.Array) else [None])
    ]
    dt = time.perf_counter() - t0
    del host
    return dt


def bare_copy(tree: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    host = [
        np.array(s.data if s is not None else a, copy=True)
        for a in _arrays(tree)
        for s in (a.addressable_shards if isinstance(a, jax.Array) else [None])
    ]
    dt = time.perf_counter() - t0
    del host
    return dt


# ----------------------------------------------------------------------------- steps
_W = None


def _step_fn() -> Callable[[jax.Array], jax.Array]:
    global _W
    _W = jax.device_put(np.eye(1024, dtype=np.float32) * 0.999, jax.devices()[0])
    return jax.jit(lambda x: x @ _W, donate_argnums=0)


class Steps:
    """A jitted matmul loop: mean seconds per step, run back to back."""

    def __init__(self) -> None:
        self.fn = _step_fn()
        self.x = jax.device_put(np.ones((1024, 1024), np.float32), jax.devices()[0])
        self.x = self.fn(self.x).block_until_ready()  # compile

    def run(self, until: Callable[[], bool] | None = None, n: int = 40) -> tuple[float, int]:
        count = 0
        t0 = time.perf_counter()
        while (until is None and count < n) or (until is not None and not until()):
            self.x = self.fn(self.x)
            self.x.block_until_ready()
            count += 1
            if until is not None and count >= 100000:
                break
        return (time.perf_counter() - t0) / max(1, count), count


# ----------------------------------------------------------------------------- peers
class _Timer:
    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def done(self) -> bool:
        return time.perf_counter() >= self.end

    def result(self) -> None:
        time.sleep(max(0.0, self.end - time.perf_counter()))


class Nothing:
    """The control: no save, the steps measured the same way for 2 s (the noise floor)."""

    name = "no save"

    def start(self, path: str, tree: dict[str, Any]) -> Any:
        return _Timer(2.0)


class Quire:
    name = "quire"

    def __init__(self) -> None:
        import quire

        self.q = quire

    def start(self, path: str, tree: dict[str, Any]) -> Any:
        return self.q.save_async(path, tree)


class QuireStaging(Quire):
    """``save_async`` with ``pinned_staging`` forced on or off (default: on for GPU)."""

    def __init__(self, pinned: bool) -> None:
        super().__init__()
        self.name = "quire pinned" if pinned else "quire pageable"
        self.ctx = self.q.Context(pinned_staging=pinned)

    def start(self, path: str, tree: dict[str, Any]) -> Any:
        with self.ctx:
            return self.q.save_async(path, tree)


class OrbaxV1:
    name = "orbax v1"

    def __init__(self) -> None:
        import absl.logging
        from orbax.checkpoint import v1 as ocp

        absl.logging.set_verbosity(absl.logging.ERROR)
        logging.getLogger("absl").setLevel(logging.ERROR)
        self.ocp = ocp
        opts = ocp.options.ArrayOptions(
            saving=ocp.options.ArrayOptions.Saving(use_compression=False)
        )
        self.ctx = ocp.Context(array_options=opts)

    def start(self, path: str, tree: dict[str, Any]) -> Any:
        with self.ctx:
            return self.ocp.save_pytree_async(path, tree)


@dataclass
class Row:
    blocked: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    slow: list[float] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)


def timed_save(peer: Any, path: str, tree: dict[str, Any], steps: Steps, row: Row) -> None:
    base, _ = steps.run(n=30)
    bl.prewarm(3 * bl.payload_bytes(tree))
    with bl.RssSampler() as rs:
        t0 = time.perf_counter()
        r = peer.start(path, tree)
        row.blocked.append(time.perf_counter() - t0)
        during, n = steps.run(until=r.done if hasattr(r, "done") else None)
        r.result()
        row.total.append(time.perf_counter() - t0)
    row.rss.append(rs.growth)
    after, _ = steps.run(n=30)
    if n >= 3:  # too few steps overlapped the write to say anything
        row.slow.append(during / ((base + after) / 2) - 1)


def run_variant(
    variant: str, args: argparse.Namespace, peers: list[Any], work: str
) -> dict[str, Row]:
    tree = build(variant, args.quick)
    nbytes = bl.payload_bytes(tree)
    print(f"\n-- {variant}: {len(bl.leaves(tree))} leaves, {nbytes / 2**30:.2f} GiB", flush=True)
    steps = Steps()
    rows: dict[str, Row] = {"bare d2h": Row(), "bare copy": Row()} | {p.name: Row() for p in peers}
    for rep in range(args.reps):
        bl.prewarm(3 * nbytes)
        rows["bare d2h"].blocked.append(bare_d2h(tree))
        bl.prewarm(3 * nbytes)
        rows["bare copy"].blocked.append(bare_copy(tree))
        for p in peers:
            path = os.path.join(work, f"{variant}-{p.name.replace(' ', '_')}-{rep}")
            timed_save(p, path, tree, steps, rows[p.name])
            shutil.rmtree(path, ignore_errors=True)
        print(f"   rep {rep + 1}/{args.reps} done", flush=True)
    bl.free(tree)
    return rows


def fmt(all_rows: dict[str, dict[str, Row]]) -> str:
    head = "| variant | method | blocked (s) | total (s) | steps during write | dRSS (GB) |"
    out = [head, "|---|---|---|---|---|---|"]
    for variant, rows in all_rows.items():
        for name, r in rows.items():
            total = f"{min(r.total):.2f}" if r.total else "-"
            slow = f"{statistics.median(r.slow) * 100:+.0f}%" if r.slow else "-"
            rss = f"{max(r.rss) / 1e9:+.2f}" if r.rss else "-"
            out.append(f"| {variant} | {name} | {min(r.blocked):.3f} | {total} | {slow} | {rss} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--peers", default=PEERS)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    makers = {
        "nothing": Nothing,
        "quire": Quire,
        "pinned": lambda: QuireStaging(True),
        "pageable": lambda: QuireStaging(False),
        "orbax": OrbaxV1,
    }
    peers = [makers[p.strip()]() for p in args.peers.split(",") if p.strip()]
    work = tempfile.mkdtemp(prefix="bench_async-", dir=args.dir)
    print(
        f"jax {jax.__version__}, {os.cpu_count()} cpus, "
        f"{psutil.virtual_memory().total / 2**30:.1f} GiB RAM, {jax.device_count()} CPU devices; "
        f"load average {os.getloadavg()[0]:.2f}; writing under {work}"
    )
    all_rows = {}
    try:
        for v in [v.strip() for v in args.variants.split(",") if v.strip()]:
            all_rows[v] = run_variant(v, args, peers, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\n== best of {args.reps} reps (dRSS: max); steps: mean step time during the write "
        "vs just before and after (median over reps: the minimum favours a rep whose baseline\n"
        "another load slowed)\n"
    )
    print(fmt(all_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
