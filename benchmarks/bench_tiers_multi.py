"""Local tier with 2 and 4 JAX processes: saves, and restores from local / peers / persistent.

Run from the repository root::

    .venv/bin/python benchmarks/bench_tiers_multi.py                 # 64 MiB state, 2 reps
    .venv/bin/python benchmarks/bench_tiers_multi.py --mib 16 --reps 1 --procs 2   # smoke run
    .venv/bin/python benchmarks/bench_tiers_multi.py --restores-only --clear --reps 5

Each row is one launch of N real JAX processes (``jax.distributed`` on 127.0.0.1, 2 CPU
devices each; a jax import and the distributed start-up are not timed).  The persistent tier
is moto's S3 server behind the latency proxy of ``tests/object_store_servers.py``
(``--latency-ms``, default 20); the local tier is a directory under a temporary directory.
The state: one float32 array of ``--mib`` MiB sharded over all 2N devices, a replicated
float32 array of 1/16 of that (written by pieces over every process), a scalar.

Rows (seconds of the slowest process, best of ``--reps``):

* ``save: plain persistent``: ``Checkpointer(s3).save`` (a ``save_async``) of a second step:
  blocked = until ``save`` returns, wall = until ``wait()`` returns;
* ``save: tiered, local + promotion``: ``Checkpointer(s3, local=LocalTier(dir, peers=1))`` at a
  step both policies save: wall includes the peer copies and the promotion to S3;
* ``save: tiered, local only``: at a step only the local policy saves (wall: local commit and
  peer copies);
* ``restore: local``: a restart; ``load`` of a local-only step nothing was lost of;
* ``restore: lost dir (peers)``: process 1's local directory wiped first; ``load`` of the
  promoted step (every owner still has a live holder: nothing read from S3);
* ``restore: lost dir (peers, clear after handshake)`` (``--clear``): the same, with the
  peer link's cipher off after the handshake in this benchmark's processes (the baseline of
  ``bench_peers.py``: the same code path without AES-GCM; quire has no such option);
* ``restore: persistent``: the promoted step by a plain Checkpointer on the S3 root;
* ``save: plain persistent, local dir`` / ``restore: persistent, local dir``: the same with the
  persistent tier a local directory (to set beside Orbax's rows, whose persistent tier is one);
* ``Orbax emergency|P2P, R replicas, ...`` (unless ``--no-orbax``): Orbax's emergency and P2P
  ``CheckpointManager`` on the same state values, processes and run (``bench_tiers_orbax.py``,
  persistent tier a local directory): save at a step both its
  tiers save and at a local-only step; restore with nothing lost, after one process's local
  directory is wiped, and with every local directory wiped (the row names the tier the restore
  read); with one replica per process and, above 2 processes, with 2 replicas.

``--restores-only`` runs the tiered saves and the local and lost-dir restores alone.  The
last lines give the lost-dir / local ratio of each rep (its two restores run one after the
other) and their median.  ``requests`` = HTTP requests through the proxy during the launch
(by method; the Checkpointer's own listing included); ``MiB (requests) read from peers`` = what the
restore's processes read from each other over TCP, all processes together.  Every restore
is checked byte for byte (Orbax's: bit for bit except for -0.0 restored as +0.0, counted
in the row).  ``--profile DIR`` writes, per restore and process, a cProfile of
the calling thread and a sample of every thread's stack (slower: do not time with it).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import collections
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
KEY, SECRET, BUCKET = "bench-key", "bench-secret", "quire-bench"


# ----------------------------------------------------------------------------- worker
class Sampler:
    """Every thread's stack every millisecond (cProfile sees only the calling thread; the
    restore's reads run on quire's event loop and I/O threads): per thread, how many
    samples each function was on the stack, and each innermost function."""

    def __init__(self) -> None:
        import threading

        self.counts: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import threading

        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        while not self._stop.wait(0.001):
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                if ident not in names:
                    names = {t.ident: t.name for t in threading.enumerate()}
                name = names.get(ident, str(ident)).split("_")[0]
                seen, f, top = set(), frame, True
                while f is not None:
                    code = f.f_code
                    key = f"{os.path.basename(code.co_filename)}:{code.co_name}"
                    if top:
                        self.counts[name]["SELF " + key] += 1
                        top = False
                    if key not in seen:
                        seen.add(key)
                        self.counts[name][key] += 1
                    f = f.f_back

    def dump(self, path: str) -> None:
        with open(path, "w") as out:
            out.write(f"{self.samples} samples, 1 ms apart\n")
            for name, c in sorted(self.counts.items()):
                out.write(f"== {name}\n")
                for k, v in c.most_common(40):
                    out.write(f"{v:6d} {k}\n")


def worker(pid: int, n: int, port: int, cfg: dict[str, Any]) -> None:
    import jax

    if cfg["phase"].startswith("orbax"):  # its restore broadcasts with a collective
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid)
    if cfg["phase"].startswith("orbax"):
        sys.path.insert(0, HERE)
        from bench_tiers_orbax import worker as orbax_worker

        try:
            got = orbax_worker(pid, n, cfg)
        except BaseException:  # fail now, not at the shutdown barrier minutes later
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        print("BENCH " + json.dumps({"pid": pid, **got}), flush=True)
        jax.distributed.shutdown()
        return
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import quire
    from quire.policies import EveryNSteps

    mesh = Mesh(np.array(jax.devices()), ("d",))

    def put(a: np.ndarray, spec: PartitionSpec) -> Any:
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])

    def state(step: int) -> dict[str, Any]:
        rng = np.random.default_rng(step)
        rows = 2 * n * 64
        cols = max(1, (cfg["mib"] << 20) // 4 // rows)
        big = rng.standard_normal((rows, cols), dtype=np.float32)
        rep = rng.standard_normal(big.size // 16, dtype=np.float32)
        return {"w": put(big, PartitionSpec("d")), "r": put(rep, PartitionSpec()), "step": step}

    def same(a: dict[str, Any], b: dict[str, Any]) -> None:
        for k in ("w", "r"):
            for x, y in zip(a[k].addressable_shards, b[k].addressable_shards):
                assert np.asarray(x.data).tobytes() == np.asarray(y.data).tobytes(), k

    def sync(tag: str) -> None:
        multihost_utils.sync_global_devices(tag)

    opts = cfg["options"]
    local = cfg["local"]
    out: dict[str, Any] = {}

    def tiered(**kw: Any) -> Any:
        return quire.Checkpointer(
            cfg["tiered"],
            save_policy=EveryNSteps(2),
            storage_options=opts,
            local=quire.LocalTier(local, save_policy=EveryNSteps(1), peers=1),
            **kw,
        )

    def timed_save(c: Any, step: int) -> tuple[float, float]:
        s = state(step)
        sync(f"save{step}")
        t0 = time.perf_counter()
        c.save(step, s)
        t1 = time.perf_counter()
        c.wait()
        return t1 - t0, time.perf_counter() - t0

    def timed_load(c: Any, step: int) -> float:
        abstract = state(0)
        sync(f"load{step}")
        prof = sampler = None
        if cfg.get("profile"):
            import cProfile

            prof, sampler = cProfile.Profile(), Sampler()
            prof.enable()
            sampler.start()
        t0 = time.perf_counter()
        got = c.load(step, abstract)
        t = time.perf_counter() - t0
        if prof is not None and sampler is not None:
            prof.disable()
            sampler.stop()
            stem = os.path.join(cfg["profile"], f"{cfg['phase']}-{n}p-{pid}")
            prof.dump_stats(stem + ".prof")
            sampler.dump(stem + ".samples.txt")
        same(got, state(step))
        return t

    def peer_bytes(c: Any) -> list[int]:
        """Bytes and requests this process's restore read from other processes (TCP)."""
        got = [v for k, v in c._tier.spread.last_restore.items() if k.startswith("process ")]
        return [sum(b for b, _ in got), sum(r for _, r in got)]

    phase = cfg["phase"]
    if phase == "plain":
        with quire.Checkpointer(cfg["plain"], storage_options=opts) as c:
            c.save(1, state(1))
            c.wait()
            out["blocked"], out["wall"] = timed_save(c, 2)
        with quire.Checkpointer(cfg["plain_dir"]) as c:  # the persistent tier on local disk
            c.save(1, state(1))
            c.wait()
            out["dir"] = timed_save(c, 2)
    elif phase == "tiered":
        with tiered() as c:
            c.save(1, state(1))  # warm-up, local only
            c.wait()
            blocked, wall = timed_save(c, 2)
            out["promoted"] = (blocked, wall)
            out["local"] = timed_save(c, 3)
    elif phase == "restore-local":
        with tiered() as c:
            out["wall"] = timed_load(c, 3)
            out["peer"] = peer_bytes(c)
    elif phase in ("restore-peer", "restore-peer-clear"):
        if (
            phase == "restore-peer-clear"
        ):  # this benchmark's baseline: no cipher after the handshake
            sys.path.insert(0, HERE)
            from bench_peers import plaintext_after_handshake, use_stream

            use_stream(plaintext_after_handshake())
        if pid == 1:
            shutil.rmtree(os.path.join(local, "process_00001"), ignore_errors=True)
        sync("wiped")
        with tiered() as c:
            out["wall"] = timed_load(c, 2)
            out["peer"] = peer_bytes(c)
    elif phase == "restore-persistent":
        with quire.Checkpointer(cfg["tiered"], storage_options=opts) as c:
            out["wall"] = timed_load(c, 2)
    elif phase == "restore-persistent-dir":
        with quire.Checkpointer(cfg["plain_dir"]) as c:
            out["wall"] = timed_load(c, 2)
    print("BENCH " + json.dumps({"pid": pid, **out}), flush=True)
    jax.distributed.shutdown()


