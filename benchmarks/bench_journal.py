"""Cost of the partial-save journal: 100 versions of 10 MiB each, then finalize.

Run:  .venv/bin/python benchmarks/bench_journal.py [--versions 100] [--mib 10] [--dir DIR]
      .venv/bin/python benchmarks/bench_journal.py --quick     (10 versions of 1 MiB)

Three workloads: every version adds a new 10 MiB leaf ("add"); every version replaces
the same leaf ("replace": finalize must delete 99 superseded copies); every version
replaces the same 10 MiB leaf and adds its own 64 KiB one ("mostly-dead": each version's
pack keeps a small live part, so finalize rewrites those packs into one, format v2).
"mostly-dead" runs twice: with the rewrite, and with it switched off (every pack kept,
what finalize did before).  Prints the bytes written in all (data + journal records)
against the payload, finalize's time, and the objects and bytes left after it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

import quire


def tree_bytes(path: str) -> tuple[int, int]:
    total = files = 0
    for root, _, names in os.walk(path):
        for n in names:
            total += os.path.getsize(os.path.join(root, n))
            files += 1
    return total, files


def run(kind: str, base: str, versions: int, mib: int, rewrite: bool = True) -> None:
    from quire._engine import packrewrite as _packrewrite

    url = os.path.join(base, kind)
    shutil.rmtree(url, ignore_errors=True)
    n = mib * (1 << 20) // 4
    t0 = time.perf_counter()
    for i in range(versions):
        leaf = f"layer{i}" if kind == "add" else "layer"
        tree = {leaf: np.full(n, i, np.float32)}
        if kind == "mostly-dead":
            tree[f"small{i}"] = np.full(1 << 14, i, np.float32)
        quire.partial.save(url, tree, metadata={"v": i})
    t_saves = time.perf_counter() - t0
    written, _files = tree_bytes(url)
    journal, _ = tree_bytes(os.path.join(url, "journal"))
    _, files_before = tree_bytes(os.path.join(url, "d"))
    rule = _packrewrite.rewrites
    if not rewrite:  # what finalize did before packs were rewritten: keep every live pack
        _packrewrite.rewrites = lambda live, size: False  # type: ignore[assignment]
    t1 = time.perf_counter()
    try:
        quire.partial.finalize(url)
    finally:
        _packrewrite.rewrites = rule  # type: ignore[assignment]
    t_fin = time.perf_counter() - t1
    after, files_after = tree_bytes(url)
    payload = versions * mib * (1 << 20)
    label = kind if rewrite else f"{kind} (no rewrite)"
    print(
        f"{label:8s} versions={versions} payload={payload / 2**20:.0f} MiB  "
        f"written={written / 2**20:.1f} MiB ({written / payload:.4f}x payload; journal records "
        f"{journal / 1024:.1f} KiB)  saves={t_saves:.2f}s ({payload / t_saves / 1e9:.2f} GB/s)  "
        f"finalize={t_fin * 1000:.0f} ms  data objects {files_before} before finalize; after: "
        f"{after / 2**20:.1f} MiB in {files_after} files"
    )
    shutil.rmtree(url, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--versions", type=int, default=100)
    ap.add_argument("--mib", type=int, default=10)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--quick", action="store_true", help="10 versions of 1 MiB")
    a = ap.parse_args()
    if a.quick:
        a.versions, a.mib = 10, 1
    own = a.dir is None
    base = a.dir or tempfile.mkdtemp(prefix="quire-bench-journal-")
    try:
        for kind in ("add", "replace", "mostly-dead"):
            run(kind, base, a.versions, a.mib)
        run("mostly-dead", base, a.versions, a.mib, rewrite=False)
    finally:
        if own:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
