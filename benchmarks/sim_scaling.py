"""Simulate format v2 (packed data) for 1 TB written by 1024 hosts x 8 devices.

Run from the repository root::

    .venv/bin/python benchmarks/sim_scaling.py              # 1024 hosts (a few minutes)
    .venv/bin/python benchmarks/sim_scaling.py --quick      # 32 hosts, seconds
    .venv/bin/python benchmarks/sim_scaling.py --replica-writes --layouts B   # as quire saves B

Without ``--replica-writes`` only the hosts holding replica 0 write (quire with
``replica_writes=False``); with it, the pieces of each replicated shard are placed by quire's
own planner (``quire._handlers.replicas.assign``) over the shard's holders.

Every simulated process runs quire's real pack writer (``quire._format.pack.PackWriter``) over a
backend that counts objects and bytes but keeps only the chunk indexes (in ``memory://``):
each process appends the chunks it owns (the zarr keys quire would write, one per device
shard with ``replica_id == 0``), packs are sealed as in a real save on an object store
on a backend that streams writes (local disks, S3 multipart: packs of ``pack_bytes``) or,
with ``--buffered``, on one that does not (GCS today: packs sealed at a quarter of
``byte_budget``), and its chunk index is serialized for real.  The primary's commit record is
then built with quire's own ``_records.build`` from synthetic leaf records of the measured
shape.  Chunk payloads are not materialized (one shared zero buffer; the per-chunk CRC is
not computed — it does not change any size).

Layouts (as in docs/scaling.md): A = 1,155 large arrays fully sharded over all devices +
580 small ones (primary); B = the same sharded 256 ways and replicated over 32 groups
(only replica-0 hosts write); C = 27 large + 16 small (stacked layers).

``--commit`` also times the primary's commit on that record, part by part (CPU seconds of
this one thread, which a busy machine disturbs less than wall time), over the
``memory://`` store that holds every process's index: checking the index entries the
processes shared (each its own size and crc32c, through the key-value store:
``quire._engine.record_parts.index_entries``), building the record, the reader's check of
it (``quire._engine.commit.check_record``) and the completeness check (every chunk of every
array in some index, each index read once, ``quire._engine.completeness``;
docs/commit-protocol.md).  The leaf
records then describe exactly the chunks the processes wrote (each array its own location
and chunk grid), so that check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

TB = 10**12


class CountingBackend:
    """Counts puts; stores index objects (``.index.json``) in a memory:// backend."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.url = store.url
        self.storage_options: dict[str, Any] = {}
        self.capabilities = store.capabilities
        self.objects = 0
        self.bytes = 0
        self.index_bytes = 0

    async def put(self, key: str, data: Sequence[Any]) -> None:
        n = sum(memoryview(b).nbytes for b in data)
        self.objects += 1
        self.bytes += n
        if key.endswith(".index.json"):
            self.index_bytes += n
            await self.store.put(key, data)


class _Stream:
    def __init__(self, be: CountingBackend) -> None:
        self.be = be

    async def write(self, data: Sequence[Any], offset: int) -> None:
        self.be.bytes += sum(memoryview(b).nbytes for b in data)

    async def close(self) -> None:
        pass

    async def abort(self) -> None:
        pass


