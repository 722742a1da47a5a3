"""Host memory and time of ``quire cp`` from a non-quire source (streaming conversion).

Run:  .venv/bin/python benchmarks/bench_cp_memory.py              # 1 GiB safetensors, 64 MiB budget
      .venv/bin/python benchmarks/bench_cp_memory.py --quick      # 64 MiB, 8 MiB budget

Each side runs in a fresh process, which reports its peak RSS (``VmHWM``, reset before the
conversion) minus its RSS before it (so JAX and the imports do not count; ``ru_maxrss`` would
not do: Linux carries it over from the parent across fork and exec):

* ``stream``: ``quire cp`` (``quire._sources.convert.convert``), batches within the byte budget;
* ``whole``: the reference the streaming replaced — read the whole tree into host memory
  (``materialize_tree``), then ``quire.save`` it.

The source is a safetensors file of 4 MiB float32 tensors (one 4x larger, above the quick
budget).  The bound the streaming side should meet: byte budget + one tensor (plus the save's
own buffers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, time
import quire
from quire._runtime import ioloop as _io
from quire._sources.convert import convert
from quire._sources.materialize import materialize_tree

side, src_path, dst, budget = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
import jax
jax.devices()  # the XLA client (tens of MiB) is not the conversion's
quire.save(dst + "-warm", {"w": __import__("numpy").zeros(4)})  # nor are lazy imports
src = quire.open(src_path)
def status(field):  # kB -> bytes; VmHWM is this process's peak RSS (reset by exec)
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)

before = status("VmRSS")
if status("VmHWM") > before:  # the peak so far (imports) is not the conversion's
    open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current RSS
t0 = time.perf_counter()
with quire.Context(byte_budget=budget):
    if side == "stream":
        convert(src, dst, verify=False)
    else:
        tree = _io.submit(materialize_tree(src.tree, None)).result()
        quire.save(dst, tree)
        del tree
seconds = time.perf_counter() - t0
peak = status("VmHWM")
print(json.dumps({"seconds": seconds, "added": peak - before}))
"""


def make_source(path: str, total: int) -> int:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {"embed": rng.standard_normal((4096, 1024)).astype(np.float32)}  # 16 MiB
    i = 0
    while sum(v.nbytes for v in tensors.values()) < total:
        tensors[f"layers.{i}.w"] = rng.standard_normal((1024, 1024)).astype(np.float32)
        i += 1
    save_file(tensors, path)
    return max(v.nbytes for v in tensors.values())


def run(side: str, src: str, dst: str, budget: int) -> dict[str, float]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, side, src, dst, str(budget)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="64 MiB source, 8 MiB budget")
    ap.add_argument("--mib", type=int, default=1024, help="source size (MiB)")
    ap.add_argument("--budget-mib", type=int, default=64)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()
    total_mib, budget_mib = (64, 8) if args.quick else (args.mib, args.budget_mib)
    base = tempfile.mkdtemp(dir=args.dir, prefix="bench_cp_memory_")
    try:
        src = os.path.join(base, "src.safetensors")
        biggest = make_source(src, total_mib << 20)
        size = os.path.getsize(src)
        print(
            f"source {size / 2**20:.0f} MiB (largest tensor {biggest / 2**20:.0f} MiB), "
            f"byte budget {budget_mib} MiB"
        )
        for side in ("stream", "whole"):
            r = run(side, src, os.path.join(base, side), budget_mib << 20)
            print(
                f"{side:>6}: {r['seconds']:.2f}s, {size / 2**20 / r['seconds']:.0f} MiB/s, "
                f"peak host memory added {r['added'] / 2**20:.0f} MiB"
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
