"""Peer copies between JAX processes: ``ring_shift`` (a collective) against TCP ``fetch``.

Run from the repository root::

    .venv/bin/python benchmarks/bench_peers.py                        # 64 MiB, 2 and 4 processes, 16 MiB rounds
    .venv/bin/python benchmarks/bench_peers.py --mib 256 --procs 2 4 --reps 3 --round-mib 16

N processes (``jax.distributed.initialize`` on 127.0.0.1, one CPU device each) each hold one
pack file of ``--mib`` MiB in their own tier directory (written, then read back once so it
is in the page cache).  Each repetition moves every process's pack to the next process of
the ring, all processes at once, in two ways:

* **ring_shift**: read the pack into memory, ``ring_shift(payload, shift=1)`` (a jitted
  ``ppermute`` over gloo, in rounds of ``--round-mib`` MiB; the barrier included);
* **tcp fetch**: ``peerlink.fetch`` of the previous process's pack from its ``PeerServer``
  (HMAC-SHA256 over the body on both sides, the server reading the file block by block).

Timing: a distributed barrier, the transfer, another barrier; the primary's wall time
between them, the minimum of ``--reps``, after a first untimed call of each way (jit
compilation, connection set-up).  Right before every timed phase each process allocates
and touches ~3x the payload, then frees it (memory left free is handed back to the host on
this VM and is slow to touch again).  Reported: MB/s per process (one pack received per
process) and the ratio of the two ways.  The first ``ring_shift`` call's time (compilation
included) is reported separately.

Caveat: everything runs on ONE machine: loopback TCP and gloo's TCP transport share its
cores, so on a small VM both are CPU-bound; read the ratio, not the absolute numbers.  On
accelerators ``ring_shift`` runs on the device interconnect instead (not measured here).
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

PREFIX = "BENCH-PEERS "


def worker(pid: int, nproc: int, port: int, opts: dict[str, Any]) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import gc
    from pathlib import Path

    import jax

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    import numpy as np
    from jax._src import distributed

    from quire._runtime import peerlink
    from quire._runtime.collective import ring_shift

    client = distributed.global_state.client
    nbytes = int(opts["mib"]) << 20
    round_bytes = int(opts["round_mib"]) << 20
    tier = Path(opts["dir"]) / f"tier{pid}"
    tier.mkdir(parents=True)
    pack = tier / "pack"
    pack.write_bytes(np.random.default_rng(pid).integers(0, 256, nbytes, np.uint8).tobytes())
    pack.read_bytes()
    n = 0

    def barrier() -> None:
        nonlocal n
        n += 1
        client.wait_at_barrier(f"bench-peers-{n}", 300_000)

    def prewarm() -> None:
        gc.collect()
        w = np.ones(max(1, 3 * nbytes // 8), np.float64)
        del w

    def timed(fn: Any) -> float:
        prewarm()
        barrier()
        t = time.perf_counter()
        out = fn()
        barrier()
        dt = time.perf_counter() - t
        assert len(out) == nbytes, len(out)
        return dt

    secret = peerlink.run_secret("bench/secret", 60)
    server = peerlink.PeerServer(tier, secret)
    peerlink.publish_address("bench/peers", server.address)
    prev = peerlink.lookup_address("bench/peers", (pid - 1) % nproc, 60)
    calls = 0

    def shift() -> bytes:
        nonlocal calls
        calls += 1
        return ring_shift(f"bench/ring/{calls}", pack.read_bytes(), 1, 60, round_bytes=round_bytes)

    def tcp() -> bytes:
        return peerlink.fetch(prev, "pack", secret, 600, nbytes)

    first_ring = timed(shift)
    timed(tcp)
    rows: dict[str, list[float]] = {"ring": [], "tcp": []}
    for _ in range(int(opts["reps"])):
        rows["ring"].append(timed(shift))
        rows["tcp"].append(timed(tcp))
    barrier()
    server.close()
    if pid == 0:
        print(PREFIX + json.dumps({"first_ring": first_ring, **rows}), flush=True)
    jax.distributed.shutdown()


def run(nproc: int, opts: dict[str, Any]) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tempfile.mkdtemp(prefix="bench-peers-", dir=opts.get("base"))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                str(i),
                str(nproc),
                str(port),
                json.dumps({**opts, "dir": work}),
            ],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for i in range(nproc)
    ]
    try:
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")
    line = next(ln for ln in outs[0].splitlines() if ln.startswith(PREFIX))
    return dict(json.loads(line[len(PREFIX) :]))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="pack bytes per process (MiB)")
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--round-mib", type=int, default=16, help="ring_shift bytes per round")
    ap.add_argument("--dir", default=None, help="where the tier directories go (default: /tmp)")
    a = ap.parse_args()
    opts = {"mib": a.mib, "reps": a.reps, "round_mib": a.round_mib, "base": a.dir}
    mb = a.mib * 2**20 / 1e6
    print(f"pack {a.mib} MiB per process, ring_shift rounds of {a.round_mib} MiB, min of {a.reps}")
    print(
        f"{'procs':>5} {'ring_shift MB/s':>16} {'tcp fetch MB/s':>15} {'ring/tcp':>9} "
        f"{'first ring_shift s':>19}"
    )
    for nproc in a.procs:
        r = run(nproc, opts)
        ring, tcp = min(r["ring"]), min(r["tcp"])
        print(
            f"{nproc:>5} {mb / ring:>16.0f} {mb / tcp:>15.0f} {tcp / ring:>9.2f} "
            f"{r['first_ring']:>19.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
