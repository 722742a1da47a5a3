"""Incremental steps: bytes, objects and time per Checkpointer step for three trees.

Run from the repository root::

    .venv/bin/python benchmarks/bench_incremental.py               # 160 MiB tree, 3 reps
    .venv/bin/python benchmarks/bench_incremental.py --quick       # 10 MiB, a smoke run
    .venv/bin/python benchmarks/bench_incremental.py --peers quire-inc,quire

    .venv/bin/python benchmarks/bench_incremental.py --s3          # moto + 20 ms proxy
    .venv/bin/python benchmarks/bench_incremental.py --load [--s3] # load of step 5 vs plain

``--s3``: the quire peers against moto's S3 server behind ``bench_s3.py``'s latency proxy
(20 ms per request, ``--latency-ms``), a 40 MiB tree (``--leaf-mib``, default 1 on S3);
``objects`` is then the HTTP requests through the proxy during the step (reads included:
the lease, the base's record check, the commit), bytes the growth of the bucket prefix.
Icechunk is not run on S3 here (its S3 storage against moto was not set up).

The Icechunk peer needs ``icechunk`` (not a quire dependency; the newest release for
Python 3.11 is 1.1.x): ``.venv/bin/pip install "icechunk==1.1.21"``.  Without it the
peer is skipped with a note.

Trees (40 ``jax.Array`` leaves of equal size, float32, one device each):

* ``frozen``     - 36 leaves (90 % of the bytes) are the same array objects every step,
  4 are new arrays with new values (a LoRA / frozen-backbone fine-tune);
* ``recomputed`` - every leaf is a new array object holding the previous step's bytes;
* ``changed``    - every leaf is a new array with new values.

Peers, one root per peer and tree, steps 0..``--steps`` saved in order:

* ``quire-inc`` - ``quire.Checkpointer(root, incremental=True)``, ``save`` + ``wait``;
* ``quire``     - the same without ``incremental`` (every byte every step);
* ``icechunk``  - an Icechunk repository on the local file system, the same arrays as zarr
  v3 arrays (one chunk each, no compressor), every array assigned every step
  (``arr[...] = np.asarray(leaf)``) and one ``session.commit`` per step: what a generic
  checkpoint loop does; Icechunk writes every chunk written in the session.

Columns: ``step0`` / ``step>0`` (min over reps; step>0: mean over steps 1..N of one rep,
then min over reps) of wall seconds (save until durable, device-to-host copy included),
bytes written (growth of the root's files) and objects written (files created); ``s load``
(local quire peers) the time of ``ck.load`` of the last step (min over reps; an incremental
step reads its borrowed chunks from the earlier steps' packs).  Memory
is pre-warmed before each timed save (as bench_local.py: on this VM freed memory goes back
to the host and touching it again is slow).  ``ratio`` = bytes of steps > 0 / bytes of
step 0.  Differences under ~30 % in time are noise on a shared machine.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MiB = 1 << 20
LEAVES = 40
FROZEN = 36


def prewarm(nbytes: int) -> None:
    buf = np.ones(max(1, 3 * nbytes // 8), np.float64)
    buf[::512] += 1
    del buf


def files(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def make_trees(kind: str, steps: int, leaf_bytes: int) -> Callable[[int], dict[str, Any]]:
    n = leaf_bytes // 4
    rng = np.random.default_rng(0)
    first = {f"l{i:02d}": jnp.asarray(rng.standard_normal(n, np.float32)) for i in range(LEAVES)}
    state = {"prev": first}

    def tree(step: int) -> dict[str, Any]:
        if step == 0:
            return first
        prev = state["prev"]
        if kind == "frozen":
            out = dict(prev)
            for i in range(FROZEN, LEAVES):
                out[f"l{i:02d}"] = jnp.asarray(rng.standard_normal(n, np.float32))
        elif kind == "recomputed":
            out = {k: jnp.asarray(np.asarray(v).copy()) for k, v in prev.items()}
        else:
            out = {k: jnp.asarray(rng.standard_normal(n, np.float32)) for k in prev}
        state["prev"] = out
        return out

    return tree


def run_quire(
    root: Path, trees: list[dict[str, Any]], incremental: bool
) -> list[tuple[float, int, int]]:
    import quire

    out = []
    with quire.Checkpointer(root, incremental=incremental, gc_grace_period=None) as ck:
        for step, t in enumerate(trees):
            before = files(root)
            prewarm(sum(x.nbytes for x in t.values()))
            t0 = time.perf_counter()
            ck.save(step, t)
            ck.wait()
            dt = time.perf_counter() - t0
            after = files(root)
            new = set(after) - set(before)
            out.append((dt, sum(after.values()) - sum(before.values()), len(new)))
        prewarm(sum(x.nbytes for x in trees[-1].values()))
        t0 = time.perf_counter()
        got = ck.load(len(trees) - 1)
        jax.block_until_ready(got)
        LOADS.setdefault(incremental, []).append(time.perf_counter() - t0)
    return out


LOADS: dict[bool, list[float]] = {}


def run_icechunk(root: Path, trees: list[dict[str, Any]]) -> list[tuple[float, int, int]]:
    import icechunk
    import zarr

    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(str(root)))
    out = []
    for step, t in enumerate(trees):
        before = files(root)
        prewarm(sum(x.nbytes for x in t.values()))
        t0 = time.perf_counter()
        session = repo.writable_session("main")
        store = session.store
        for k, v in t.items():
            host = np.asarray(v)
            if step == 0:
                arr = zarr.create_array(
                    store,
                    name=k,
                    shape=host.shape,
                    dtype=host.dtype,
                    chunks=host.shape,
                    compressors=None,
                    filters=None,
                )
            else:
                arr = zarr.open_array(store, path=k, mode="r+")
            arr[...] = host
        session.commit(f"step {step}")
        dt = time.perf_counter() - t0
        after = files(root)
        new = set(after) - set(before)
        out.append((dt, sum(after.values()) - sum(before.values()), len(new)))
    return out


def run_quire_s3(
    h: Any,
    client: Any,
    bucket: str,
    trees: list[dict[str, Any]],
    incremental: bool,
    options: dict[str, Any],
) -> list[tuple[float, int, int]]:
    import uuid

    import quire

    prefix = f"inc-{uuid.uuid4().hex[:8]}"

    def size() -> int:
        total = 0
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            total += sum(o["Size"] for o in page.get("Contents", []))
        return total

    out = []
    root = f"s3://{bucket}/{prefix}"
    with quire.Checkpointer(
        root, incremental=incremental, gc_grace_period=None, storage_options=options
    ) as ck:
        for step, t in enumerate(trees):
            before = size()
            h.take_log()
            t0 = time.perf_counter()
            ck.save(step, t)
            ck.wait()
            dt = time.perf_counter() - t0
            requests = h.take_log() or 0
            out.append((dt, size() - before, requests))
    return out


def s3_harness(latency_ms: float) -> tuple[Any, Any, dict[str, Any]]:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import boto3
    from bench_s3 import CONFIGS, KEY, SECRET, Harness

    ns = argparse.Namespace(endpoint=None, no_proxy=False, latency_ms=latency_ms)
    h = Harness(ns, CONFIGS["stock"])
    client = boto3.client(
        "s3", endpoint_url=h.server, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
        region_name="us-east-1",
    )  # fmt: skip
    client.create_bucket(Bucket="bench-inc")
    options = {"endpoint_url": h.endpoint, "key": KEY, "secret": SECRET}
    return h, client, options


GROUPS = 5  # --load: step s (1..GROUPS) changes the s-th fifth of the leaves


def bench_load(args: argparse.Namespace, base: Path) -> None:
    """``--load``: load step 5 of an incremental root against the same state from a plain
    (non-incremental) root.  Steps 1..5 each change another fifth of the leaves, so step 5
    owns one fifth and borrows the rest from the packs of steps 0..4 (one moved by
    compaction at step 3); the plain root holds step 5's state, saved once.  Each load is
    ``quire.load(step url)`` into host-backed jax arrays, memory pre-warmed, min of reps,
    the two roots interleaved; on ``--s3``, through the latency proxy, with requests."""
    import quire

    leaf = int((args.leaf_mib or (2 if args.s3 else 8)) * MiB)
    n = leaf // 4
    rng = np.random.default_rng(0)
    tree = {f"l{i:02d}": jnp.asarray(rng.standard_normal(n, np.float32)) for i in range(LEAVES)}
    total = LEAVES * leaf
    h = None
    options: dict[str, Any] | None = None
    if args.s3:
        h, _client, options = s3_harness(args.latency_ms)
        inc, plain = "s3://bench-inc/load-inc", "s3://bench-inc/load-plain"
    else:
        inc, plain = str(base / "load-inc"), str(base / "load-plain")
    with quire.Checkpointer(
        inc, incremental=True, gc_grace_period=None, storage_options=options
    ) as ck:
        ck.save(0, tree)
        ck.wait()
        for s in range(1, GROUPS + 1):
            tree = dict(tree)
            for i in range(LEAVES):
                if i % GROUPS == s - 1:
                    tree[f"l{i:02d}"] = jnp.asarray(rng.standard_normal(n, np.float32))
            ck.save(s, tree)
            ck.wait()
    with quire.Checkpointer(plain, gc_grace_period=None, storage_options=options) as ck:
        ck.save(GROUPS, tree)
        ck.wait()
    step = f"step_{GROUPS:08d}"
    meta = quire.metadata(f"{inc}/{step}", storage_options=options)
    borrowed = {t for e in meta.record.get("indexes", []) for t in e.get("borrowed", {})}
    times: dict[str, list[float]] = {"incremental": [], "plain": []}
    requests: dict[str, int | None] = {}
    for _ in range(args.reps):
        for name, root in (("incremental", inc), ("plain", plain)):
            prewarm(total)
            if h is not None:
                h.take_log()
            t0 = time.perf_counter()
            got = quire.load(f"{root}/{step}", storage_options=options)
            jax.block_until_ready(got)
            times[name].append(time.perf_counter() - t0)
            if h is not None:
                requests[name] = h.take_log()
            assert all(np.array_equal(np.asarray(got[k]), np.asarray(tree[k])) for k in tree)
            del got
    where = f"moto + {args.latency_ms:g} ms" if args.s3 else "local"
    print(
        f"# load of step {GROUPS} ({where}): {LEAVES} leaves x {leaf / MiB:g} MiB = "
        f"{total / MiB:g} MiB, borrowing from {len(borrowed)} packs of earlier steps; "
        f"min of {args.reps} reps"
    )
    print(f"{'root':<12} {'s load':>8} {'GiB/s':>7} {'requests':>9}")
    for name, ts in times.items():
        r = requests.get(name)
        print(
            f"{name:<12} {min(ts):8.3f} {total / (1 << 30) / min(ts):7.2f} "
            f"{'-' if r is None else r:>9}"
        )
    print(f"speed ratio incremental/plain: {min(times['plain']) / min(times['incremental']):.3f}")
    if h is not None:
        h.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--load", action="store_true", help="the load benchmark (bench_load)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--peers", default="quire-inc,quire,icechunk")
    ap.add_argument("--trees", default="frozen,recomputed,changed")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--s3", action="store_true")
    ap.add_argument("--latency-ms", type=float, default=20)
    ap.add_argument("--leaf-mib", type=float, default=None)
    args = ap.parse_args()
    leaf = (256 << 10) if args.quick else (4 * MiB)
    if args.s3:
        leaf = int((args.leaf_mib or 1) * MiB)
    elif args.leaf_mib:
        leaf = int(args.leaf_mib * MiB)
    if args.load:
        base = Path(args.dir or tempfile.mkdtemp(prefix="quire-bench-inc-"))
        try:
            bench_load(args, base)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        return
    peers = args.peers.split(",")
    h = None
    if args.s3:
        peers = [p for p in peers if p != "icechunk"]
        h, client, options = s3_harness(args.latency_ms)
    if "icechunk" in peers and not args.s3:
        try:
            import icechunk  # noqa: F401
        except ImportError:
            print("# icechunk not installed: peer skipped (pip install 'icechunk==1.1.21')")
            peers.remove("icechunk")
    print(
        f"# {LEAVES} leaves x {leaf / MiB:g} MiB = {LEAVES * leaf / MiB:g} MiB, "
        f"{args.steps} steps after step 0, min of {args.reps} reps, jax {jax.__version__}"
    )
    print(
        f"{'tree':<11} {'peer':<10} {'s step0':>8} {'s step>0':>9} {'MiB step0':>10} "
        f"{'MiB step>0':>11} {'ratio':>7} {'obj step0':>9} {'obj step>0':>10} {'s load':>7}"
    )
    base = Path(args.dir or tempfile.mkdtemp(prefix="quire-bench-inc-"))
    for kind in args.trees.split(","):
        LOADS.clear()
        results: dict[str, list[list[tuple[float, int, int]]]] = {p: [] for p in peers}
        for rep in range(args.reps):
            make = make_trees(kind, args.steps, leaf)
            trees = [make(s) for s in range(args.steps + 1)]
            for peer in peers:  # interleaved within each rep
                root = base / f"{kind}-{peer}-{rep}"
                shutil.rmtree(root, ignore_errors=True)
                if args.s3:
                    r = run_quire_s3(h, client, "bench-inc", trees, peer == "quire-inc", options)
                elif peer == "icechunk":
                    r = run_icechunk(root, trees)
                else:
                    r = run_quire(root, trees, incremental=peer == "quire-inc")
                results[peer].append(r)
                shutil.rmtree(root, ignore_errors=True)
        for peer, reps in results.items():
            t0 = min(r[0][0] for r in reps)
            tn = min(statistics.mean(x[0] for x in r[1:]) for r in reps)
            b0 = min(r[0][1] for r in reps)
            bn = min(statistics.mean(x[1] for x in r[1:]) for r in reps)
            o0 = min(r[0][2] for r in reps)
            on = min(statistics.mean(x[2] for x in r[1:]) for r in reps)
            loads = LOADS.get(peer == "quire-inc") if peer != "icechunk" else None
            load = f"{min(loads):7.3f}" if loads else f"{'-':>7}"
            print(
                f"{kind:<11} {peer:<10} {t0:8.3f} {tn:9.3f} {b0 / MiB:10.2f} {bn / MiB:11.3f} "
                f"{bn / b0:7.3f} {o0:9d} {on:10.1f} {load}"
            )
        sys.stdout.flush()
    shutil.rmtree(base, ignore_errors=True)
    if h is not None:
        h.stop()


if __name__ == "__main__":
    main()
