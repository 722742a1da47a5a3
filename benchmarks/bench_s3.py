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
* ``quire-v1``: the same with ``layout="chunks"`` (format v1, one object per chunk);
* ``s3fs``: one object per array with its raw bytes - ``fs.pipe({path: bytes})`` and
  ``fs.cat([paths])`` (s3fs's own batching and multipart / ranged-read splitting) - no
  metadata, no checksums, no commit: a lower bound on what any format costs;
* ``s3fs-1``: one object per process holding every array back to back (``fs.pipe`` of one
  object, multipart; ``fs.cat`` of it), the object count format v2 aims at.

``--latency-ms`` (default 20) puts the fault-injecting proxy of ``tests/object_store_servers.py``
in front of the server, delaying every request by that much (0: no proxy), as S3 and GCS
requests take tens of milliseconds.  Full run for the closing note::

    .venv/bin/python benchmarks/bench_s3.py --latency-ms 20 --reps 2 --probe

Methodology: the best (minimum) of ``--reps`` repetitions, peers interleaved in each;
objects are deleted after each repetition; the first repetition checks every loaded array
byte for byte.  ``requests`` = HTTP requests through the proxy in the last repetition (the
number that costs round trips and request-rate budget on a real store).  A peer the server
fails to serve (moto cannot complete a 2 GiB multipart upload under load) is reported as
failed, with the error, instead of ending the run.  ``ratio`` = s3fs seconds / quire seconds (>= 0.8 is the target: quire at
least 80% of plain s3fs's throughput).  ``objects`` = objects each side wrote.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import contextlib
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


class OneObjectPeer(Peer):
    """Every array of the process in one object (the lower bound of format v2's count)."""

    def save(self, root: str, tree: dict[str, Any]) -> int:
        blob = b"".join(memoryview(a.reshape(-1).view(np.uint8)) for _, a in arrays(tree))
        self.fs.pipe({f"{root}/all": blob})
        return 1

    def load(self, root: str, tree: dict[str, Any]) -> dict[str, np.ndarray]:
        blob = memoryview(self.fs.cat_file(f"{root}/all"))
        out, pos = {}, 0
        for name, a in arrays(tree):
            out[name] = np.frombuffer(blob[pos : pos + a.nbytes], a.dtype).reshape(a.shape)
            pos += a.nbytes
        return out


def probe_ranges(client: Any, bucket: str) -> None:
    """What one ranged GET costs the server as its object grows (moto reads the whole
    object for every range; S3 serves a range at the cost of the range)."""
    blob = os.urandom(MiB)
    sizes = (1, 16, 64, 256)
    for n in sizes:
        client.put_object(Bucket=bucket, Key=f"probe/{n}", Body=blob * n)
    cost = []
    for n in sizes:
        t0 = time.perf_counter()
        for _ in range(5):
            r = client.get_object(Bucket=bucket, Key=f"probe/{n}", Range=f"bytes=0-{MiB - 1}")
            r["Body"].read()
        cost.append(f"{n} MiB: {(time.perf_counter() - t0) / 5 * 1e3:.0f} ms")
        client.delete_object(Bucket=bucket, Key=f"probe/{n}")
    print("server: one 1 MiB ranged GET from an object of " + ", ".join(cost), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="~256 MiB tree")
    ap.add_argument("--endpoint", help="an S3 endpoint (default: start moto's server)")
    ap.add_argument("--bucket", default="quire-bench")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="added per request (0: none)")
    ap.add_argument("--pack-mib", type=int, default=None, help="quire's pack_bytes, in MiB")
    ap.add_argument(
        "--read-timeout", type=float, default=120.0, help="client read timeout, s (all peers)"
    )
    ap.add_argument(
        "--read-part-mib",
        type=int,
        default=None,
        help="quire's read_part_size storage option (both layouts), in MiB (default 64)",
    )
    ap.add_argument(
        "--probe",
        action="store_true",
        help="first time a 1 MiB ranged GET from objects of 1-256 MiB (straight to the server)",
    )
    args = ap.parse_args(argv)

    import quire
    from quire import _io
    from quire._url import open_backend

    moto = None
    endpoint = args.endpoint
    if endpoint is None:
        moto, endpoint = start_moto()
    proxy = None
    server = endpoint
    if args.latency_ms > 0:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from object_store_servers import FaultProxy

        host, port = endpoint.rsplit("//", 1)[1].split(":")
        proxy = FaultProxy((host, int(port)))
        proxy.add("delay", times=-1, delay=args.latency_ms / 1000)
        endpoint = proxy.endpoint
    options = {
        "endpoint_url": endpoint,
        "key": os.environ.get("AWS_ACCESS_KEY_ID", KEY),
        "secret": os.environ.get("AWS_SECRET_ACCESS_KEY", SECRET),
        # s3fs's default read timeout is 15 s: moto, on a loaded 2-core machine, answers
        # queued ranged GETs of one large object (it serialises them) slower than that.
        "config_kwargs": {"max_pool_connections": 64, "read_timeout": args.read_timeout},
    }
    try:
        import boto3

        client = boto3.client(
            "s3", endpoint_url=server, aws_access_key_id=options["key"],
            aws_secret_access_key=options["secret"], region_name="us-east-1",
        )  # fmt: skip
        if moto is not None:
            client.create_bucket(Bucket=args.bucket)
        if args.probe:
            probe_ranges(client, args.bucket)
        tree = build_tree(args.quick)
        payload = sum(a.nbytes for _, a in arrays(tree))
        print(
            f"python {sys.version.split()[0]}, {os.cpu_count()} cpus; endpoint {endpoint} "
            f"({'moto server process' if moto else 'external'}; +{args.latency_ms:g} ms per "
            f"request); tree {payload / MiB:.0f} MiB "
            f"in {len(arrays(tree))} arrays + {len(tree['scalars'])} scalars",
            flush=True,
        )
        peers = {"s3fs": Peer(options), "s3fs-1": OneObjectPeer(options)}
        qoptions = dict(options)
        if args.read_part_mib:
            qoptions["read_part_size"] = args.read_part_mib << 20
        times: dict[tuple[str, str], list[float]] = {}
        objects: dict[str, int] = {}
        requests: dict[tuple[str, str], int] = {}  # through the proxy, last repetition
        failed: dict[str, str] = {}

        def counted(name: str, op: str) -> None:
            if proxy is not None:
                requests[name, op] = len(proxy.log)
                proxy.log.clear()

        for rep in range(args.reps):
            root = f"s3://{args.bucket}/{uuid.uuid4().hex[:8]}"
            for qname, layout in (("quire", "packed"), ("quire-v1", "chunks")):
                url = f"{root}/{qname}"
                if proxy is not None:
                    proxy.log.clear()
                t0 = time.perf_counter()
                with quire.Context(
                    **({"pack_bytes": args.pack_mib << 20} if args.pack_mib else {})
                ):
                    quire.save(url, tree, storage_options=qoptions, layout=layout)
                times.setdefault((qname, "save"), []).append(time.perf_counter() - t0)
                counted(qname, "save")
                backend = open_backend(url, options)
                objects[qname] = len(_io.submit(backend.list()).result())
                gc.collect()
                t0 = time.perf_counter()
                got = quire.load(url, storage_options=qoptions)
                times.setdefault((qname, "load"), []).append(time.perf_counter() - t0)
                counted(qname, "load")
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
            for pname, peer in peers.items():
                if pname in failed:
                    continue
                proot = f"{root[len('s3://') :]}/{pname}"
                try:
                    if proxy is not None:
                        proxy.log.clear()
                    t0 = time.perf_counter()
                    objects[pname] = peer.save(proot, tree)
                    times.setdefault((pname, "save"), []).append(time.perf_counter() - t0)
                    counted(pname, "save")
                    gc.collect()
                    t0 = time.perf_counter()
                    pgot = peer.load(proot, tree)
                    times.setdefault((pname, "load"), []).append(time.perf_counter() - t0)
                    counted(pname, "load")
                except Exception as e:  # a baseline the server cannot serve: say so
                    failed[pname] = f"{type(e).__name__}: {str(e)[:100]}"
                    print(f"  {pname} failed: {failed[pname]}", flush=True)
                    continue
                finally:
                    with contextlib.suppress(Exception):
                        peer.delete(proot)
                if rep == 0 and not args.no_verify:
                    for name, a in arrays(tree):
                        assert np.array_equal(a.view(np.uint8), pgot[name].view(np.uint8)), name
                del pgot
                gc.collect()
            print(
                f"  rep {rep}: "
                + " | ".join(
                    f"{n} save {times[n, 'save'][-1]:.2f}s load {times[n, 'load'][-1]:.2f}s"
                    for n in ("quire", "quire-v1", *peers)
                    if n not in failed
                ),
                flush=True,
            )
        print(f"\n== best of {args.reps}; GB/s = 1e9 B of array payload per second; "
              "vs X = X seconds / quire seconds (>1: quire faster); targets: >= 2x quire-v1, "
              ">= 1.0x s3fs-1\n")  # fmt: skip
        names = ["quire", "quire-v1", *peers]
        print(
            f"{'op':<6}{'peer':<10}{'best s':>8}{'GB/s':>7}{'objects':>9}{'requests':>10}"
            f"{'quire vs peer':>15}"
        )
        for op in ("save", "load"):
            q = min(times["quire", op])
            for n in names:
                if n in failed:
                    print(f"{op:<6}{n:<10}  failed: {failed[n]}")
                    continue
                t = min(times[n, op])
                print(
                    f"{op:<6}{n:<10}{t:>8.2f}{payload / t / 1e9:>7.2f}{objects[n]:>9}"
                    f"{requests.get((n, op), '-'):>10}"
                    f"{'-' if n == 'quire' else f'{t / q:.2f}x':>15}"
                )
    finally:
        if proxy is not None:
            proxy.stop()
        if moto is not None:
            moto.terminate()
            moto.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
