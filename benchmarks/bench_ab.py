"""Before/after run of ``bench_local.py``: quire at a base revision against this checkout.

Run from the repository root::

    .venv/bin/python benchmarks/bench_ab.py --quick --rounds 2          # ~170 MiB tree
    .venv/bin/python benchmarks/bench_ab.py --rounds 2                  # full tree (~1.3 GiB)
    .venv/bin/python benchmarks/bench_ab.py --base 7c7200f --peers quire,raw --variants numpy

Each round runs ``bench_local.py`` (this checkout's copy, so both versions see the same
tree, peers and methodology) in two fresh processes, one per quire version, alternating
which goes first.  The base revision's ``core/src`` is extracted with ``git archive`` into
a temporary directory that goes first on ``PYTHONPATH``; everything else (jax, numpy,
orbax, safetensors) is the same installation.  Every peer runs in each process, so each
version's ratios against raw numpy / orbax / safetensors come from its own runs.  The
``quire-v1`` peer (``layout="chunks"``) exists only after format v2, so it is dropped for a
base that predates it.

The report takes the best (minimum) time over every round and rep: per version, the
seconds of each peer, the speed of this checkout against the base (>1: faster now), and
each version's throughput ratio ``quire/peer`` (>1: quire faster).  Differences under
~30% are noise on a busy machine; the all-runs column shows the spread.  The same report
follows for the process's CPU seconds (all threads), which other programs on the cores
disturb far less than wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEERS = "quire,quire-v1,orbax,safetensors,raw"
VERSIONS = ("base", "new")


def extract(rev: str, dest: str) -> str:
    """``core/src`` of ``rev`` under ``dest``; returns the directory to put on PYTHONPATH."""
    tar = subprocess.run(
        ["git", "-C", ROOT, "archive", "--format=tar", rev, "core/src"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as t:
        t.extractall(dest, filter="data")
    src = os.path.join(dest, "core", "src")
    _dist_info(rev, src)
    return src


def _dist_info(rev: str, src: str) -> None:
    """Give the extracted source the entry points of its own ``core/pyproject.toml``.

    quire finds its built-in backends, codecs and handlers through entry points; those of
    the installed (current) quire may name modules the base revision does not have.  A
    ``quire`` dist-info first on ``sys.path`` shadows the installed one, as
    ``importlib.metadata`` keeps the first distribution of each name.
    """
    import tomllib

    raw = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:core/pyproject.toml"],
                         check=True, capture_output=True).stdout  # fmt: skip
    project = tomllib.loads(raw.decode())["project"]
    info = os.path.join(src, f"quire-{project.get('version', '0')}.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: quire\nVersion: {project.get('version', '0')}\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        for group, eps in project.get("entry-points", {}).items():
            f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n")


def has_layout(src: str) -> bool:
    """Whether the quire under ``src`` knows ``layout=`` (format v2 and later)."""
    with open(os.path.join(src, "quire", "_api.py")) as f:
        return "layout" in f.read()


def run_one(
    version: str, src: str | None, peers: str, args: argparse.Namespace, out: str
) -> dict[str, Any]:
    cmd = [sys.executable, os.path.join(HERE, "bench_local.py"), "--reps", str(args.reps)]
    cmd += ["--variants", args.variants, "--peers", peers, "--json", out]
    if args.quick:
        cmd.append("--quick")
    if args.dir:
        cmd += ["--dir", args.dir]
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    print(f"\n### {version}: {' '.join(cmd)}" + (f"  (PYTHONPATH={src})" if src else ""))
    sys.stdout.flush()
    subprocess.run(cmd, check=True, env=env)
    with open(out) as f:
        return dict(json.load(f))


def merge(runs: list[dict[str, Any]], field: str) -> dict[tuple[str, str, str], list[float]]:
    """(variant, peer, op) -> every ``field`` ("times" or "cpu") of every run."""
    out: dict[tuple[str, str, str], list[float]] = {}
    for run in runs:
        for variant, v in run["variants"].items():
            for peer, ops in v["results"].items():
                for op, r in ops.items():
                    out.setdefault((variant, peer, op), []).extend(r.get(field, []))
    return out


def report(results: dict[str, dict[tuple[str, str, str], list[float]]], what: str) -> str:
    lines = []
    keys = sorted({k for res in results.values() for k in res})
    variants = sorted({k[0] for k in keys})
    for variant in variants:
        lines.append(f"\n== {variant}: best {what} over all rounds and reps (all runs)")
        for op in ("save", "load"):
            for peer in [p for p in PEERS.split(",")]:
                row = []
                for ver in VERSIONS:
                    ts = results[ver].get((variant, peer, op))
                    if ts:
                        row.append(f"{ver} {min(ts):7.3f} ({' '.join(f'{t:.2f}' for t in ts)})")
                if row:
                    lines.append(f"  {op:<5} {peer:<12} " + "   ".join(row))
        lines.append(f"\n== {variant}: ratios of {what} (best vs best)")
        for op in ("save", "load"):
            b = results["base"].get((variant, "quire", op))
            n = results["new"].get((variant, "quire", op))
            if b and n:
                lines.append(
                    f"  {op:<5} quire new vs base: {min(b) / min(n):.2f}x speed "
                    f"({min(n) / min(b) - 1:+.0%} time)"
                )
            v1 = results["new"].get((variant, "quire-v1", op))
            if n and v1:
                lines.append(f"  {op:<5} quire v2 vs v1 (new): {min(v1) / min(n):.2f}x speed")
            for peer in ("raw", "orbax", "safetensors"):
                cells = []
                for ver in VERSIONS:
                    q = results[ver].get((variant, "quire", op))
                    p = results[ver].get((variant, peer, op))
                    if q and p:
                        cells.append(f"{ver} {min(p) / min(q):.2f}x")
                    q1 = results[ver].get((variant, "quire-v1", op))
                    if q1 and p:
                        cells.append(f"{ver}-v1 {min(p) / min(q1):.2f}x")
                if cells:
                    lines.append(f"  {op:<5} quire/{peer:<11} " + "  ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="7c7200f", help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=2, help="runs per version, interleaved")
    ap.add_argument("--reps", type=int, default=3, help="repetitions inside each run")
    ap.add_argument("--quick", action="store_true", help="bench_local's ~170 MiB tree")
    ap.add_argument("--variants", default="numpy,sharded", help="comma list of numpy,sharded")
    ap.add_argument("--peers", default=PEERS, help=f"comma list of {PEERS}")
    ap.add_argument("--dir", default=None, help="where checkpoints are written")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="quire-ab-") as tmp:
        base_src = extract(args.base, os.path.join(tmp, "base"))
        peers = {"new": args.peers, "base": args.peers}
        if not has_layout(base_src):
            peers["base"] = ",".join(p for p in args.peers.split(",") if p != "quire-v1")
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VERSIONS}
        for r in range(args.rounds):
            order = VERSIONS if r % 2 == 0 else VERSIONS[::-1]
            for ver in order:
                out = os.path.join(tmp, f"{ver}-{r}.json")
                src = base_src if ver == "base" else None
                runs[ver].append(run_one(ver, src, peers[ver], args, out))
        print(f"\n##### base = {args.base}: {runs['base'][0]['quire']}")
        print(f"##### new  = this checkout: {runs['new'][0]['quire']}")
        loads = [r["load_avg"] for rs in runs.values() for r in rs]
        print(f"##### load average at the end of each run: {', '.join(f'{x:.2f}' for x in loads)}")
        print(report({v: merge(runs[v], "times") for v in VERSIONS}, "wall seconds"))
        # CPU seconds of the whole process (all threads): steadier than wall time when
        # other programs share the cores, though not what a user waits for.
        print(report({v: merge(runs[v], "cpu") for v in VERSIONS}, "CPU seconds"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
