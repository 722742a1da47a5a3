"""Loads that read each shared byte once (DESIGN.md "Replicas share the work").

When several processes need the same stored chunk (a replicated target, or a resharded
one), every process computes the same plan from the commit record and the target
shardings: each shared chunk is read by one of the processes needing it (largest first to
the least loaded), and the encoded bytes go to the others through
:func:`quire._runtime.collective.exchange` — one collective per group of processes and
round, each round bounded by the byte budget, each behind a barrier with a deadline.
The exchanged bytes are served to the leaf handlers by :class:`SharedView`, so the usual
read path decodes and checks them (crc32c included) exactly as if read from storage:
the loaded values are the same bytes.  Chunks one process alone needs are read directly.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax

from quire._handlers import select as _selection
from quire._handlers.arrayplan import layout_from_record
from quire._handlers.arrays import ArrayHandler
from quire._runtime.collective import exchange
from quire._runtime.config import current
from quire._runtime.ioloop import run_blocking
from quire._runtime.multihost import Coordinator
from quire._store.base import Backend
from quire._store.wrapped import Wrapped
from quire.errors import PluginError

__all__ = ["SharedView", "plan_shared", "prefetch_shared"]

# (group of processes, chunk key, reader, weight in bytes)
Item = tuple[tuple[int, ...], str, int, int]


class SharedView(Wrapped):
    """``base`` with some chunk keys answered from memory (the exchanged bytes)."""

    def __init__(self, base: Backend, held: dict[str, memoryview]) -> None:
        super().__init__(base)
        self.held = held

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        data = self.held.get(key)
        if data is None:
            return await self.base.get(key, start, end)
        n = len(data)
        a = 0 if start is None else (start if start >= 0 else max(0, n + start))
        b = n if end is None else (end if end >= 0 else max(0, n + end))
        return bytes(data[a:b])

    async def size(self, key: str) -> int:
        data = self.held.get(key)
        return len(data) if data is not None else await self.base.size(key)

    async def get_into(self, key: str, buffers: Sequence[memoryview], offset: int = 0) -> int:
        data = self.held.get(key)
        if data is None:
            return await self.base.get_into(key, buffers, offset)
        pos = offset
        for b in buffers:
            take = max(0, min(b.nbytes, len(data) - pos))
            b.cast("B")[:take] = data[pos : pos + take]
            pos += take
        return pos - offset

    async def exists(self, key: str) -> bool:
        return key in self.held or await self.base.exists(key)


def plan_shared(pairs: Iterable[tuple[dict[str, Any], Any]], url: str) -> list[Item]:
    """The shared chunks of a load and who reads each (the same list in every process).

    Parameters
    ----------
    pairs : iterable of (record, target)
        The array leaves to load, in tree order.
    url : str
        The checkpoint, for messages.
    """
    needs: dict[str, tuple[set[int], int]] = {}
    # arrays of one sharding, shape and chunk grid need the same chunk coordinates
    cache: dict[Any, list[tuple[tuple[int, ...], frozenset[int]]]] = {}
    for rec, target in pairs:
        sharding = getattr(target, "sharding", None)
        if (
            isinstance(target, type)
            or not isinstance(sharding, jax.sharding.Sharding)
            or sharding.is_fully_addressable
        ):
            continue
        try:
            h = _selection.get(rec["handler"], url=url)
        except PluginError:  # not installed: the load itself says so
            continue
        if not isinstance(h, ArrayHandler):
            continue
        layout = layout_from_record(rec, url)
        shape = layout.shape
        if not shape or tuple(getattr(target, "shape", ())) != shape:
            continue
        weight = math.prod(layout.chunk_shape) * layout.dtype.itemsize
        loc = rec["location"]
        grid: Any = (sharding, shape, layout.chunk_shape)
        try:
            hash(grid)
        except TypeError:  # an unhashable sharding: no reuse, still correct
            grid = (id(sharding), shape, layout.chunk_shape)
        if grid not in cache:
            by_chunk: dict[tuple[int, ...], set[int]] = {}
            for dev, idx in sharding.devices_indices_map(shape).items():
                region = tuple(slice(*s.indices(n)[:2]) for s, n in zip(idx, shape))
                for coords in layout.chunks_in(region):
                    by_chunk.setdefault(coords, set()).add(int(getattr(dev, "process_index", 0)))
            cache[grid] = [(c, frozenset(p)) for c, p in by_chunk.items() if len(p) > 1]
        for coords, procs in cache[grid]:
            needs[f"{loc}/{layout.chunk_key(coords)}"] = (set(procs), weight)
    shared = sorted(
        ((-w, key, tuple(sorted(p))) for key, (p, w) in needs.items() if len(p) > 1),
    )
    load: dict[int, int] = {}
    out: list[Item] = []
    for neg, key, group in shared:
        who = min(group, key=lambda p: (load.get(p, 0), p))
        load[who] = load.get(who, 0) + -neg
        out.append((group, key, who, -neg))
    return out


def _rounds(items: list[Item], cap: int) -> list[list[Item]]:
    """``items`` of one group in rounds where no reader contributes more than ``cap``."""
    rounds: list[list[Item]] = []
    cur: list[Item] = []
    acc: dict[int, int] = {}
    for it in items:
        if cur and acc.get(it[2], 0) + it[3] > cap:
            rounds.append(cur)
            cur, acc = [], {}
        cur.append(it)
        acc[it[2]] = acc.get(it[2], 0) + it[3]
    if cur:
        rounds.append(cur)
    return rounds


async def prefetch_shared(
    url: str, backend: Backend, plan: list[Item], stats: dict[str, int] | None = None
) -> SharedView:
    """Read this process's share of ``plan``, exchange it, and return the view serving it.

    Groups are handled in one order everywhere (sorted), so overlapping groups never wait
    on each other in opposite orders.
    """
    cfg = current()
    me = jax.process_index()
    timeout = cfg.timeout if cfg.timeout is not None else 365 * 86400.0
    key = Coordinator(url, "load", primary=cfg.primary_process, timeout=timeout).key
    by_group: dict[tuple[int, ...], list[Item]] = {}
    for it in plan:
        by_group.setdefault(it[0], []).append(it)
    held: dict[str, memoryview] = {}
    sem = asyncio.Semaphore(max(1, cfg.max_concurrency))

    async def read(k: str) -> bytes:
        async with sem:
            return await backend.get(k)

    for group in sorted(by_group):
        if me not in group:
            continue
        # each process receives len(group) rows of the longest contribution: keep a
        # round's exchange within the byte budget
        cap = max(1, cfg.byte_budget // (2 * len(group)))
        name = "-".join(map(str, group))
        for n, rnd in enumerate(_rounds(by_group[group], cap)):
            mine = [k for _, k, who, _ in rnd if who == me]
            datas = await asyncio.gather(*(read(k) for k in mine))
            header = len(datas).to_bytes(8, "little") + b"".join(
                len(d).to_bytes(8, "little") for d in datas
            )
            payload = b"".join([header, *datas])
            if stats is not None:
                stats["shared_read"] = stats.get("shared_read", 0) + sum(map(len, datas))
            rows = await run_blocking(exchange, f"{key}/{name}/{n}", group, payload, timeout, url)
            for p, row in zip(group, rows):
                keys = [k for _, k, who, _ in rnd if who == p]
                count = int.from_bytes(row[:8], "little")
                if count != len(keys):
                    raise RuntimeError(
                        f"{url}: process {p} sent {count} shared chunks, {len(keys)} expected"
                    )
                pos = 8 + 8 * count
                for i, k in enumerate(keys):
                    ln = int.from_bytes(row[8 + 8 * i : 16 + 8 * i], "little")
                    held[k] = row[pos : pos + ln]
                    pos += ln
    return SharedView(backend, held)
