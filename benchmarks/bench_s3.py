"""S3 save/load benchmark: quire vs a plain s3fs parallel put/get of the same bytes.

Run from the repository root::

    .venv/bin/python benchmarks/bench_s3.py              # ~2 GiB tree, 2 reps
    .venv/bin/python benchmarks/bench_s3.py --quick      # ~256 MiB, for smoke runs
    .venv/bin/python benchmarks/bench_s3.py --endpoint http://minio:9000 --bucket b

The tree ("standard", ~2 GiB): 4 arrays of 256 MiB, 32 of 32 MiB, 400 small arrays of
4-64 KiB (float32 and bfloat16) and a few Python scalars, all numpy.

The server: moto's S3 server started as its own process on 127.0.0.1 (so that it does not
share this process's GIL), unless ``--endpoint`` names another S3 endpoint.  Both sides use
the same client settings (s3fs / aiobotocore, a pool of 64 connections):

* ``quire``: ``quire.save(url, tree)`` then ``quire.load(url)`` (zarr v3 arrays, crc32c per
  chunk, multipart uploads of 16 MiB parts above 64 MiB, conditional-create commit);
* ``s3fs``: one object per array with its raw bytes - ``fs.pipe({path: bytes})`` and
  ``fs.cat([paths])`` (s3fs's own batching and multipart / ranged-read splitting) - no
  metadata, no checksums, no commit: a lower bound on what any format costs.

Methodology: the best (minimum) of ``--reps`` repetitions, peers interleaved in each;
objects are deleted after each repetition; the first repetition checks every loaded array
byte for byte.  ``ratio`` = s3fs seconds / quire seconds (>= 0.8 is the target: quire at
least 80% of plain s3fs's throughput).  ``objects`` = objects each side wrote.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import gc
import socket
import subprocess
import sys
import time
import uuid
from typing import Any

import ml_dtypes
import numpy as np

MiB = 1 << 20
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
KEY, SECRET = "bench-key", "bench-secret"


def build_tree(quick: bool, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    scale = 8 if quick else 1

    def arr(nbytes: int, dtype: np.dtype[Any], cols: int = 4096) -> np.ndarray:
        n = nbytes // dtype.itemsize
        f = rng.random(n, dtype=np.float32)
        if dtype == BF16:
            f = (f.view(np.uint32) >> 16).astype(np.uint16).view(BF16)
        return f.reshape(-1, cols) if n % cols == 0 else f

    tree: dict[str, Any] = {"big": {}, "mid": {}, "small": {}}
    for i in range(4):
        tree["big"][f"w{i}"] = arr(256 * MiB // scale, (F32, BF16)[i % 2])
    for i in range(32):
        tree["mid"][f"layer{i:02d}"] = arr(32 * MiB // scale, (F32, BF16)[i % 2])
    for i in range(400 // scale):
        tree["small"][f"p{i:03d}"] = arr(int(rng.integers(4, 65)) * 1024, (F32, BF16)[i % 2], 64)
    tree["scalars"] = {"step": 12345, "lr": 3e-4, "epoch": 7}
    return tree


def arrays(tree: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    return [
        (f"{g}/{k}", v)
        for g, sub in tree.items()
        for k, v in sub.items()
        if isinstance(v, np.ndarray)
    ]


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, endpoint
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("moto server did not start")


class Peer:
    """A plain s3fs client on its own event loop thread (s3fs's sync API)."""

    def __init__(self, options: dict[str, Any]) -> None:
        import s3fs

        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)

    def save(self, root: str, tree: dict[str, Any]) -> int:
        data = {
            f"{root}/{name}": memoryview(a.reshape(-1).view(np.uint8)).tobytes()
            for name, a in arrays(tree)
        }
        self.fs.pipe(data)
        return len(data)

    def load(self, root: str, tree: dict[str, Any]) -> dict[str, np.ndarray]:
        names = [name for name, _ in arrays(tree)]
        got = self.fs.cat([f"{root}/{n}" for n in names])
        out = {}
        for name, a in arrays(tree):
            out[name] = np.frombuffer(got[f"{root}/{name}"], a.dtype).reshape(a.shape)
        return out

    def delete(self, root: str) -> None:
        self.fs.rm(root, recursive=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="~256 MiB tree")
    ap.add_argument("--endpoint", help="an S3 endpoint (default: start moto's server)")
    ap.add_argument("--bucket", default="quire-bench")
    ap.add_argument("--no-verify", action="store_true")
    args = ap.parse_args(argv)

    import quire
    from quire import _io
    from quire._url import open_backend

    moto = None
    endpoint = args.endpoint
    if endpoint is None:
        moto, endpoint = start_moto()
    options = {
        "endpoint_url": endpoint,
        "key": os.environ.get("AWS_ACCESS_KEY_ID", KEY),
        "secret": os.environ.get("AWS_SECRET_ACCESS_KEY", SECRET),
        "config_kwargs": {"max_pool_connections": 64},
    }
    try:
        import boto3

        client = boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id=options["key"],
            aws_secret_access_key=options["secret"], region_name="us-east-1",
        )  # fmt: skip
        if moto is not None:
            client.create_bucket(Bucket=args.bucket)
        tree = build_tree(args.quick)
        payload = sum(a.nbytes for _, a in arrays(tree))
        print(
            f"python {sys.version.split()[0]}, {os.cpu_count()} cpus; endpoint {endpoint} "
            f"({'moto server process' if moto else 'external'}); tree {payload / MiB:.0f} MiB "
            f"in {len(arrays(tree))} arrays + {len(tree['scalars'])} scalars",
            flush=True,
        )
        peer = Peer(options)
        times: dict[tuple[str, str], list[float]] = {}
        objects: dict[str, int] = {}
        for rep in range(args.reps):
            root = f"s3://{args.bucket}/{uuid.uuid4().hex[:8]}"
            # quire
            url = f"{root}/quire"
            t0 = time.perf_counter()
            quire.save(url, tree, storage_options=options)
            times.setdefault(("quire", "save"), []).append(time.perf_counter() - t0)
            backend = open_backend(url, options)
            objects["quire"] = len(_io.submit(backend.list()).result())
            gc.collect()
            t0 = time.perf_counter()
            got = quire.load(url, storage_options=options)
            times.setdefault(("quire", "load"), []).append(time.perf_counter() - t0)
            if rep == 0 and not args.no_verify:
                for name, a in arrays(tree):
                    g, k = name.split("/")
                    b = got[g][k]
                    assert (
                        b.dtype == a.dtype
                        and b.shape == a.shape
                        and np.array_equal(a.view(np.uint8), b.view(np.uint8))
                    ), name
            del got
            _io.submit(backend.delete_prefix("")).result()
            gc.collect()
            # plain s3fs
            proot = f"{root[len('s3://') :]}/s3fs"
            t0 = time.perf_counter()
            objects["s3fs"] = peer.save(proot, tree)
            times.setdefault(("s3fs", "save"), []).append(time.perf_counter() - t0)
            gc.collect()
            t0 = time.perf_counter()
            pgot = peer.load(proot, tree)
            times.setdefault(("s3fs", "load"), []).append(time.perf_counter() - t0)
            if rep == 0 and not args.no_verify:
                for name, a in arrays(tree):
                    assert np.array_equal(a.view(np.uint8), pgot[name].view(np.uint8)), name
            del pgot
            peer.delete(proot)
            gc.collect()
            print(
                f"  rep {rep}: quire save {times['quire', 'save'][-1]:.2f}s load "
                f"{times['quire', 'load'][-1]:.2f}s | s3fs save {times['s3fs', 'save'][-1]:.2f}s "
                f"load {times['s3fs', 'load'][-1]:.2f}s",
                flush=True,
            )
        print(f"\n== best of {args.reps}; GB/s = 1e9 B of array payload per second; "
              "ratio = s3fs s / quire s (target >= 0.8)\n")  # fmt: skip
        print(f"{'op':<6}{'quire s':>9}{'quire GB/s':>12}{'s3fs s':>9}{'s3fs GB/s':>11}"
              f"{'ratio':>8}  result")  # fmt: skip
        for op in ("save", "load"):
            q, p = min(times["quire", op]), min(times["s3fs", op])
            ratio = p / q
            print(
                f"{op:<6}{q:>9.2f}{payload / q / 1e9:>12.2f}{p:>9.2f}{payload / p / 1e9:>11.2f}"
                f"{ratio:>8.2f}  {'PASS' if ratio >= 0.8 else 'MISS'}"
            )
        print(f"\nobjects written: quire {objects['quire']} (zarr.json + chunk per array, "
              f"quire.json), s3fs {objects['s3fs']} (one per array)")  # fmt: skip
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
