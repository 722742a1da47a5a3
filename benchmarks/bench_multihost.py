"""Save / load time and per-process bytes for 1, 2 and 4 JAX processes over one global state.

Run from the repository root::

    .venv/bin/python benchmarks/bench_multihost.py                  # ~1 GiB, 1/2/4 processes, 3 reps
    .venv/bin/python benchmarks/bench_multihost.py --mib 256 --reps 2 --procs 1 2
    .venv/bin/python benchmarks/bench_multihost.py --dir /mnt/scratch --no-fsync

The state: ``--arrays`` (4) float32 arrays of ``--mib / --arrays`` MiB each, every one sharded
over all 8 global devices on a (2, 4) mesh, ``PartitionSpec("x", "y")``, plus a step counter.
N processes (``jax.distributed.initialize`` on 127.0.0.1) hold 8/N CPU devices each, so the
global state is the same for every N.  Per repetition:

* **save**: ``quire.save`` to a fresh directory (each process writes the chunks of its
  shards, the primary the metadata and the commit; fsync included unless ``--no-fsync``);
* **load**: ``quire.load`` onto the saved sharding (each process reads its chunks);
* **resharded load**: ``quire.load`` onto ``PartitionSpec("y", "x")`` on the same mesh (16 x 16
  blocks instead of 2 x 4): every process reads only the stored chunks its new shards
  overlap, here exactly its share.

Timing: a distributed barrier, then the operation, then ``block_until_ready`` and another
barrier; the primary's wall time between the barriers.  Right before every timed phase each
process allocates, touches and frees ~3x its payload (on this VM memory left free for ~2 s
is handed back to the host and touching it again is ~10x slower).  The minimum of ``--reps``
is reported; the checkpoint is deleted after each repetition.  Loads come from the page cache
(no root to drop it).  Bytes are counted by wrapping ``LocalBackend``'s private I/O methods.

Caveat: this runs on ONE machine.  N processes share its cores and its one disk, so this
does not show N hosts' aggregate bandwidth; what it shows is that per-process bytes written
and read shrink as 1/N (no process touches another's shards, no process reads the whole
array) and that the protocol's cost (barriers, the coordination round trips, the commit)
does not make the wall time blow up as N grows.

``--replicas``: replica-parallel writes and shared reads instead.  A mostly replicated state
of ``--mib`` MiB on a (2, 4) mesh (60 % fully replicated arrays with row counts 4 does not
divide, 20 % replicated over one mesh axis, 20 % sharded over all 8 devices) is saved with
replica-0 writes and with replica-parallel writes, and each checkpoint loaded onto the saved
shardings with direct reads and with shared reads, at ``--procs`` processes, on a local
directory and (``--s3``) on a moto S3 server behind one latency proxy per process
(``--latency-ms``, default 20).  Counted at the storage: bytes written per process = the
sizes of its pack objects; requests per process = the requests its proxy saw (S3) or the
calls into ``LocalBackend`` (local); bytes read per process = the bytes those ranged GETs
(S3) or local reads returned::

    .venv/bin/python benchmarks/bench_multihost.py --replicas --mib 128 --procs 2 4 --reps 2 --s3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

PREFIX = "BENCH-MH "


# ============================================================================ the worker
def worker(pid: int, nproc: int, port: int, opts: dict[str, Any]) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // nproc}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import gc
    import threading

    import jax

    if nproc > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import quire
    from quire._store.local import LocalBackend

    lock = threading.Lock()
    counts = {"written": 0, "read": 0}
    put, get, get_into = LocalBackend._put, LocalBackend._get, LocalBackend._get_into

    def _put(self: Any, key: str, data: Any) -> None:
        put(self, key, data)
        with lock:
            counts["written"] += sum(memoryview(b).nbytes for b in data)

    def _get(self: Any, key: str, start: Any, end: Any) -> bytes:
        out: bytes = get(self, key, start, end)
        with lock:
            counts["read"] += len(out)
        return out

    def _get_into(self: Any, key: str, buffers: Any, offset: int) -> int:
        n: int = get_into(self, key, buffers, offset)
        with lock:
            counts["read"] += n
        return n

    LocalBackend._put, LocalBackend._get, LocalBackend._get_into = _put, _get, _get_into  # type: ignore[method-assign]

    def barrier(name: str) -> None:
        if nproc > 1:
            from jax._src import distributed

            client = distributed.global_state.client
            assert client is not None
            client.wait_at_barrier(f"bench-{name}", 600_000)

    def prewarm(nbytes: int) -> None:
        gc.collect()
        w = np.ones(max(1, nbytes // 8), np.float64)
        del w

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    saved, swapped = NamedSharding(mesh, P("x", "y")), NamedSharding(mesh, P("y", "x"))
    n_arrays = int(opts["arrays"])
    per_array = int(opts["mib"]) * 2**20 // n_arrays
    cols = 4096
    rows = per_array // 4 // cols
    rows -= rows % 8
    shape = (rows, cols)

    def fill(i: int) -> Any:
        def cb(idx: Any) -> np.ndarray:
            r, c = idx
            rr = np.arange(r.start or 0, r.stop or rows, dtype=np.float32)[:, None]
            cc = np.arange(c.start or 0, c.stop or cols, dtype=np.float32)[None, :]
            return rr * 0.25 + cc + i

        return jax.make_array_from_callback(shape, saved, cb)

    state = {f"layer{i}": fill(i) for i in range(n_arrays)}
    state["step"] = 1  # type: ignore[assignment]
    payload = n_arrays * rows * cols * 4
    mine = payload // nproc
    opts_s = {} if opts["fsync"] else {"fsync": False}

    def abstract(sharding: Any) -> dict[str, Any]:
        tree: dict[str, Any] = {
            k: jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)
            for k in state
            if k != "step"
        }
        tree["step"] = int
        return tree

    def timed(name: str, fn: Any) -> tuple[float, int, int]:
        prewarm(3 * mine)
        with lock:
            counts["written"] = counts["read"] = 0
        barrier(name + "-start")
        t = time.perf_counter()
        out = fn()
        if out is not None:
            jax.block_until_ready(out)
        barrier(name + "-end")
        dt = time.perf_counter() - t
        del out
        return dt, counts["written"], counts["read"]

    base = opts["dir"]
    for rep in range(int(opts["reps"])):
        url = os.path.join(base, f"n{nproc}-rep{rep}")
        res: dict[str, Any] = {"rep": rep}
        res["save"] = timed(
            f"save{rep}", lambda url=url: quire.save(url, state, storage_options=opts_s)
        )
        res["load"] = timed(f"load{rep}", lambda url=url: quire.load(url, abstract(saved)))
        res["reshard"] = timed(f"resh{rep}", lambda url=url: quire.load(url, abstract(swapped)))
        barrier(f"clean{rep}")
        if pid == 0:
            shutil.rmtree(url)
        print(
            PREFIX + json.dumps({"pid": pid, "payload": payload, "mine": mine, **res}), flush=True
        )
        barrier(f"cleaned{rep}")
    if nproc > 1:
        jax.distributed.shutdown()
    sys.stdout.flush()
    os._exit(0)


# ================================================================= the --replicas worker
def replica_worker(pid: int, nproc: int, port: int, opts: dict[str, Any]) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // nproc}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import threading

    import jax

    if nproc > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import quire
    from quire._store.local import LocalBackend

    lock = threading.Lock()
    counts = {"read": 0, "requests": 0}
    get, get_into, put = LocalBackend._get, LocalBackend._get_into, LocalBackend._put

    def _get(self: Any, key: str, start: Any, end: Any) -> bytes:
        out: bytes = get(self, key, start, end)
        with lock:
            counts["read"] += len(out)
            counts["requests"] += 1
        return out

    def _get_into(self: Any, key: str, buffers: Any, offset: int) -> int:
        n: int = get_into(self, key, buffers, offset)
        with lock:
            counts["read"] += n
            counts["requests"] += 1
        return n

    def _put(self: Any, key: str, data: Any) -> None:
        put(self, key, data)
        with lock:
            counts["requests"] += 1

    LocalBackend._get, LocalBackend._get_into, LocalBackend._put = _get, _get_into, _put  # type: ignore[method-assign]
    proxy = None
    if opts["s3"]:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from object_store_servers import ProxyProcess

        host, sport = opts["server"].rsplit("//", 1)[1].split(":")
        proxy = ProxyProcess((host, int(sport)), opts["latency_ms"] / 1000)
        so = {"endpoint_url": proxy.endpoint, "key": "testing", "secret": "testing"}
        quire.configure(storage_options={"s3": so})

    def take() -> tuple[int, int]:
        """(requests, bytes read) since the last call, counted at the storage."""
        if proxy is None:
            with lock:
                out = counts["requests"], counts["read"]
                counts["requests"] = counts["read"] = 0
            return out
        log = proxy.take_log()
        nbytes = 0
        for method, _, _, rng in log:
            if method == "GET" and rng and rng.startswith("bytes="):
                a, _, b = rng[6:].partition("-")
                nbytes += int(b) - int(a) + 1 if b else 0
        return len(log), nbytes

    def barrier(name: str) -> None:
        if nproc > 1:
            from jax._src import distributed

            client = distributed.global_state.client
            assert client is not None
            client.wait_at_barrier(f"bench-{name}", 600_000)

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    total = int(opts["mib"]) * 2**20
    cols = 1024
    plan = [  # (share of the state, PartitionSpec, arrays)
        (0.6, P(), 6),
        (0.2, P("x"), 2),
        (0.2, P("x", "y"), 2),
    ]
    state: dict[str, Any] = {}
    abstract: dict[str, Any] = {}
    for share, spec, n in plan:
        rows = int(total * share / n / 4 / cols)
        rows = rows - rows % 8 + (1 if spec == P() else 0)  # replicated ones: 4 does not divide
        for i in range(n):
            name = f"{'-'.join(map(str, spec)) or 'rep'}{i}"
            sh = NamedSharding(mesh, spec)
            shape = (rows, cols)

            def cb(idx: Any, i: int = i, rows: int = rows) -> np.ndarray:
                r, c = idx
                rr = np.arange(r.start or 0, r.stop or rows, dtype=np.float32)[:, None]
                cc = np.arange(c.start or 0, c.stop or cols, dtype=np.float32)[None, :]
                return rr * 0.25 + cc + i

            state[name] = jax.make_array_from_callback(shape, sh, cb)
            abstract[name] = jax.ShapeDtypeStruct(shape, np.float32, sharding=sh)
    payload = sum(x.nbytes for x in state.values())

    def pack_bytes(url: str) -> int:
        import fsspec

        txid = quire.metadata(url).record["txids"][0]
        if url.startswith("s3://"):
            fs = fsspec.filesystem(
                "s3", endpoint_url=opts["server"], key="testing", secret="testing"
            )
            found = fs.ls(f"{url[5:]}/d/{txid}/%packs", detail=True, refresh=True)
            return sum(int(f["size"]) for f in found if f"/p{pid:05d}-" in f["name"])
        d = os.path.join(url, "d", txid, "%packs")
        return sum(
            os.path.getsize(os.path.join(d, f))
            for f in os.listdir(d)
            if f.startswith(f"p{pid:05d}-")
        )

    def timed(name: str, fn: Any) -> tuple[float, int, int]:
        barrier(name + "-start")
        take()
        t = time.perf_counter()
        out = fn()
        if out is not None:
            jax.block_until_ready(out)
        barrier(name + "-end")
        dt = time.perf_counter() - t
        reqs, nread = take()
        return dt, reqs, nread

    base = opts["dir"]
    for rep in range(int(opts["reps"])):
        res: dict[str, Any] = {"rep": rep}
        for writes in (False, True):
            url = f"{base}/n{nproc}-rep{rep}-w{int(writes)}"
            with quire.Context(replica_writes=writes):
                dt, reqs, _ = timed(f"save{rep}{writes}", lambda url=url: quire.save(url, state))
            barrier(f"saved{rep}{writes}")
            res[f"save-{writes}"] = (dt, reqs, pack_bytes(url))
            for reads in (False, True):
                with quire.Context(replica_reads=reads):
                    res[f"load-{writes}-{reads}"] = timed(
                        f"load{rep}{writes}{reads}", lambda url=url: quire.load(url, abstract)
                    )
            barrier(f"clean{rep}{writes}")
            if pid == 0 and not url.startswith("s3://"):
                shutil.rmtree(url)
        print(PREFIX + json.dumps({"pid": pid, "payload": payload, **res}), flush=True)
        barrier(f"cleaned{rep}")
    if proxy is not None:
        proxy.stop()
    if nproc > 1:
        jax.distributed.shutdown()
    sys.stdout.flush()
    os._exit(0)


def replica_table(a: Any, opts: dict[str, Any], where: str) -> None:
    MiB = 2**20
    print(
        f"\n{where}: {a.mib} MiB state (60 % replicated, 20 % over one mesh axis, 20 % "
        f"sharded); min of {a.reps} reps; bytes and requests: the largest process / the sum\n"
    )
    print(
        "| processes | writes | save s | written MiB max / sum | save requests max | "
        "reads | load s | read MiB max / sum | load requests max / sum |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n in a.procs:
        res = run(n, {**opts, "mode": "replicas"})
        prim = [r for r in res if r["pid"] == 0]
        last = [r for r in res if r["rep"] == a.reps - 1]
        for writes in (False, True):
            s = f"save-{writes}"
            save_s = min(r[s][0] for r in prim)
            wr = [r[s][2] / MiB for r in last]
            sreq = max(r[s][1] for r in last)
            for reads in (False, True):
                k = f"load-{writes}-{reads}"
                load_s = min(r[k][0] for r in prim)
                rd = [r[k][2] / MiB for r in last]
                rq = [r[k][1] for r in last]
                print(
                    f"| {n} | {'parallel' if writes else 'replica 0'} | {save_s:.2f} | "
                    f"{max(wr):.1f} / {sum(wr):.1f} | {sreq} | {'shared' if reads else 'direct'} "
                    f"| {load_s:.2f} | {max(rd):.1f} / {sum(rd):.1f} | {max(rq)} / {sum(rq)} |",
                    flush=True,
                )


# ============================================================================ the launcher
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(nproc: int, opts: dict[str, Any]) -> list[dict[str, Any]]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(i), str(nproc), str(port), json.dumps(opts)],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for i in range(nproc)
    ]
    out = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=1800)
            out += [
                json.loads(x[len(PREFIX) :]) for x in stdout.splitlines() if x.startswith(PREFIX)
            ]
            if p.returncode:
                raise SystemExit(f"a worker of the {nproc}-process run failed ({p.returncode})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        o = json.loads(sys.argv[5])
        fn = replica_worker if o.get("mode") == "replicas" else worker
        fn(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), o)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="global array payload (MiB)")
    ap.add_argument("--arrays", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--no-fsync", action="store_true", help="skip fsync (storage_options)")
    ap.add_argument("--replicas", action="store_true", help="replica-parallel writes, shared reads")
    ap.add_argument("--s3", action="store_true", help="--replicas: also on moto S3")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    a = ap.parse_args()
    if a.replicas:
        replicas_main(a)
        return
    base = tempfile.mkdtemp(prefix="quire-bench-mh-", dir=a.dir)
    opts = {"mib": a.mib, "arrays": a.arrays, "reps": a.reps, "dir": base, "fsync": not a.no_fsync}
    MiB = 2**20
    rows = []
    try:
        for n in a.procs:
            res = run(n, opts)
            prim = [r for r in res if r["pid"] == 0]
            best = {k: min(r[k][0] for r in prim) for k in ("save", "load", "reshard")}
            per = {
                k: max(r[k][i] for r in res) / MiB
                for k, i in (("save", 1), ("load", 2), ("reshard", 2))
            }
            payload = prim[0]["payload"]
            rows.append((n, best, per, payload))
            print(f"  {n} process(es) done: {best}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    payload = rows[0][3]
    print(
        f"\nglobal state: {payload / MiB:.0f} MiB in {a.arrays} float32 arrays on a (2, 4) mesh "
        f"of 8 CPU devices; min of {a.reps} reps; fsync {'off' if a.no_fsync else 'on'}; "
        f"{os.cpu_count()} cores, one disk\n"
    )
    print(
        "| processes x devices | save s | load s | resharded load s | "
        "written / process MiB | read / process MiB | read / process, resharded MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for n, best, per, _ in rows:
        print(
            f"| {n} x {8 // n} | {best['save']:.2f} | {best['load']:.2f} | {best['reshard']:.2f} "
            f"| {per['save']:.0f} | {per['load']:.0f} | {per['reshard']:.0f} |"
        )


def replicas_main(a: Any) -> None:
    base = tempfile.mkdtemp(prefix="quire-bench-rep-", dir=a.dir)
    opts: dict[str, Any] = {"mib": a.mib, "reps": a.reps, "dir": base, "s3": False}
    try:
        replica_table(a, opts, "local directory")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if not a.s3:
        return
    import boto3

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from moto_server import start_moto

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    moto, server = start_moto()
    try:
        creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
        boto3.client("s3", endpoint_url=server, region_name="us-east-1", **creds).create_bucket(
            Bucket="quire-bench"
        )
        opts = {
            **opts,
            "s3": True,
            "server": server,
            "latency_ms": a.latency_ms,
            "dir": "s3://quire-bench/rep",
        }
        replica_table(a, opts, f"moto S3, {a.latency_ms:g} ms added per request")
    finally:
        moto.terminate()
        moto.wait(10)


if __name__ == "__main__":
    main()
