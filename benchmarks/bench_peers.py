"""Peer copies between JAX processes: TLS ``fetch_into`` against the same code path with
the cipher off (plaintext after the handshake, in this benchmark only) and ``ring_shift``,
in one run.

Run from the repository root::

    .venv/bin/python benchmarks/bench_peers.py                         # 64 MiB, 2 processes
    .venv/bin/python benchmarks/bench_peers.py --mib 64 --procs 2 4 --reps 5
    .venv/bin/python benchmarks/bench_peers.py --old-rev b5b9b53       # + the MAC framing

N processes (``jax.distributed.initialize`` on 127.0.0.1, one CPU device each) each hold one
pack file of ``--mib`` MiB in their own tier directory (written, then read back once so it
is in the page cache), and serve it with a ``link.PeerServer``.  The ways a pack moves:

* **tls**: ``link.fetch_into`` (a restore's read: into a buffer allocated once, through a
  ``link.Pool`` connection kept open) over TLS 1.3 (``ssl`` over memory BIOs, AES-GCM
  records, the ephemeral certificates pinned through the key-value store);
* **clear**: the same calls, servers and pools, with the peer link's stream class replaced
  in this benchmark's processes (``plaintext_after_handshake``, installed by
  ``use_stream``): the TLS handshake as ever, then the messages over the bare socket
  (``recv_into`` straight into the caller's buffer, ``sendall`` of the server's file
  buffer).  quire has no option, argument or environment variable for this: the class is
  swapped by assignment in these processes, and nothing in the package carries a message
  in the clear;
* **old** (``--old-rev REV``): the peer link of a commit with the MAC framing (``b5b9b53``,
  the last one), loaded from ``git show <rev>:core/src/quire/_runtime/peer*.py`` into a
  temporary package, its ``fetch_into`` into the same buffer (HMAC-SHA256 over requests and
  answer headers, the body through Poly1305; ``cryptography`` needed), one connection;
* **ring_shift**: read the pack into memory, ``ring_shift(payload, shift=1)`` (a jitted
  ``ppermute`` over gloo, in rounds of ``--round-mib`` MiB; the barrier included).

Two patterns: **one link** (process 1 fetches process 0's pack, the others wait: its client
and its server alone on the machine) and **all links** (every process fetches the previous
process's pack at once, as after a local commit).

Timing: a distributed barrier, the transfer, another barrier; the primary's wall time
between them, the median (and best) of ``--reps`` after one untimed call of each way
(connections, jit compilation).  CPU: ``os.times()`` (user + system, every thread) of every
process between the two barriers, summed over the processes, the median over ``--reps``,
per GiB moved: it counts both ends (the server reading and encrypting, the client
receiving and decrypting).  Right before every timed phase each process allocates and
touches ~3x the payload, then frees it (memory left free is handed back to the host on this
VM and is slow to touch again).

Caveat: everything runs on ONE machine: loopback TCP and gloo share its cores, so on a small
VM all ways are CPU-bound and other users' jobs add noise; compare the ways within one run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PREFIX = "BENCH-PEERS "
ROOT = Path(__file__).resolve().parents[1]
OLD_MODULES = ("peerlink", "peerconn", "peerserve", "peerwire")  # their names at that revision


def load_peer_modules(rev: str, into: str) -> str:
    """Write the peer-link modules of commit ``rev`` as a package under ``into`` (their
    ``quire._runtime.peer*`` imports pointed at it); the package's name."""
    name = f"quire_peers_{re.sub(r'[^0-9A-Za-z]', '_', rev)}"
    pkg = Path(into) / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f'"""quire\'s peer link as of {rev}."""\n')
    for mod in OLD_MODULES:
        src = subprocess.run(
            ["git", "show", f"{rev}:core/src/quire/_runtime/{mod}.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        (pkg / f"{mod}.py").write_text(re.sub(r"quire\._runtime\.(peer\w+)", rf"{name}.\1", src))
    return name


def worker(pid: int, nproc: int, port: int, opts: dict[str, Any]) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import gc

    import jax

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    import numpy as np
    from jax._src import distributed

    from quire._peers import link, wire
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

    def cpu() -> float:
        t = os.times()
        return t.user + t.system

    def timed(fn: Any, active: bool) -> tuple[float, float]:
        prewarm()
        barrier()
        t, c = time.perf_counter(), cpu()
        if active:
            out = fn()
            assert (out if isinstance(out, int) else len(out)) == nbytes, out
        barrier()
        return time.perf_counter() - t, cpu() - c

    prev, one_src = (pid - 1) % nproc, 0
    creds = link.run_credentials("bench/certs", 60)
    server = link.PeerServer(tier, creds)
    link.publish_address("bench/tls", server.address)
    tls_at = {j: link.lookup_address("bench/tls", j, 60) for j in (prev, one_src)}
    into = [memoryview(bytearray(nbytes))]  # one buffer, touched once: no allocation timed
    into[0][:] = pack.read_bytes()
    ways: dict[str, tuple[Any, Any]] = {}  # name: (the stream class, fetch(j))
    pools: dict[tuple[str, int], Any] = {}

    def fetcher(way: str) -> Any:
        def fetch(j: int) -> int:
            pool = pools.get((way, j))
            if pool is None:
                pool = pools[(way, j)] = link.Pool(tls_at[j], creds.peer(j), 1)
            return link.fetch_into(tls_at[j], "pack", creds.peer(j), 600, into, 0, pool=pool)

        return fetch

    tls_stream, clear_stream = wire.TLSStream, plaintext_after_handshake()
    ways["tls"] = (tls_stream, fetcher("tls"))
    ways["clear"] = (clear_stream, fetcher("clear"))
    old_server = None
    if opts.get("old"):
        sys.path.insert(0, opts["old_dir"])
        old = importlib.import_module(f"{opts['old']}.peerlink")
        fast = importlib.import_module(f"{opts['old']}.peerwire").FAST
        assert fast, "the old framing's Poly1305 path needs the cryptography package"
        secret = old.run_secret("bench/old-secret", 60)
        old_server = old.PeerServer(tier, secret)
        old.publish_address("bench/old", old_server.address)
        old_at = {j: old.lookup_address("bench/old", j, 60) for j in (prev, one_src)}
        ways["old"] = (
            tls_stream,
            lambda j: old.fetch_into(old_at[j], "pack", secret, 600, into, 0),
        )
    calls = 0

    def shift() -> bytes:
        nonlocal calls
        calls += 1
        return ring_shift(f"bench/ring/{calls}", pack.read_bytes(), 1, 60, round_bytes=round_bytes)

    rows: dict[str, list[tuple[float, float]]] = {}
    first_ring = timed(shift, True)[0]
    for way, (stream, fn) in ways.items():
        use_stream(stream)  # this process's servers and clients: every connection made now
        for pattern in ("one link", "all links"):
            active = pattern == "all links" or pid == 1
            src = prev if pattern == "all links" else one_src
            timed(lambda fn=fn, src=src: fn(src), active)  # connections, first touch
            rows[f"{way}|{pattern}"] = [
                timed(lambda fn=fn, src=src: fn(src), active) for _ in range(int(opts["reps"]))
            ]
        for pool in pools.values():
            pool.close()
        pools.clear()
    use_stream(tls_stream)
    rows["ring_shift|all links"] = [timed(shift, True) for _ in range(int(opts["reps"]))]
    barrier()
    server.close()
    if old_server is not None:
        old_server.close()
    print(PREFIX + json.dumps({"pid": pid, "first_ring": first_ring, "rows": rows}), flush=True)
    jax.distributed.shutdown()


def plaintext_after_handshake() -> Any:
    """The peer link's stream class with the cipher off after the handshake (this
    benchmark's baseline, for this process only, once :func:`use_stream` installs it): the
    TLS handshake and its checks as ever (the server's context sends no session tickets,
    so nothing of TLS's is left to read after it), then the messages over the bare socket:
    ``recv_into`` straight into the caller's buffer, ``sendall`` of the sender's buffer,
    against the same deadline."""
    from quire._peers import wire

    class ClearAfterHandshake(wire.TLSStream):
        clear = False
        early = b""  # what the socket read had brought past the handshake's last record

        def handshake(self, deadline: float) -> None:
            super().handshake(deadline)
            self.early = self._in.read()  # the other side's first message, sent at once
            self.clear = True

        def recv_into(self, view: memoryview, deadline: float) -> None:
            if not self.clear:
                return super().recv_into(view, deadline)
            view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            got = min(len(view), len(self.early))
            view[:got], self.early = self.early[:got], self.early[got:]
            while got < len(view):
                self._timeout(deadline)
                n = self.sock.recv_into(view[got:])
                if not n:
                    raise wire.Closed(f"connection closed after {got} of {len(view)} bytes")
                got += n
            return None

        def send_all(self, data: Any, deadline: float) -> None:
            if not self.clear:
                return super().send_all(data, deadline)
            view = memoryview(data).cast("B")
            for lo in range(0, len(view), wire.BLOCK):
                self._timeout(deadline)
                self.sock.sendall(view[lo : lo + wire.BLOCK])
            return None

    return ClearAfterHandshake


def use_stream(cls: Any) -> None:
    """Make this process's peer servers and clients build their connections' streams as
    ``cls`` (the modules that construct them look the name up when they do)."""
    from quire._peers import connections, server

    connections.TLSStream = cls  # type: ignore[misc]
    server.TLSStream = cls  # type: ignore[misc]


def run(nproc: int, opts: dict[str, Any]) -> list[dict[str, Any]]:
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
    got = []
    for out in outs:
        line = next(ln for ln in out.splitlines() if ln.startswith(PREFIX))
        got.append(json.loads(line[len(PREFIX) :]))
    return sorted(got, key=lambda r: r["pid"])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="pack bytes per process (MiB)")
    ap.add_argument("--procs", type=int, nargs="+", default=[2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--round-mib", type=int, default=16, help="ring_shift bytes per round")
    ap.add_argument("--dir", default=None, help="where the tier directories go (default: /tmp)")
    ap.add_argument(
        "--old-rev",
        default="none",
        help="also measure the MAC-framed peer link of this commit as 'old' (e.g. b5b9b53)",
    )
    a = ap.parse_args()
    opts: dict[str, Any] = {
        "mib": a.mib,
        "reps": a.reps,
        "round_mib": a.round_mib,
        "base": a.dir,
    }
    old_dir = None
    if a.old_rev != "none":
        old_dir = tempfile.mkdtemp(prefix="bench-peers-old-")
        opts["old"], opts["old_dir"] = load_peer_modules(a.old_rev, old_dir), old_dir
    gib = a.mib / 1024
    print(
        f"pack {a.mib} MiB per process; MiB/s per link: median (best) of {a.reps}; CPU: "
        "median, all processes, per GiB moved"
    )
    print(
        "\n| processes | way | pattern | MiB/s per link | CPU s per GiB | "
        "TLS / clear MiB/s |\n|---|---|---|---|---|---|"
    )
    try:
        for nproc in a.procs:
            got = run(nproc, opts)
            table = {}
            for key in got[0]["rows"]:
                reps = list(zip(*(r["rows"][key] for r in got)))  # per rep: every process
                walls = sorted(rep[0][0] for rep in reps)  # the primary's wall time
                cpus = sorted(sum(p[1] for p in rep) for rep in reps)
                links = 1 if key.endswith("one link") else nproc
                table[key] = (
                    statistics.median(walls),
                    walls[0],
                    statistics.median(cpus) / (links * gib),
                )
            for key, (wall, best, cpu_gib) in table.items():
                way, pattern = key.split("|")
                ratio = ""
                if way == "tls" and f"clear|{pattern}" in table:
                    ratio = f"{table[f'clear|{pattern}'][0] / wall:.2f}"
                print(
                    f"| {nproc} | {way} | {pattern} | {a.mib / wall:.0f} ({a.mib / best:.0f}) "
                    f"| {cpu_gib:.2f} | {ratio} |",
                    flush=True,
                )
            print(
                f"\n{nproc} processes: first ring_shift (compiling) {got[0]['first_ring']:.2f} s\n"
            )
    finally:
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
