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

``--latency-ms`` (default 20) delays every request by that much in the fault-injecting
proxy of ``tests/object_store_servers.py``, as S3 and GCS requests take tens of
milliseconds (``--latency-ms 0``: the proxy with no delay, to measure latency's share;
``--no-proxy``: straight to the server).

Harness configurations (``--config``, default ``stock,faithful``; every peer runs against
the same server and proxy in each, and each configuration has its own table):

* ``stock``: as the tests run them - the proxy is a thread of the benchmark's own process
  (so its CPU time counts as the client's and it shares the client's GIL), and moto as
  shipped, which keeps every object value over ~5 MiB in a temporary file on this
  machine's disk, reads the whole object for every ranged GET, and copies a multipart
  object four times in ``CompleteMultipartUpload``;
* ``isolated``: the proxy in a process of its own (``ProxyProcess``), and moto keeping
  values in memory through its documented ``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE`` setting;
* ``faithful``: the proxy in its own process, and moto patched at server start
  (``moto_server.faithful_moto``) where its per-byte costs are not S3's: values are ``bytes`` in
  memory, a ranged GET copies the range and not the object, and a multipart upload is
  completed without a pass over its data (parts kept as they are, the object checksum
  combined from part CRC-32s taken as each part arrived).  Still a real HTTP server;
  requests, replies, ETags (MD5 of every part, as S3) and part validation are moto's.

All three put the client, the proxy and the server on the same cores: on a 2-core machine
a run is bound by the CPU seconds of all three, which the table reports per process
(``cpu: client / proxy / server``, in the best repetition).  Full run for the closing note::

    .venv/bin/python benchmarks/bench_s3.py --latency-ms 20 --reps 2 --config stock,isolated,faithful

and for latency's share, the same with ``--latency-ms 0``.  A full-size configuration
needs ~9 GB of memory (the client's tree and copies, and moto's objects); on a shared
machine run one ``--config`` per process.

Methodology: the best (minimum) of ``--reps`` repetitions, peers interleaved in each;
objects are deleted after each repetition; the first repetition checks every loaded array
byte for byte.  ``requests`` = HTTP requests through the proxy in the last repetition (the
number that costs round trips and request-rate budget on a real store).  A peer the server
fails to serve (moto cannot complete a 2 GiB multipart upload under load) is reported as
failed, with the error, instead of ending the run.  ``quire vs peer`` = peer seconds /
quire seconds (>1: quire faster; targets >= 2x quire-v1 and >= 1.0x s3fs-1).
``objects`` = objects each side wrote.  ``--peers`` runs a subset (for profiling).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import contextlib
import gc
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moto_server import cpu_seconds, start_moto  # noqa: E402


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


