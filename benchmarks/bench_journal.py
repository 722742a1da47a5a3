"""Cost of the partial-save journal: 100 versions of 10 MiB each, then finalize.

Run:  .venv/bin/python benchmarks/bench_journal.py [--versions 100] [--mib 10] [--dir DIR]

Two workloads: every version adds a new 10 MiB leaf ("add"), and every version replaces
the same leaf ("replace": finalize must delete 99 superseded copies).  Prints the bytes
written in all (data + journal records) against the payload, and finalize's time.
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


def run(kind: str, base: str, versions: int, mib: int) -> None:
    url = os.path.join(base, kind)
    shutil.rmtree(url, ignore_errors=True)
    n = mib * (1 << 20) // 4
    t0 = time.perf_counter()
    for i in range(versions):
        leaf = f"layer{i}" if kind == "add" else "layer"
        quire.partial.save(url, {leaf: np.full(n, i, np.float32)}, metadata={"v": i})
    t_saves = time.perf_counter() - t0
    written, _files = tree_bytes(url)
    journal, _ = tree_bytes(os.path.join(url, "journal"))
    t1 = time.perf_counter()
    quire.partial.finalize(url)
    t_fin = time.perf_counter() - t1
    after, files_after = tree_bytes(url)
    payload = versions * mib * (1 << 20)
    print(
        f"{kind:8s} versions={versions} payload={payload / 2**20:.0f} MiB  "
        f"written={written / 2**20:.1f} MiB ({written / payload:.4f}x payload; journal records "
        f"{journal / 1024:.1f} KiB)  saves={t_saves:.2f}s ({payload / t_saves / 1e9:.2f} GB/s)  "
        f"finalize={t_fin * 1000:.0f} ms  after finalize: {after / 2**20:.1f} MiB in {files_after} files"
    )
    shutil.rmtree(url, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--versions", type=int, default=100)
    ap.add_argument("--mib", type=int, default=10)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    base = a.dir or tempfile.mkdtemp(prefix="quire-bench-journal-")
    for kind in ("add", "replace"):
        run(kind, base, a.versions, a.mib)


if __name__ == "__main__":
    main()
