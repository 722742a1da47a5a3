"""Local tier vs persistent tier: save blocking and wall time, restore time, requests to S3.

Run from the repository root::

    .venv/bin/python benchmarks/bench_tiers.py              # ~128 MiB state, 3 reps
    .venv/bin/python benchmarks/bench_tiers.py --mib 32 --reps 1   # smoke run

One JAX process (the 2- and 4-process rows, with peer copies and the restore from peers:
``benchmarks/bench_tiers_multi.py``).  The persistent tier
is moto's S3 server in its own process behind the latency proxy of
``tests/object_store_servers.py`` (``ProxyProcess``, ``--latency-ms``, default 20) in another;
the local tier is a directory under ``--local-dir`` (default: a temporary directory).

Rows (best of ``--reps``; the state: a few float32 jax arrays of ``--mib`` MiB in all):

* ``save: plain persistent``: ``Checkpointer(s3).save`` (a ``save_async``) of a second step
  (the first, not measured, creates the root record): blocked = until ``save`` returns,
  wall = until ``wait()`` returns (committed on S3);
* ``save: tiered, local only``: ``Checkpointer(s3, local=LocalTier(dir))`` at a step only the
  local policy saves;
* ``save: tiered, local + promotion``: at a step both policies save (the first promotion,
  so its wall time includes creating the root record); wall includes the checked copy of the
  local bytes to S3 and its commit;
* ``restore: local``: ``load`` by a new tiered Checkpointer whose local tier holds the step;
* ``restore: persistent``: the same step by a plain Checkpointer on the S3 root.

``requests`` = HTTP requests through the proxy during that row (by method), ``stored`` = bytes
of the step's objects on S3.  Every restore is checked byte for byte.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import collections
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from moto_server import start_moto  # noqa: E402

KEY, SECRET, BUCKET = "bench-key", "bench-secret", "quire-bench"


def timed_save(c: Any, step: int, state: Any) -> tuple[float, float]:
    """Seconds the caller is blocked in ``c.save`` and until the save (and any promotion)
    is done."""
    t0 = time.perf_counter()
    c.save(step, state)
    t1 = time.perf_counter()
    c.wait()
    return t1 - t0, time.perf_counter() - t0


def make_state(mib: int, seed: int) -> dict[str, Any]:
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    n = max(1, (mib << 20) // 4 // 4)
    return {f"w{i}": jnp.asarray(rng.standard_normal(n, dtype=np.float32)) for i in range(4)} | {
        "step": seed
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k in a:
        assert np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes(), k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--local-dir", default=None)
    args = ap.parse_args()

    import boto3
    from object_store_servers import ProxyProcess

    import quire
    from quire.policies import EveryNSteps

    moto, server = start_moto({"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(1 << 30)})
    host, port = server.removeprefix("http://").split(":")
    proxy = ProxyProcess((host, int(port)), args.latency_ms / 1000)
    client = boto3.client(
        "s3", endpoint_url=server, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
        region_name="us-east-1",
    )  # fmt: skip
    client.create_bucket(Bucket=BUCKET)
    opts = {"endpoint_url": proxy.endpoint, "key": KEY, "secret": SECRET}
    local_base = args.local_dir or tempfile.mkdtemp(prefix="quire-bench-tiers-")
    rows: dict[str, list[tuple[float, float, dict[str, int], int]]] = collections.defaultdict(list)

    def reqs() -> dict[str, int]:
        return dict(collections.Counter(e[0] for e in proxy.take_log()))

    def stored(prefix: str) -> int:
        total = 0
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            total += sum(o["Size"] for o in page.get("Contents", []))
        return total

    try:
        for rep in range(args.reps):
            s1, s2 = make_state(args.mib, 1), make_state(args.mib, 2)
            abstract = make_state(1, 0) | {k: s1[k] for k in s1 if k != "step"}
            run = uuid.uuid4().hex[:8]
            # -- plain persistent save_async
            url_p = f"s3://{BUCKET}/plain-{run}"
            c = quire.Checkpointer(url_p, storage_options=opts)
            c.save(1, s1)  # warm-up (the root record, the first save's gc): not measured
            c.wait()
            reqs()
            blocked, wall = timed_save(c, 2, s2)
            rows["save: plain persistent"].append(
                (blocked, wall, reqs(), stored(f"plain-{run}/step_00000002/"))
            )
            c.close()
            # -- tiered: a local-only step, then a step promoted to S3
            url_t = f"s3://{BUCKET}/tiered-{run}"
            local = os.path.join(local_base, run)
            c = quire.Checkpointer(
                url_t,
                save_policy=EveryNSteps(2),
                storage_options=opts,
                local=quire.LocalTier(local, save_policy=EveryNSteps(1)),
            )
            c.save(1, s1)  # warm-up (local only): not measured
            c.wait()
            reqs()
            blocked, wall = timed_save(c, 2, s2)
            assert c.tiers_of(2) == ("local", "persistent")
            rows["save: tiered, local + promotion"].append(
                (blocked, wall, reqs(), stored(f"tiered-{run}/step_00000002/"))
            )
            blocked, wall = timed_save(c, 3, s1)
            rows["save: tiered, local only"].append((blocked, wall, reqs(), 0))
            c.close()
            # -- restores of step 2
            c = quire.Checkpointer(
                url_t,
                storage_options=opts,
                local=quire.LocalTier(local, save_policy=EveryNSteps(1)),
            )
            reqs()
            t0 = time.perf_counter()
            got = c.load(2, abstract)
            t1 = time.perf_counter()
            same(got, s2)
            rows["restore: local"].append((t1 - t0, t1 - t0, reqs(), 0))
            c.close()
            c = quire.Checkpointer(url_t, storage_options=opts)
            reqs()
            t0 = time.perf_counter()
            got = c.load(2, abstract)
            t1 = time.perf_counter()
            same(got, s2)
            rows["restore: persistent"].append((t1 - t0, t1 - t0, reqs(), 0))
            c.close()
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
    finally:
        proxy.stop()
        moto.kill()
        moto.wait()
        if args.local_dir is None:
            shutil.rmtree(local_base, ignore_errors=True)

    print(
        f"\nstate {args.mib} MiB (4 float32 arrays + a scalar), 1 process, S3 = moto behind a "
        f"{args.latency_ms:g} ms proxy, local tier = {local_base}; best of {args.reps}\n"
    )
    print("| row | blocked s | wall s | requests to S3 | stored on S3 |\n|---|---|---|---|---|")
    for name, rs in rows.items():
        best = min(rs, key=lambda r: r[1])
        req = ", ".join(f"{m} {n}" for m, n in sorted(best[2].items())) or "0"
        size = f"{best[3] / 2**20:.1f} MiB" if best[3] else "-"
        print(f"| {name} | {best[0]:.3f} | {best[1]:.3f} | {req} | {size} |")
    r = {n: min(x[1] for x in rs) for n, rs in rows.items()}
    print(
        f"\nrestore persistent / local = {r['restore: persistent'] / r['restore: local']:.2f}x; "
        f"save wall plain / tiered local-only = "
        f"{r['save: plain persistent'] / r['save: tiered, local only']:.2f}x"
    )


if __name__ == "__main__":
    main()