CONFIGS = {
    # As the tests run them: the proxy is a thread of this process, moto as shipped.
    "stock": {"proxy": "thread", "moto_env": {}},
    # The harness's own costs taken off the client: the proxy in its own process, and moto
    # keeping object values in memory (its documented MOTO_S3_DEFAULT_KEY_BUFFER_SIZE)
    # instead of spooling every value over 5 MiB to a temporary file on this machine's disk.
    "isolated": {
        "proxy": "process",
        "moto_env": {"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(1 << 40)},
    },
    # "isolated", and moto patched where its per-byte costs are not S3's (faithful_moto).
    "faithful": {"proxy": "process", "moto_env": {}, "faithful": True},
}
PEERS = ("quire", "quire-v1", "s3fs", "s3fs-1")


class Harness:
    """One server (moto, or ``--endpoint``) and, unless ``--no-proxy``, the latency proxy."""

    def __init__(self, args: argparse.Namespace, config: dict[str, Any]) -> None:
        self.moto: subprocess.Popen[bytes] | None = None
        self.server = args.endpoint
        if self.server is None:
            self.moto, self.server = start_moto(config["moto_env"], config.get("faithful", False))
        self.proxy: Any = None
        self.proxy_pid: int | None = None
        self.endpoint = self.server
        if not args.no_proxy:
            sys.path.insert(
                0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
            )
            from object_store_servers import FaultProxy, ProxyProcess

            host, port = self.server.rsplit("//", 1)[1].split(":")
            delay = args.latency_ms / 1000
            if config["proxy"] == "process":
                self.proxy = ProxyProcess((host, int(port)), delay)
                self.proxy_pid = self.proxy.pid
            else:
                self.proxy = FaultProxy((host, int(port)))
                if delay > 0:
                    self.proxy.add("delay", times=-1, delay=delay)
            self.endpoint = self.proxy.endpoint

    def take_log(self) -> int | None:
        """Requests through the proxy since the last call."""
        if self.proxy is None:
            return None
        if hasattr(self.proxy, "take_log"):
            return len(self.proxy.take_log())
        with self.proxy._lock:
            n = len(self.proxy.log)
            self.proxy.log.clear()
        return n

    def cpu(self) -> tuple[float, float, float]:
        """CPU seconds so far of (this process, the proxy process, the server)."""
        return (
            cpu_seconds(None),
            cpu_seconds(self.proxy_pid) if self.proxy_pid else float("nan"),
            cpu_seconds(self.moto.pid) if self.moto is not None else float("nan"),
        )

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        if self.moto is not None:
            self.moto.terminate()
            try:
                self.moto.wait(10)
            except subprocess.TimeoutExpired:
                self.moto.kill()
                self.moto.wait(5)


class Results:
    def __init__(self) -> None:
        self.runs: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
        self.objects: dict[str, int] = {}
        self.requests: dict[tuple[str, str], int | None] = {}  # last repetition
        self.failed: dict[str, str] = {}

    def best(self, name: str, op: str) -> tuple[float, float, float, float]:
        """(wall, client CPU, proxy CPU, server CPU) of the fastest repetition."""
        return min(self.runs[name, op])


@contextlib.contextmanager
def timed(h: Harness, res: Results, name: str, op: str) -> Any:
    h.take_log()
    c0 = h.cpu()
    t0 = time.perf_counter()
    yield
    wall = time.perf_counter() - t0
    c1 = h.cpu()
    res.runs.setdefault((name, op), []).append((wall, *(b - a for a, b in zip(c0, c1))))
    res.requests[name, op] = h.take_log()


def run_config(
    args: argparse.Namespace, config: dict[str, Any], tree: dict[str, Any], chosen: list[str]
) -> Results:
    import quire
    from quire._runtime import ioloop as _io
    from quire._store.url import open_backend

    h = Harness(args, config)
    res = Results()
    options = {
        "endpoint_url": h.endpoint,
        "key": os.environ.get("AWS_ACCESS_KEY_ID", KEY),
        "secret": os.environ.get("AWS_SECRET_ACCESS_KEY", SECRET),
        # s3fs's default read timeout is 15 s: moto, on a loaded 2-core machine, answers
        # queued ranged GETs of one large object (it serialises them) slower than that.
        "config_kwargs": {"max_pool_connections": 64, "read_timeout": args.read_timeout},
    }
    try:
        import boto3

        client = boto3.client(
            "s3", endpoint_url=h.server, aws_access_key_id=options["key"],
            aws_secret_access_key=options["secret"], region_name="us-east-1",
        )  # fmt: skip
        if h.moto is not None:
            client.create_bucket(Bucket=args.bucket)
        if args.probe:
            probe_ranges(client, args.bucket)
        peers = {
            n: p
            for n, p in (("s3fs", Peer(options)), ("s3fs-1", OneObjectPeer(options)))
            if n in chosen
        }
        qoptions = dict(options)
        if args.read_part_mib:
            qoptions["read_part_size"] = args.read_part_mib << 20
        for rep in range(args.reps):
            root = f"s3://{args.bucket}/{uuid.uuid4().hex[:8]}"
            for qname, layout in (("quire", "packed"), ("quire-v1", "chunks")):
                if qname not in chosen:
                    continue
                url = f"{root}/{qname}"
                with (
                    quire.Context(**({"pack_bytes": args.pack_mib << 20} if args.pack_mib else {})),
                    timed(h, res, qname, "save"),
                ):
                    quire.save(url, tree, storage_options=qoptions, layout=layout)
                backend = open_backend(url, options)
                res.objects[qname] = len(_io.submit(backend.list()).result())
                gc.collect()
                with timed(h, res, qname, "load"):
                    got = quire.load(url, storage_options=qoptions)
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
                if pname in res.failed:
                    continue
                proot = f"{root[len('s3://') :]}/{pname}"
                try:
                    with timed(h, res, pname, "save"):
                        res.objects[pname] = peer.save(proot, tree)
                    gc.collect()
                    with timed(h, res, pname, "load"):
                        pgot = peer.load(proot, tree)
                except Exception as e:  # a baseline the server cannot serve: say so
                    res.failed[pname] = f"{type(e).__name__}: {str(e)[:100]}"
                    print(f"  {pname} failed: {res.failed[pname]}", flush=True)
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
                    f"{n} save {res.runs[n, 'save'][-1][0]:.2f}s "
                    f"load {res.runs[n, 'load'][-1][0]:.2f}s"
                    for n in PEERS
                    if n in chosen and n not in res.failed
                ),
                flush=True,
            )
    finally:
        h.stop()
    return res


