"""Codec chains on trained weights and optimizer moments: quire's save / load time and stored
bytes per chain, against Orbax's default (zstd) on the same tree in the same run (issue 37).

Run from the repository root::

    .venv/bin/python benchmarks/bench_codecs.py                     # width 1536, 300 steps, 5 reps
    .venv/bin/python benchmarks/bench_codecs.py --width 2048 --reps 7 --dir /mnt/scratch
    .venv/bin/python benchmarks/bench_codecs.py --quick             # width 512, 100 steps, 2 reps

The tree: a 4-layer MLP (``d -> width -> width -> width -> d``, d = width / 4) trained with
``optax.adam`` for ``--steps`` steps on a teacher-student regression, so that weights and moments
hold trained values, not random bits: ``params`` (float32), ``opt_state`` (Adam's ``mu`` and
``nu``, float32, and the step ``count``) and ``params_bf16`` (the weights in bfloat16, as a
mixed-precision run keeps them).  numpy arrays on the host.

Rows: quire with each chain (format v2, packed, local disk), and Orbax's
``StandardCheckpointer`` (OCDBT, zarr with tensorstore's zstd at level 1: Orbax 0.12's default).
Every chain is lossless (each load is compared bit for bit).  The chains:

* ``none``: raw bytes + crc32c;
* ``zstd``: zarr's zstd, level 3 (quire's default level) and level 1 (Orbax's);
* ``blosc bitshuffle``: zarr's blosc with bit shuffle, zstd (clevel 1) or lz4 (clevel 5) inside;
* ``numcodecs.lz4``: by name, through zarr's registry;
* ``shuffle + zstd``: numcodecs' byte shuffle then numcodecs' zstd level 1.  zarr v3 calls
  numcodecs' shuffle a bytes-to-bytes codec; a filter + compressor pair all the same;
* ``transpose + zstd``: the array-to-array + compressor pair among the standard zarr v3
  codecs.  numcodecs has no lossless array-to-array codec that helps floats: ``delta`` on
  floats does not restore bit for bit (its cumulative sum rounds), ``bitround`` /
  ``quantize`` / ``fixedscaleoffset`` are lossy by design.

Methodology: ``--reps`` repetitions, rows interleaved inside each (the order rotates every
rep); the median (and the min) of each phase is reported.  Before every timed phase ~3x the
payload is allocated, touched and freed (on a VM memory left free is handed back to the host
and touching it again is slow).  Loads read from the page cache right after the save (no
root to drop it).  Stored bytes: every file under the checkpoint.  ``x orbax``: Orbax's median
seconds / the row's (>1: faster than Orbax).  ``cpu s``: the process's CPU seconds over all its
threads (Orbax's tensorstore threads included), which other programs disturb far less than
wall time.  The load average at the start and the end is
printed: on a busy machine differences under ~30% are noise.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import gc
import itertools
import logging
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

MB = 1e6


# ------------------------------------------------------------------------------ the tree
def train(width: int, steps: int, batch: int, seed: int = 0) -> dict[str, Any]:
    """Weights and Adam moments of an MLP trained ``steps`` steps; numpy leaves."""
    import optax

    d = max(8, width // 4)
    sizes = [d, width, width, width, d]
    key = jax.random.key(seed)

    def init(k: Any, fan_in: int, fan_out: int) -> dict[str, Any]:
        return {
            "w": jax.random.normal(k, (fan_in, fan_out), jnp.float32) / np.sqrt(fan_in),
            "b": jnp.zeros(fan_out, jnp.float32),
        }

    keys = jax.random.split(key, 2 * len(sizes))
    pairs = list(itertools.pairwise(sizes))
    params = {f"layer{i}": init(keys[i], a, b) for i, (a, b) in enumerate(pairs)}
    teacher = {f"layer{i}": init(keys[len(sizes) + i], a, b) for i, (a, b) in enumerate(pairs)}

    def forward(p: dict[str, Any], x: Any) -> Any:
        n = len(p)
        for i in range(n):
            x = x @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"]
            if i < n - 1:
                x = jax.nn.gelu(x)
        return x

    opt = optax.adam(1e-3)
    state = opt.init(params)

    @jax.jit
    def step(p: Any, s: Any, k: Any) -> tuple[Any, Any, Any]:
        x = jax.random.normal(k, (batch, d), jnp.float32)
        y = forward(teacher, x)
        loss, grads = jax.value_and_grad(lambda q: jnp.mean((forward(q, x) - y) ** 2))(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    t0 = time.perf_counter()
    losses = []
    for i in range(steps):
        params, state, loss = step(params, state, jax.random.fold_in(key, i))
        if i in (0, steps - 1):
            losses.append(float(loss))
    print(
        f"trained {steps} steps in {time.perf_counter() - t0:.0f} s, loss {losses[0]:.4f} -> "
        f"{losses[-1]:.4f}",
        flush=True,
    )
    adam = state[0]  # optax.ScaleByAdamState(count, mu, nu)
    host = jax.device_get(
        {
            "params": params,
            "opt_state": {"count": adam.count, "mu": adam.mu, "nu": adam.nu},
            "params_bf16": jax.tree.map(lambda a: a.astype(jnp.bfloat16), params),
        }
    )
    return jax.tree.map(np.asarray, host)


def payload(tree: Any) -> int:
    return sum(int(a.nbytes) for a in jax.tree.leaves(tree))


def abstract_of(tree: Any) -> Any:
    """Targets with no memory behind them (0-stride views)."""
    return jax.tree.map(lambda a: np.broadcast_to(np.zeros((), a.dtype), a.shape), tree)


def same_bits(a: Any, b: Any, who: str) -> None:
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        y = np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            raise AssertionError(f"{who}: {jax.tree_util.keystr(path)} differs after a load")


def stored_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def prewarm(nbytes: int) -> None:
    """Allocate and touch ``nbytes``, then free them (and hand glibc's free heap back)."""
    gc.collect()
    w = np.ones(max(1, nbytes // 8), np.float64)
    del w
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ------------------------------------------------------------------------------ the rows
def chains() -> dict[str, list[Any] | None]:
    zstd1 = {"name": "zstd", "configuration": {"level": 1}}

    def blosc(cname: str, clevel: int) -> dict[str, Any]:
        config = {"cname": cname, "clevel": clevel, "shuffle": "bitshuffle"}
        return {"name": "blosc", "configuration": config}

    return {
        "none": None,
        "zstd (3)": ["zstd"],
        "zstd (1)": [zstd1],
        "blosc bitshuffle (zstd 1)": [blosc("zstd", 1)],
        "blosc bitshuffle (lz4 5)": [blosc("lz4", 5)],
        "numcodecs.lz4": ["numcodecs.lz4"],
        "shuffle + zstd (1)": [
            "numcodecs.shuffle",
            {"name": "numcodecs.zstd", "configuration": {"level": 1}},
        ],
        "transpose + zstd (1)": [{"name": "transpose", "configuration": {"order": "T"}}, zstd1],
    }


def storage_for(codecs: list[Any] | None) -> Any:
    """``StorageOptions`` for a chain; ``"T"`` in a transpose order: each leaf's axes reversed."""
    import quire

    if codecs is None:
        return None

    def per_leaf(path: Any, leaf: Any) -> Any:
        out = []
        for c in codecs:
            if isinstance(c, dict) and c["name"] == "transpose":
                nd = np.ndim(leaf)
                if nd < 2:
                    continue  # nothing to transpose
                c = {"name": "transpose", "configuration": {"order": list(range(nd))[::-1]}}
            out.append(c)
        return quire.StorageOptions(codecs=out)

    return per_leaf


@dataclass
class Row:
    name: str
    save: Callable[[str], None]
    load: Callable[[str], Any]
    saves: list[float] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)
    save_cpu: list[float] = field(default_factory=list)  # process CPU seconds, all threads
    load_cpu: list[float] = field(default_factory=list)
    stored: int = 0


def rows(tree: Any, only: set[str] | None) -> list[Row]:
    import quire

    target = abstract_of(tree)
    out = []
    for name, codecs in chains().items():
        storage = storage_for(codecs)

        def save(p: str, storage: Any = storage) -> None:
            quire.save(p, tree, storage=storage)

        out.append(Row(f"quire {name}", save, lambda p: quire.load(p, target)))

    import absl.logging
    import orbax.checkpoint as ocp

    absl.logging.set_verbosity(absl.logging.ERROR)
    logging.getLogger("absl").setLevel(logging.ERROR)
    ck = ocp.StandardCheckpointer()

    def orbax_save(p: str) -> None:
        ck.save(p, tree)
        ck.wait_until_finished()

    out.append(Row("orbax (default: zstd 1)", orbax_save, lambda p: ck.restore(p, target)))
    return [r for r in out if only is None or r.name in only]


def run(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore")
    load0 = os.getloadavg()
    tree = train(args.width, args.steps, args.batch)
    n = payload(tree)
    print(
        f"tree: {len(jax.tree.leaves(tree))} arrays, {n / MB:.1f} MB "
        f"(float32 {sum(a.nbytes for a in jax.tree.leaves(tree) if a.dtype == np.float32) / MB:.1f} MB, "
        f"bfloat16 {sum(a.nbytes for a in jax.tree.leaves(tree) if a.dtype == ml_dtypes.bfloat16) / MB:.1f} MB)",
        flush=True,
    )
    table = rows(tree, set(args.only.split(",")) if args.only else None)
    base = tempfile.mkdtemp(prefix="bench_codecs_", dir=args.dir)
    try:
        for rep in range(args.reps):
            k = rep % len(table)
            for row in table[k:] + table[:k]:
                path = os.path.join(base, f"{len(row.saves)}-{abs(hash(row.name))}")
                prewarm(3 * n)
                t0, c0 = time.perf_counter(), time.process_time()
                row.save(path)
                row.saves.append(time.perf_counter() - t0)
                row.save_cpu.append(time.process_time() - c0)
                row.stored = stored_bytes(path)
                prewarm(3 * n)
                t0, c0 = time.perf_counter(), time.process_time()
                got = row.load(path)
                row.loads.append(time.perf_counter() - t0)
                row.load_cpu.append(time.process_time() - c0)
                same_bits(tree, got, row.name)
                del got
                shutil.rmtree(path)
            print(f"rep {rep + 1}/{args.reps} done", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report(table, n, load0, args)


def report(table: list[Row], n: int, load0: tuple[float, ...], args: argparse.Namespace) -> None:
    orbax = next((r for r in table if r.name.startswith("orbax")), None)
    o_save = statistics.median(orbax.saves) if orbax else float("nan")
    o_load = statistics.median(orbax.loads) if orbax else float("nan")
    print()
    print(f"command: {' '.join([sys.executable.split('/')[-1], *sys.argv])}")
    print(f"payload {n / MB:.1f} MB; medians (min) of {args.reps} reps; load average at start "
          f"{load0[0]:.1f}, at end {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs")  # fmt: skip
    head = (
        f"| {'row':32} | {'save s':>14} | {'x orbax':>7} | {'load s':>14} | {'x orbax':>7} "
        f"| {'save cpu s':>10} | {'load cpu s':>10} | {'stored MB':>9} | {'ratio':>5} "
        f"| {'vs orbax':>8} |"
    )
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in table:
        s, ld = statistics.median(r.saves), statistics.median(r.loads)
        print(
            f"| {r.name:32} | {s:6.2f} ({min(r.saves):5.2f}) | {o_save / s:7.2f} "
            f"| {ld:6.2f} ({min(r.loads):5.2f}) | {o_load / ld:7.2f} "
            f"| {statistics.median(r.save_cpu):10.2f} | {statistics.median(r.load_cpu):10.2f} "
            f"| {r.stored / MB:9.1f} | {n / r.stored:5.2f} "
            f"| {r.stored / orbax.stored if orbax else float('nan'):8.3f} |"
        )
    if orbax is None:
        return
    print()
    goal = [
        r
        for r in table
        if r is not orbax
        and r.stored <= orbax.stored
        and o_save / statistics.median(r.saves) >= 1.5
    ]
    print(
        "goal (a lossless chain storing <= Orbax's bytes, saving >= 1.5x faster): "
        + (", ".join(r.name for r in goal) if goal else "missed")
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=1536)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: /tmp)")
    p.add_argument("--only", default=None, help="comma-separated row names")
    p.add_argument("--quick", action="store_true", help="width 512, 100 steps, 2 reps")
    args = p.parse_args()
    if args.quick:
        args.width, args.steps, args.reps = 512, 100, 2
    run(args)


if __name__ == "__main__":
    main()