# ----------------------------------------------------------------------------- driver
def launch(n: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    me = os.path.abspath(__file__)
    procs = [
        subprocess.Popen(
            [sys.executable, me, "--worker", str(i), str(n), str(port), json.dumps(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(n)
    ]
    results = []
    for p in procs:
        o, e = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(f"a worker failed ({cfg['phase']}):\n{e[-4000:]}")
        results += [json.loads(ln[6:]) for ln in o.splitlines() if ln.startswith("BENCH ")]
    return results


def orbax_rows(
    n: int,
    cfg: dict[str, Any],
    rows: dict[tuple[int, str], list[tuple[float, float, Any, int | None]]],
    on_disk: str,
    broadcast: dict[tuple[int, str], list[tuple[float, float]]],
) -> None:
    """One rep of Orbax's emergency CheckpointManager rows (bench_tiers_orbax.py), with one
    replica per process and, with more than 2 processes, with 2 replicas as well."""
    for kind, replicas in [(k, r) for k in ("emergency", "p2p") for r in sorted({n, 2})[::-1]]:
        run = {**cfg, "kind": kind, "replicas": replicas}
        run["orbax"] = f"{cfg['orbax']}-{kind}-r{replicas}"
        tag = f"Orbax {'P2P' if kind == 'p2p' else 'emergency'}, {replicas} replicas"
        rs = launch(n, {**run, "phase": "orbax-save"})
        for key, name in [("promoted", "local + persistent"), ("local", "local only")]:
            rows[(n, f"{tag}, save: {name}")].append(
                (max(r[key][0] for r in rs), max(r[key][1] for r in rs), on_disk, None)
            )
        for name, phase in [
            ("restore: nothing lost", "orbax-restore-local"),
            ("restore: one dir lost", "orbax-restore-lost"),
            ("restore: persistent", "orbax-restore-persistent"),
        ]:
            rs = launch(n, {**run, "phase": phase})
            # emergency: the one replica that read; P2P: what each process read from
            source = " + ".join(sorted({r["source"] for r in rs} - {None}))
            wall = max(r["wall"] for r in rs)
            # every replica ends with the same values; replica 0 is the first n // replicas
            flipped = sum(r["flipped"] for r in rs if r["pid"] < n // replicas)
            name = f"{tag}, {name}, from {source}"
            name += f" ({flipped} x -0.0 read as +0.0)" if flipped else ""
            sent = None if kind == "p2p" else ((replicas - 1) * state_bytes(cfg, n), None)
            rows[(n, name)].append((wall, wall, on_disk, sent))
            if kind != "p2p":
                broadcast[(n, name)].append((wall, max(r["broadcast"] for r in rs)))


def plain_rows(
    n: int,
    cfg: dict[str, Any],
    rows: dict[tuple[int, str], list[Any]],
    on_disk: str,
    reqs: Any,
) -> None:
    """One rep of the plain (untiered) save rows."""
    rs = launch(n, {**cfg, "phase": "plain"})
    rows[(n, "save: plain persistent")].append(
        (max(r["blocked"] for r in rs), max(r["wall"] for r in rs), reqs(), None)
    )
    rows[(n, "save: plain persistent, local dir")].append(
        (max(r["dir"][0] for r in rs), max(r["dir"][1] for r in rs), on_disk, None)
    )


def state_bytes(cfg: dict[str, Any], n: int) -> int:
    """Bytes of the benchmark's state (the worker's ``state``)."""
    rows = 2 * n * 64
    cols = max(1, (cfg["mib"] << 20) // 4 // rows)
    return rows * cols * 4 + rows * cols // 16 * 4 + 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--no-orbax", action="store_true", help="leave out the Orbax rows")
    ap.add_argument(
        "--restores-only",
        action="store_true",
        help="only the tiered saves and the local and lost-dir restores (their ratio); no "
        "plain saves, no persistent restores, no Orbax",
    )
    ap.add_argument(
        "--profile", metavar="DIR", help="cProfile each restore's load, one file per process"
    )
    ap.add_argument(
        "--clear",
        action="store_true",
        help="also the lost-dir restore with the peer link's cipher off after the handshake "
        "(this benchmark's baseline, as in bench_peers.py)",
    )
    args = ap.parse_args()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    clear = [("restore: lost dir (peers, clear after handshake)", "restore-peer-clear")]
    clear = clear if args.clear else []

    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    import boto3
    from moto_server import start_moto
    from object_store_servers import ProxyProcess

    moto, server = start_moto({"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(1 << 30)})
    host, port = server.removeprefix("http://").split(":")
    proxy = ProxyProcess((host, int(port)), args.latency_ms / 1000)
    client = boto3.client(
        "s3", endpoint_url=server, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
        region_name="us-east-1",
    )  # fmt: skip
    client.create_bucket(Bucket=BUCKET)
    opts = {"endpoint_url": proxy.endpoint, "key": KEY, "secret": SECRET}
    base = tempfile.mkdtemp(prefix="quire-bench-tiers-multi-")
    rows: dict[
        tuple[int, str],
        list[tuple[float, float, dict[str, int] | str, tuple[int, int | None] | None]],
    ] = collections.defaultdict(list)
    on_disk = "0 (persistent tier: local dir)"
    broadcast: dict[tuple[int, str], list[tuple[float, float]]] = collections.defaultdict(list)

    def reqs() -> dict[str, int]:
        return dict(collections.Counter(e[0] for e in proxy.take_log()))

    try:
        for n in args.procs:
            for rep in range(args.reps):
                run = uuid.uuid4().hex[:8]
                cfg = {
                    "mib": args.mib,
                    "options": opts,
                    "plain": f"s3://{BUCKET}/plain-{run}",
                    "tiered": f"s3://{BUCKET}/tiered-{run}",
                    "local": os.path.join(base, run),
                    "plain_dir": os.path.join(base, f"plain-{run}"),
                    "orbax": os.path.join(base, f"orbax-{run}"),
                    "profile": args.profile and os.path.abspath(args.profile),
                }

                if not args.restores_only:
                    plain_rows(n, cfg, rows, on_disk, reqs)
                rs = launch(n, {**cfg, "phase": "tiered"})
                got = reqs()
                rows[(n, "save: tiered, local + promotion")].append(
                    (max(r["promoted"][0] for r in rs), max(r["promoted"][1] for r in rs), got,
                     None)
                )  # fmt: skip
                rows[(n, "save: tiered, local only")].append(
                    (max(r["local"][0] for r in rs), max(r["local"][1] for r in rs), {}, None)
                )
                for name, phase in [
                    ("restore: local", "restore-local"),
                    ("restore: lost dir (peers)", "restore-peer"),
                    ("restore: persistent", "restore-persistent"),
                ][: 2 if args.restores_only else 3] + clear:
                    reqs()
                    rs = launch(n, {**cfg, "phase": phase})
                    wall = max(r["wall"] for r in rs)
                    peer = None
                    if "peer" in rs[0]:
                        peer = (sum(r["peer"][0] for r in rs), sum(r["peer"][1] for r in rs))
                    rows[(n, name)].append((wall, wall, reqs(), peer))
                if args.restores_only:
                    reqs()
                    print(f"{n} processes: rep {rep + 1}/{args.reps} done", file=sys.stderr)
                    continue
                rs = launch(n, {**cfg, "phase": "restore-persistent-dir"})
                wall = max(r["wall"] for r in rs)
                rows[(n, "restore: persistent, local dir")].append((wall, wall, on_disk, None))
                if not args.no_orbax:
                    orbax_rows(n, cfg, rows, on_disk, broadcast)
                reqs()
                print(f"{n} processes: rep {rep + 1}/{args.reps} done", file=sys.stderr)
    finally:
        proxy.stop()
        moto.kill()
        moto.wait()
        shutil.rmtree(base, ignore_errors=True)

    print(
        f"\nstate {args.mib} MiB sharded + {args.mib / 16:g} MiB replicated, 2 CPU devices per "
        f"process, S3 = moto behind a {args.latency_ms:g} ms proxy; slowest process, best of "
        f"{args.reps}\n"
    )
    print(
        "| procs | row | blocked s | wall s | requests to S3 | MiB (requests) read from peers |\n"
        "|---|---|---|---|---|---|"
    )
    for (n, name), rs in rows.items():
        best = min(rs, key=lambda r: r[1])
        req = best[2] if isinstance(best[2], str) else (
            ", ".join(f"{m} {k}" for m, k in sorted(best[2].items())) or "0"
        )  # fmt: skip
        peer = "" if best[3] is None else f"{best[3][0] / (1 << 20):.2f}"
        peer += "" if best[3] is None or best[3][1] is None else f" ({best[3][1]})"
        print(f"| {n} | {name} | {best[0]:.3f} | {best[1]:.3f} | {req} | {peer} |")
    if not args.no_orbax and not args.restores_only:
        print("\nOrbax restores: seconds in the broadcast (slowest process, in the best rep):")
        for (n, name), bs in broadcast.items():
            print(f"  {n} processes, {name}: {min(bs)[1]:.3f} of {min(bs)[0]:.3f}")
        print(
            "\nOrbax (orbax-checkpoint 0.12.8; persistent tier: a local directory): mesh "
            "(replicas, 2 * procs / replicas) = (replica, d), every replica holds the whole "
            "state. Emergency CheckpointManager: replica 0 saves to the persistent tier only, "
            "the others to their local directories only; a restore reads on one replica "
            "(named in the row) and broadcasts over gloo (MiB read from peers: the state as "
            "received by the other replicas). P2P CheckpointManager: every process saves its "
            "shards locally, replica 0 also to the persistent tier; a process lacking a step "
            "fetches its shards from a peer over TCP (the row names the processes that did)."
        )
    for n in args.procs:
        lost, local = rows[(n, "restore: lost dir (peers)")], rows[(n, "restore: local")]
        each = sorted(a[1] / b[1] for a, b in zip(lost, local))
        print(
            f"\n{n} processes: restore lost-dir / local per rep (the two launches of one rep): "
            f"median {statistics.median(each):.2f}x, {', '.join(f'{x:.2f}' for x in each)}; "
            f"medians {statistics.median(a[1] for a in lost):.3f} s / "
            f"{statistics.median(b[1] for b in local):.3f} s"
        )
        if args.clear:
            plain = rows[(n, clear[0][0])]
            each = sorted(a[1] / b[1] for a, b in zip(plain, local))
            print(
                f"{n} processes: restore lost-dir with the cipher off / local per rep: median "
                f"{statistics.median(each):.2f}x, {', '.join(f'{x:.2f}' for x in each)}"
            )
        if args.restores_only:
            continue
        r = {name: min(x[1] for x in rs) for (m, name), rs in rows.items() if m == n}
        print(
            f"\n{n} processes: restore lost-dir / local = "
            f"{r['restore: lost dir (peers)'] / r['restore: local']:.2f}x; persistent / "
            f"local = {r['restore: persistent'] / r['restore: local']:.2f}x; persistent / "
            f"lost-dir = {r['restore: persistent'] / r['restore: lost dir (peers)']:.2f}x; "
            f"save blocked tiered local-only / plain = "
            f"{min(x[0] for x in rows[(n, 'save: tiered, local only')]) / min(x[0] for x in rows[(n, 'save: plain persistent')]):.2f}x"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]))
    else:
        main()