def report(res: Results, names: list[str], payload: int) -> None:
    print(
        f"{'op':<6}{'peer':<10}{'best s':>8}{'GB/s':>7}{'objects':>9}{'requests':>10}"
        f"{'cpu: client':>13}{'proxy':>7}{'server':>8}{'quire vs peer':>15}"
    )
    for op in ("save", "load"):
        first = next((n for n in names if (n, op) in res.runs), None)
        for n in names:
            if n in res.failed or (n, op) not in res.runs or first is None:
                print(f"{op:<6}{n:<10}  failed: {res.failed.get(n, '?')}")
                continue
            t, cc, cp, cs = res.best(n, op)
            q = res.best(first, op)[0]
            print(
                f"{op:<6}{n:<10}{t:>8.2f}{payload / t / 1e9:>7.2f}{res.objects[n]:>9}"
                f"{res.requests.get((n, op)) or '-':>10}{cc:>13.2f}"
                f"{'-' if cp != cp else f'{cp:.2f}':>7}{'-' if cs != cs else f'{cs:.2f}':>8}"
                f"{'-' if n == first else f'{t / q:.2f}x':>15}"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="~256 MiB tree")
    ap.add_argument("--endpoint", help="an S3 endpoint (default: start moto's server)")
    ap.add_argument("--bucket", default="quire-bench")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="added per request")
    ap.add_argument(
        "--no-proxy", action="store_true", help="talk to the server directly (no added latency)"
    )
    ap.add_argument(
        "--config",
        default="stock,faithful",
        help=f"harness configurations to run, comma-separated: {', '.join(CONFIGS)}",
    )
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
    ap.add_argument(
        "--peers",
        default=",".join(PEERS),
        help="comma-separated peers to run (for profiling one at a time)",
    )
    args = ap.parse_args(argv)
    chosen = args.peers.split(",")
    configs = args.config.split(",")
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"--config {c}: one of {', '.join(CONFIGS)}")
    tree = build_tree(args.quick)
    payload = sum(a.nbytes for _, a in arrays(tree))
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} cpus; "
        f"{args.endpoint or 'moto server process'}; "
        + ("no proxy" if args.no_proxy else f"+{args.latency_ms:g} ms per request")
        + f"; tree {payload / MiB:.0f} MiB in {len(arrays(tree))} arrays "
        f"+ {len(tree['scalars'])} scalars",
        flush=True,
    )
    results = {}
    for c in configs:
        print(f"config {c}: {CONFIGS[c]}", flush=True)
        results[c] = run_config(args, CONFIGS[c], tree, chosen)
    names = [n for n in PEERS if n in chosen]
    for c in configs:
        print(
            f"\n== config {c}; best of {args.reps}; GB/s = 1e9 B of array payload per second; "
            "cpu = CPU seconds of the client process (with the proxy in 'stock'), the proxy "
            "process and the server in the best repetition; X vs peer = peer seconds / X "
            "seconds (>1: faster); targets: >= 2x quire-v1, >= 1.0x s3fs-1\n"
        )
        report(results[c], names, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