class StreamingBackend(CountingBackend):
    """A streaming store (local disk, S3 multipart): packs grow to ``pack_bytes``."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.capabilities = dataclasses.replace(store.capabilities, stream_writes=True)

    async def stream_writer(self, key: str) -> _Stream:
        self.objects += 1
        return _Stream(self)


def layout(name: str, hosts: int, devices: int) -> dict[str, Any]:
    total_dev = hosts * devices
    if name == "A":
        return dict(large=1155, small=580, ways=total_dev, writers=hosts)
    if name == "B":
        return dict(large=1155, small=580, ways=256, writers=max(1, 256 // devices))
    return dict(large=27, small=16, ways=total_dev, writers=hosts)


def replica_plan(lay: dict[str, Any], hosts: int, devices: int, chunk: int) -> dict[int, list]:
    """Replica-parallel writes (``quire._handlers.replicas``): each shard held by several
    hosts is cut into ``min(holders, shard // replica_piece_bytes)`` pieces, placed largest
    first on the least-loaded holder by quire's own ``assign``.  Returns host -> [(array,
    chunk index, bytes)]."""
    from quire._handlers.replicas import assign
    from quire._runtime.config import current

    ways = lay["ways"]
    groups = hosts * devices // ways
    per_group = max(1, ways // devices)  # hosts holding one copy of an array
    holders = [[g * per_group + s // devices for g in range(groups)] for s in range(ways)]
    k = max(1, min(groups, chunk // current().replica_piece_bytes))
    sizes = [chunk // k + (1 if j < chunk % k else 0) for j in range(k)]
    units, keys = [], []
    for a in range(lay["large"]):
        for sh in range(ways):
            for j, n in enumerate(sizes):
                units.append((n, holders[sh]))
                keys.append((a, sh * k + j, n))
    order = sorted(range(len(units)), key=lambda i: -units[i][0])
    load = {0: lay["small"] * 4096}  # the primary's process-local small arrays
    out: dict[int, list] = {}
    for i, who in zip(order, assign([units[i] for i in order], load)):
        out.setdefault(who, []).append(keys[i])
    return out


async def simulate(
    name: str,
    hosts: int,
    devices: int,
    local: bool,
    replicas: bool = False,
    timings: dict[str, float] | None = None,
) -> dict[str, Any]:
    from quire._format import pack as _pack
    from quire._format.chunkindex import index_entry
    from quire._runtime.config import current
    from quire._store.memory import MemoryBackend

    lay = layout(name, hosts, devices)
    large_bytes = TB // lay["large"]
    chunk = large_bytes // lay["ways"]
    zero = memoryview(bytearray(min(chunk, 64 << 20)))
    shards_per_writer = lay["ways"] * 1 // lay["writers"]  # shards of one array per writer
    _pack.chunk_crc = lambda views, n=None: 0  # type: ignore[assignment]

    async def direct(fn: Any, *a: Any) -> Any:
        return fn(*a)

    _pack.run_blocking = direct  # type: ignore[assignment]
    store = MemoryBackend(f"memory://quire-sim-{name}-{time.time_ns()}")
    totals = {"objects": 0, "bytes": 0, "index": 0, "index_max": 0}
    entries = []
    txid = "0123456789abcdef"
    budget = 256 << 20
    plan = replica_plan(lay, hosts, devices, chunk) if replicas else None
    if plan is not None:
        lay["writers"] = len(plan)
    per_writer = []
    top = 0  # the highest chunk index written: each large array's grid is (top + 1, 1)
    for p in sorted(plan) if plan is not None else range(lay["writers"]):
        be = StreamingBackend(store) if local else CountingBackend(store)
        w = _pack.PackWriter(be, txid, p, current().pack_bytes, budget)  # type: ignore[arg-type]
        # the chunk's bytes + its crc32c, as views of one shared buffer (nothing allocated);
        # bound in the index by that trailer, as quire's array writer binds plain chunks
        whole, rest = divmod(chunk + 4, zero.nbytes)
        views = [zero] * whole + ([zero[:rest]] if rest else [])
        mine = (
            plan[p]
            if plan is not None
            else [
                (a, p * shards_per_writer + s, chunk)
                for a in range(lay["large"])
                for s in range(shards_per_writer)
            ]
        )
        by_size = {chunk: views}
        for a, c, n in mine:
            top = max(top, c)
            if n not in by_size:
                whole, rest = divmod(n + 4, zero.nbytes)
                by_size[n] = [zero] * whole + ([zero[:rest]] if rest else [])
            await w.put_bound(f"d/{txid}/pytree/layers/w{a:04d}/c/{c}/0", by_size[n], trailer=True)
        if p == 0:
            meta = json.dumps({"zarr_format": 3, "node_type": "array", "pad": "x" * 300})
            for loc in [f"layers/w{a:04d}" for a in range(lay["large"])] + [
                f"small/s{a:04d}" for a in range(lay["small"])
            ]:
                await w.put(f"d/{txid}/pytree/{loc}/zarr.json", [meta.encode()])
            for a in range(lay["small"]):
                small = [memoryview(bytearray(4096))]
                await w.put_bound(f"d/{txid}/pytree/small/s{a:04d}/c/0", small, trailer=True)
        entry = await w.finish()
        assert entry is not None
        data = await store.get(entry["object"])
        entries.append(index_entry(txid, p, entry["object"], data))
        totals["objects"] += be.objects
        totals["bytes"] += be.bytes
        per_writer.append(be.bytes)
        totals["index"] += len(data)
        totals["index_max"] = max(totals["index_max"], len(data))
    data = await record(store, txid, lay, top + 1, hosts, devices, entries, timings)
    totals["objects"] += 1  # quire.json
    return {
        "layout": name,
        "hosts": hosts,
        "writers": lay["writers"],
        "objects": totals["objects"],
        "TB_written": round(totals["bytes"] / TB, 3),
        "objects_per_writer": totals["objects"] / lay["writers"],
        "GB_per_writer_max": max(per_writer) / 10**9,
        "GB_per_writer_mean": sum(per_writer) / len(per_writer) / 10**9,
        "index_bytes_per_writer": totals["index"] / lay["writers"],
        "index_bytes_max": totals["index_max"],
        "record_bytes": len(data),
        "record_bytes_for_indexes": len(json.dumps(entries, separators=(",", ":"))),
    }


async def record(
    store: Any,
    txid: str,
    lay: dict[str, Any],
    grid: int,
    hosts: int,
    devices: int,
    entries: list[dict[str, Any]],
    timings: dict[str, float] | None,
) -> bytes:
    """The primary's commit record for what the processes wrote: every large array a grid of
    ``(grid, 1)`` chunks of 16 x 4096 bfloat16 (128 KiB, about the simulated chunk) at its own
    location, every small one a single chunk.  With ``timings``, the commit's parts on it."""
    from quire._engine import commit as _commit
    from quire._engine import completeness as _completeness
    from quire._format import record as _records
    from quire._format.chunkindex import check_entries

    groups = hosts * devices // lay["ways"]
    mesh = {"data": groups, "fsdp": lay["ways"]} if groups > 1 else {"fsdp": lay["ways"]}

    def leaf(loc: str, shape: list[int], chunk: list[int], dtype: str, **kw: Any) -> Any:
        n = 2 if dtype == "bfloat16" else 4
        return {"kind": "leaf", "handler": "jax" if kw else "numpy", "shape": shape,
                "dtype": dtype, "location": f"d/{txid}/pytree/{loc}", "chunk_shape": chunk,
                "codecs": [], "checksum": True, "nbytes": n * math.prod(shape), **kw}  # fmt: skip

    sharding = {"type": "named", "mesh": mesh, "spec": ["fsdp"]}
    large = [
        leaf(f"layers/w{a:04d}", [16 * grid, 4096], [16, 4096], "bfloat16", sharding=sharding)
        for a in range(lay["large"])
    ]
    small = [leaf(f"small/s{a:04d}", [1024], [1024], "float32") for a in range(lay["small"])]

    def node(keys: list[str], children: list[Any]) -> dict[str, Any]:
        return {"kind": "dict", "keys": keys, "children": children}

    tree = node(
        ["layers", "small"],
        [
            node([f"w{a:04d}" for a in range(lay["large"])], large),
            node([f"s{a:04d}" for a in range(lay["small"])], small),
        ],
    )
    clock = time.process_time  # CPU seconds: all of it is this thread's work on memory://
    t0 = clock()
    # the entries every process shared: the primary checks their form, reads no index
    entries = check_entries(entries, store.url)
    t1 = clock()
    data = _records.build(
        units={"pytree": {"kind": "pytree", "tree": tree}},
        txids=[txid],
        metadata={},
        process_count=hosts,
        indexes=entries,
    )
    t2 = clock()
    doc = _commit.check_record(data, store.url)
    t3 = clock()
    if timings is not None:
        trees, idx = _completeness.record_parts(doc)
        await _completeness.check(store, store.url, "quire.json", trees, idx)
        t4 = clock()
        for e in entries:  # of which: only parsing the index objects' JSON
            json.loads(await store.get(e["object"]))
        t5 = clock()
        timings.update(
            gather=t1 - t0, build=t2 - t1, check_record=t3 - t2, complete=t4 - t3, parse=t5 - t4
        )
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=1024)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="32 hosts")
    ap.add_argument("--layouts", default="A,B,C")
    ap.add_argument(
        "--buffered",
        action="store_true",
        help="a backend without streamed writes (packs sealed at byte_budget / 4)",
    )
    ap.add_argument(
        "--commit",
        action="store_true",
        help="time the primary's commit on the record, part by part (docs/commit-protocol.md)",
    )
    ap.add_argument(
        "--replica-writes",
        action="store_true",
        help="replicated shards (layout B) split over their holders, as quire does by default",
    )
    args = ap.parse_args(argv)
    hosts = 32 if args.quick else args.hosts
    print(f"1 TB from {hosts} hosts x {args.devices} devices, format v2")
    cols = [
        "layout",
        "writers",
        "objects",
        "TB_written",
        "objects_per_writer",
        "GB_per_writer_max",
        "GB_per_writer_mean",
        "index_bytes_per_writer",
        "index_bytes_max",
        "record_bytes",
        "record_bytes_for_indexes",
    ]
    print("  ".join(cols))
    for name in args.layouts.split(","):
        t0 = time.perf_counter()
        timings: dict[str, float] | None = {} if args.commit else None
        r = asyncio.run(
            simulate(
                name.strip(), hosts, args.devices, not args.buffered, args.replica_writes, timings
            )
        )
        row = [f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        print("  ".join(row), f"({time.perf_counter() - t0:.1f}s)")
        if timings:
            other = timings["gather"] + timings["build"] + timings["check_record"]
            print(
                f"  commit on the primary, CPU seconds: check {r['writers']} shared index entries "
                f"{timings['gather']:.2f}s, build {timings['build']:.2f}s, check_record "
                f"{timings['check_record']:.2f}s; completeness check {timings['complete']:.2f}s "
                f"= {timings['complete'] / other:.1f}x the rest (parsing the indexes' JSON alone: "
                f"{timings['parse']:.2f}s)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
