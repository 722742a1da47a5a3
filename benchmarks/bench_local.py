"""Local-disk save/load benchmark: quire vs orbax-checkpoint vs safetensors vs raw numpy.

Run from the repository root::

    .venv/bin/python benchmarks/bench_local.py            # full tree (~1.3 GiB), 3 reps
    .venv/bin/python benchmarks/bench_local.py --quick    # ~170 MiB, for CI smoke runs
    .venv/bin/python benchmarks/bench_local.py --reps 5 --dir /mnt/scratch --variants numpy

The tree (1.26 GiB of array payload; the issue calls it "~2 GiB" but lists these sizes):
2 arrays of 256 MiB, 24 of 32 MiB, 400 small arrays of 4-64 KiB and a few Python scalars, a mix of float32 and bfloat16 (``ml_dtypes.bfloat16``).  Two variants:

* ``numpy``   - every array is a ``numpy.ndarray``;
* ``sharded`` - the 26 big arrays are ``jax.Array``s sharded along axis 0 over a 1-D mesh of
  8 CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``); small ones stay numpy.

Peers, all in this one process:

* ``quire``       - ``quire.save`` / ``quire.load`` (format v2, packed; plus a ``save_async``
  row: the time the caller is blocked until ``save_async`` returns, and the total until
  ``.result()``);
* ``quire-v1``    - the same with ``layout="chunks"`` (format v1, one object per chunk): the
  ``files`` column compares objects per checkpoint (``--peers quire,quire-v1`` for only those);
* ``orbax``       - ``orbax.checkpoint.StandardCheckpointer`` save + ``wait_until_finished`` /
  restore against an abstract tree (OCDBT, the 0.12 default; tensorstore's file driver fsyncs);
* ``safetensors`` - ``safetensors.numpy.save_file`` + ``os.fsync`` of the file / ``load_file``
  (bfloat16 is supported natively by safetensors 0.8, no uint16 view needed; scalars are stored
  as 0-d arrays; jax arrays are gathered with ``np.asarray`` and re-sharded with
  ``jax.device_put``);
* ``raw``         - ``arr.tofile`` per leaf (per device shard in the sharded variant) +
  ``os.fsync`` of each file / ``np.fromfile`` (shapes and dtypes come from the in-memory tree: no
  metadata at all; a lower bound on what any format can cost).

Methodology: the best (minimum) of ``--reps`` repetitions is reported; peers are interleaved
inside each repetition.  Right before every timed phase ~3x the payload is allocated, touched
and freed (on this VM memory left free for ~2 s is handed back to the host and touching it
again is ~10x slower).  Checkpoints are deleted after each repetition.  The page cache cannot
be dropped (no root), so **loads read from the page cache** right after the save.  Peak RSS
growth over the phase's starting RSS is sampled every 5 ms in a thread (max over reps).
GB/s uses 1 GB = 1e9 bytes of array payload.  ``quire/peer`` is the throughput ratio (peer
seconds / quire seconds) for the same op; treat differences under ~30% as noise.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import gc
import logging
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import ml_dtypes
import numpy as np
import psutil

MiB = 1 << 20
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


# ----------------------------------------------------------------------------- the tree
def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    n = int(np.prod(shape))
    f = rng.random(n, dtype=np.float32)
    if dtype == BF16:
        f = (f.view(np.uint32) >> 16).astype(np.uint16).view(BF16)
    return f.reshape(shape)


def _shape_for(nbytes: int, dtype: np.dtype, cols: int) -> tuple[int, int]:
    n = nbytes // dtype.itemsize
    return (n // cols, cols)


def build_tree(quick: bool, sharded: bool, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    scale = 8 if quick else 1
    n_small = 100 if quick else 400
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))

    def big(nbytes: int, dtype: np.dtype) -> Any:
        a = _random(rng, _shape_for(nbytes // scale, dtype, 4096), dtype)
        if sharded:
            out = jax.device_put(a, sh)
            out.block_until_ready()
            return out
        return a

    tree: dict[str, Any] = {"big": {}, "mid": {}, "small": {}, "scalars": {}}
    for i in range(2):
        tree["big"][f"w{i}"] = big(256 * MiB, (F32, BF16)[i % 2])
    for i in range(24):
        tree["mid"][f"layer{i:02d}"] = big(32 * MiB, (F32, BF16)[i % 2])
    for i in range(n_small):
        dt = (F32, BF16)[i % 2]
        nb = int(rng.integers(4, 65)) * 1024
        shape = (nb // dt.itemsize,) if i % 3 else (nb // dt.itemsize // 64, 64)
        tree["small"][f"p{i:03d}"] = _random(rng, shape, dt)
    tree["scalars"] = {"step": 12345, "lr": 3e-4, "epoch": 7, "loss": 1.25}
    return tree


def leaves(tree: dict[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for g, sub in tree.items():
        for k, v in sub.items():
            out.append((f"{g}.{k}", v))
    return out


def payload_bytes(tree: dict[str, Any]) -> int:
    return sum(int(v.nbytes) for _, v in leaves(tree) if hasattr(v, "nbytes"))


def abstract_of(tree: dict[str, Any]) -> dict[str, Any]:
    """Targets with no memory behind them: ShapeDtypeStruct for jax, 0-stride numpy views."""

    def one(v: Any) -> Any:
        if isinstance(v, jax.Array):
            return jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
        if isinstance(v, np.ndarray):
            return np.broadcast_to(np.zeros((), v.dtype), v.shape)
        return type(v)(0)

    return {g: {k: one(v) for k, v in sub.items()} for g, sub in tree.items()}


def verify(orig: dict[str, Any], got: dict[str, Any], who: str) -> None:
    for g, sub in orig.items():
        for k, v in sub.items():
            w = got[g][k]
            if isinstance(v, jax.Array) and (
                not isinstance(w, jax.Array) or w.sharding != v.sharding
            ):
                raise AssertionError(
                    f"{who}: {g}.{k}: expected a jax.Array with {v.sharding}, got {type(w)}"
                )
            a, b = np.asarray(v), np.asarray(w)
            if a.shape != b.shape or a.dtype != b.dtype:
                raise AssertionError(f"{who}: {g}.{k}: {a.shape} {a.dtype} != {b.shape} {b.dtype}")
            if not np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)):
                raise AssertionError(f"{who}: {g}.{k}: data differs")


def free(x: Any) -> None:
    for leaf in jax.tree_util.tree_leaves(x):
        if isinstance(leaf, jax.Array):
            leaf.delete()


def count_files(path: str) -> int:
    if os.path.isfile(path):
        return 1
    return sum(len(fs) for _, _, fs in os.walk(path))


# ----------------------------------------------------------------------------- measurement
class RssSampler:
    """Peak RSS growth over the starting RSS, sampled in a thread."""

    def __init__(self, interval: float = 0.005) -> None:
        self.proc = psutil.Process()
        self.interval = interval

    def __enter__(self) -> RssSampler:
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.base


def _malloc_trim() -> Callable[[], None]:
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return lambda: libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        return lambda: None


malloc_trim = _malloc_trim()


def prewarm(nbytes: int) -> None:
    """Allocate and touch ``nbytes`` then free them, so the host backs the pages again.

    ``malloc_trim`` then hands glibc's free heap back, so that the RSS growth of the next
    phase is not hidden by memory an earlier phase freed into the heap.
    """
    gc.collect()
    w = np.ones(max(1, nbytes // 8), np.float64)
    del w
    malloc_trim()


@dataclass
class Result:
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # process CPU seconds (all threads)
    blocked: list[float] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    files: int | None = None


# ----------------------------------------------------------------------------- peers
def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Peer:
    name = "?"

    def save(self, path: str, tree: dict[str, Any]) -> float | None:
        """Save; returns the caller-blocked seconds for async peers (else None)."""
        raise NotImplementedError

    def load(self, path: str, tree: dict[str, Any], abstract: dict[str, Any]) -> Any:
        raise NotImplementedError


class QuirePeer(Peer):
    name = "quire"

    def __init__(self) -> None:
        import quire

        self.q = quire

    def save(self, path: str, tree: dict[str, Any]) -> float | None:
        self.q.save(path, tree)
        return None

    def load(self, path: str, tree: dict[str, Any], abstract: dict[str, Any]) -> Any:
        return self.q.load(path, abstract)


class QuireV1Peer(QuirePeer):
    """quire with format v1 (``layout="chunks"``: one object per zarr chunk), for the
    v1-vs-v2 comparison in the same run."""

    name = "quire v1"

    def save(self, path: str, tree: dict[str, Any]) -> float | None:
        self.q.save(path, tree, layout="chunks")
        return None


class QuireAsyncPeer(QuirePeer):
    name = "quire async"

    def save(self, path: str, tree: dict[str, Any]) -> float | None:
        t0 = time.perf_counter()
        r = self.q.save_async(path, tree)
        blocked = time.perf_counter() - t0
        r.result()
        return blocked


class OrbaxPeer(Peer):
    name = "orbax"

    def __init__(self) -> None:
        import absl.logging
        import orbax.checkpoint as ocp

        absl.logging.set_verbosity(absl.logging.ERROR)
        logging.getLogger("absl").setLevel(logging.ERROR)
        self.ck = ocp.StandardCheckpointer()

    def save(self, path: str, tree: dict[str, Any]) -> float | None:
        t0 = time.perf_counter()
        self.ck.save(path, tree)
        blocked = time.perf_counter() - t0
        self.ck.wait_until_finished()
        return blocked

    def load(self, path: str, tree: dict[str, Any], abstract: dict[str, Any]) -> Any:
        return self.ck.restore(path, abstract)


class SafetensorsPeer(Peer):
    name = "safetensors"

    def save(self, path: str, tree: dict[str, Any]) -> float | None:
        from safetensors.numpy import save_file

        flat = {k: np.asarray(v) for k, v in leaves(tree)}
        save_file(flat, path)
        _fsync_path(path)
        return None

    def load(self, path: str, tree: dict[str, Any], abstract: dict[str, Any]) -> Any:
        from safetensors.numpy import load_file

        flat = load_file(path)
        out: dict[str, Any] = {}
        for g, sub in abstract.items():
            out[g] = {}
            for k, a in sub.items():
                v = flat.pop(f"{g}.{k}")
                if isinstance(a, jax.ShapeDtypeStruct):
                    v = jax.device_put(v, a.sharding)
                elif not isinstance(a, np.ndarray):
                    v = type(a)(v[()])
                out[g][k] = v
        return out


class RawNumpyPeer(Peer):
    name = "raw numpy"

    @staticmethod
    def _write(path: str, arr: np.ndarray) -> None:
        with open(path, "wb") as f:
            arr.tofile(f)
            f.flush()
            os.fsync(f.fileno())

    def save(self, path: str, tree: dict[str, Any]) -> float | None:
        os.makedirs(path)
        for name, v in leaves(tree):
            if isinstance(v, jax.Array):
                for s in v.addressable_shards:
                    if s.replica_id == 0:
                        self._write(f"{path}/{name}.{s.device.id}", np.asarray(s.data))
            else:
                self._write(f"{path}/{name}", np.asarray(v))
        return None

    def load(self, path: str, tree: dict[str, Any], abstract: dict[str, Any]) -> Any:
        out: dict[str, Any] = {}
        for g, sub in abstract.items():
            out[g] = {}
            for k, a in sub.items():
                name = f"{path}/{g}.{k}"
                if isinstance(a, jax.ShapeDtypeStruct):
                    idx = a.sharding.addressable_devices_indices_map(a.shape)
                    bufs = []
                    for d, ix in idx.items():
                        shp = tuple(len(range(*s.indices(n))) for s, n in zip(ix, a.shape))
                        host = np.fromfile(f"{name}.{d.id}", dtype=a.dtype).reshape(shp)
                        bufs.append(jax.device_put(host, d))
                    out[g][k] = jax.make_array_from_single_device_arrays(a.shape, a.sharding, bufs)
                elif isinstance(a, np.ndarray):
                    out[g][k] = np.fromfile(name, dtype=a.dtype).reshape(a.shape)
                else:
                    v = tree[g][k]
                    out[g][k] = type(a)(np.fromfile(name, dtype=np.asarray(v).dtype)[0])
        return out


PEERS: dict[str, Callable[[], Peer]] = {
    "quire": QuirePeer,
    "quire-v1": QuireV1Peer,
    "quire-async": QuireAsyncPeer,
    "orbax": OrbaxPeer,
    "safetensors": SafetensorsPeer,
    "raw": RawNumpyPeer,
}


# ----------------------------------------------------------------------------- driver
def run_variant(
    variant: str, args: argparse.Namespace, peers: dict[str, Peer], workdir: str
) -> tuple[int, dict[tuple[str, str], Result]]:
    tree = build_tree(args.quick, variant == "sharded")
    nbytes = payload_bytes(tree)
    abstract = abstract_of(tree)
    n_arrays = sum(1 for _, v in leaves(tree) if hasattr(v, "nbytes"))
    print(
        f"\n== variant {variant}: {nbytes / MiB:.1f} MiB in {n_arrays} arrays + "
        f"{len(tree['scalars'])} scalars",
        flush=True,
    )
    res: dict[tuple[str, str], Result] = {}
    warm = int(args.prewarm * nbytes)
    for rep in range(args.reps):
        for key, peer in peers.items():
            path = os.path.join(
                workdir, f"{variant}-{key}-{rep}" + (".safetensors" if key == "safetensors" else "")
            )
            rs = res.setdefault((key, "save"), Result())
            prewarm(warm)
            with RssSampler() as m:
                t0, c0 = time.perf_counter(), time.process_time()
                blocked = peer.save(path, tree)
                dt = time.perf_counter() - t0
                rs.cpu.append(time.process_time() - c0)
            rs.times.append(dt)
            rs.rss.append(m.growth)
            if blocked is not None:
                rs.blocked.append(blocked)
            rs.files = count_files(path)
            line = f"  rep {rep} {peer.name:<12} save {dt:7.3f}s"
            if blocked is not None:
                line += f" (blocked {blocked:.3f}s)"
            if key != "quire-async":  # the async variant writes the same thing; load once
                rl = res.setdefault((key, "load"), Result())
                prewarm(warm)
                with RssSampler() as m:
                    t0, c0 = time.perf_counter(), time.process_time()
                    got = peer.load(path, tree, abstract)
                    jax.block_until_ready(
                        [x for x in jax.tree_util.tree_leaves(got) if isinstance(x, jax.Array)]
                    )
                    dt = time.perf_counter() - t0
                    rl.cpu.append(time.process_time() - c0)
                rl.times.append(dt)
                rl.rss.append(m.growth)
                line += f"  load {dt:7.3f}s"
                if rep == 0 and not args.no_verify:
                    verify(tree, got, f"{peer.name} ({variant})")
                free(got)
                del got
            print(line, flush=True)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
            gc.collect()
    free(tree)
    del tree
    gc.collect()
    return nbytes, res


def fmt_table(all_res: dict[str, tuple[int, dict[tuple[str, str], Result]]], reps: int) -> str:
    hdr = [
        "variant",
        "peer",
        "op",
        "best s",
        "GB/s",
        "quire/peer",
        "files",
        "peak dRSS MiB",
        "blocked s",
        "all reps s",
    ]
    rows = [hdr]
    for variant, (nbytes, res) in all_res.items():
        for (key, op), r in res.items():
            best = min(r.times)
            q = res.get(("quire", op))
            ratio = "-" if key.startswith("quire") or q is None else f"{best / min(q.times):.2f}x"
            rows.append(
                [
                    variant,
                    _display(key),
                    "save_async" if key == "quire-async" else op,
                    f"{best:.3f}",
                    f"{nbytes / best / 1e9:.2f}",
                    ratio,
                    str(r.files) if op == "save" and r.files is not None else "",
                    f"{max(r.rss) / MiB:.0f}",
                    f"{min(r.blocked):.3f}" if r.blocked else "",
                    " ".join(f"{t:.2f}" for t in r.times),
                ]
            )
    rows_sorted = [
        rows[0],
        *sorted(rows[1:], key=lambda x: (x[0], x[2].startswith("load"), _order(x[1]))),
    ]
    widths = [max(len(row[i]) for row in rows_sorted) for i in range(len(hdr))]
    lines = []
    for i, row in enumerate(rows_sorted):
        lines.append(
            "  ".join(
                c.ljust(w) if j < 3 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))
            )
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


_DISPLAY = {
    "quire": "quire",
    "quire-v1": "quire v1",
    "quire-async": "quire async",
    "orbax": "orbax",
    "safetensors": "safetensors",
    "raw": "raw numpy",
}


def _display(key: str) -> str:
    return _DISPLAY[key]


def _order(name: str) -> int:
    return list(_DISPLAY.values()).index(name)


def targets(all_res: dict[str, tuple[int, dict[tuple[str, str], Result]]]) -> str:
    out = []
    for variant, (_, res) in all_res.items():
        for op in ("save", "load"):
            q = res.get(("quire", op))
            if q is None:
                continue
            for peer, need in (("orbax", 1.3), ("raw", 0.8)):
                p = res.get((peer, op))
                if p is None:
                    continue
                ratio = min(p.times) / min(q.times)
                ok = "PASS" if ratio >= need else "MISS"
                out.append(
                    f"  {variant:<8} {op:<5} quire/{_display(peer):<10} {ratio:5.2f}x  (target >= {need}x)  {ok}"
                )
    return "\n".join(out)


def write_json(path: str, all_res: dict[str, tuple[int, dict[tuple[str, str], Result]]]) -> None:
    """``{variant: {"bytes": n, "results": {peer: {op: {times, rss, blocked, files}}}}}``."""
    import json

    out: dict[str, Any] = {}
    for variant, (nbytes, res) in all_res.items():
        rows: dict[str, dict[str, Any]] = {}
        for (key, op), r in res.items():
            rows.setdefault(key, {})[op] = {
                "times": r.times,
                "cpu": r.cpu,
                "rss": r.rss,
                "blocked": r.blocked,
                "files": r.files,
            }
        out[variant] = {"bytes": nbytes, "results": rows}
    with open(path, "w") as f:
        json.dump({"quire": _quire_version(), "load_avg": os.getloadavg()[0], "variants": out}, f)


def _quire_version() -> str:
    import subprocess

    import quire

    try:
        here = os.path.dirname(os.path.abspath(quire.__file__))
        rev = subprocess.run(
            ["git", "-C", here, "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return f"{quire.__version__} ({rev or 'no git'})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="repetitions; the minimum is reported (3)")
    ap.add_argument("--quick", action="store_true", help="~170 MiB tree for smoke runs")
    ap.add_argument(
        "--dir", default=None, help="where checkpoints are written (default: a temp dir on /tmp)"
    )
    ap.add_argument("--variants", default="numpy,sharded", help="comma list of numpy,sharded")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma list of {','.join(PEERS)}")
    ap.add_argument(
        "--prewarm", type=float, default=3.0, help="pre-warm this many times the payload"
    )
    ap.add_argument("--no-verify", action="store_true", help="skip checking loaded data on rep 0")
    ap.add_argument(
        "--json", default=None, help="also write every timing to this JSON file (bench_ab.py)"
    )
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")

    if len(jax.devices()) < 8:
        print(
            f"need 8 jax devices, have {len(jax.devices())}; set XLA_FLAGS before jax is imported",
            file=sys.stderr,
        )
        return 2
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="quire-bench-", dir=args.dir)
    peer_keys = [p.strip() for p in args.peers.split(",") if p.strip()]
    peers = {k: PEERS[k]() for k in peer_keys}
    print(
        f"python {sys.version.split()[0]}, jax {jax.__version__}, numpy {np.__version__}, "
        f"{os.cpu_count()} cpus, {psutil.virtual_memory().total / 2**30:.1f} GiB RAM; writing under {workdir}"
    )
    print("loads read from the page cache (no drop_caches); all peers fsync their files")
    print(f"quire {_quire_version()}; load average {os.getloadavg()[0]:.2f} at start")
    all_res = {}
    try:
        for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
            all_res[variant] = run_variant(variant, args, peers, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"\n== results: best of {args.reps} reps; GB/s = 1e9 B of array payload per second; "
        "quire/peer = throughput ratio (>1: quire faster); peak dRSS = max over reps of the peak RSS "
        "growth during the phase; blocked = caller blocked in save()/save_async() of async APIs\n"
    )
    print(fmt_table(all_res, args.reps))
    if args.json:
        write_json(args.json, all_res)
    print(
        "\n== targets (quire save/load >= 1.3x orbax, >= 0.8x raw numpy; differences < ~30% are noise)"
    )
    print(targets(all_res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
