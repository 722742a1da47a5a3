"""Format version 2: a load's chunk reads grouped into large windows of pack bytes.

On an object store every request costs a round trip (tens of milliseconds) and a share
of the request rate, so a load should read a pack in a few large ranged requests, issued
in parallel, rather than one request per chunk.  Coalescing only the reads that happen to
be queued together (``PackedReader._read``) finds little to merge when a tree has many
small leaves: the loader reads a bounded number of leaves at a time.

A load that knows which arrays it reads (``PackedReader.expect``: every chunk of those
arrays in this process's own index) plans **windows** up front: per pack, consecutive
expected chunks are grouped into spans of at most ``span`` bytes (the backend's
``read_part_size``, 64 MiB by default, the size of its other ranged reads), bridging gaps
of at most :data:`MAX_GAP` bytes.  The first read of a chunk of a window sends one request
for the whole window (one event-loop turn later, so that reads issued together share it):

* chunks whose readers are already waiting are read straight into their buffers;
* the other chunks of the window are staged in host memory for the reads still to come,
  at most ``stage_limit`` bytes at once (the byte budget); a chunk that does not fit ends
  the window there, and the rest of the window waits for its own first reader;
* a staged chunk is copied out and released when its reader comes; a read that finds its
  chunk neither read nor planned (read twice, a range of a zarr shard) is sent on its own.

Requests in flight are bounded by the readers waiting (each window has one at least), and
bytes held by the staging limit.  Checks are unchanged: the caller verifies each chunk.
"""

from __future__ import annotations

import asyncio
import builtins
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from quire._store.base import Backend

MAX_GAP = 256 << 10  # unexpected bytes between two chunks read rather than split the window


@dataclass(eq=False)
class _Slot:
    """One planned chunk: where it is and where its bytes go."""

    target: str
    offset: int
    length: int
    window: _Window | None = None
    views: builtins.list[memoryview] | None = None  # its reader's buffers (reader came first)
    staged: bytearray | None = None
    fut: asyncio.Future[int] | None = None  # bytes that arrived for it
    used: bool = False


@dataclass(eq=False)
class _Window:
    target: str
    slots: builtins.list[_Slot] = field(default_factory=list)
    started: bool = False


class Windows:
    """The planned windows of one load (see the module docstring)."""

    def __init__(self, base: Backend, span: int, stage_limit: int) -> None:
        self.base = base
        self.span = max(1, span)
        self.stage_limit = max(0, stage_limit)
        self.staged = 0  # bytes staged now
        self.slots: dict[str, _Slot] = {}
        self.requests = 0  # window requests sent (tests count them)
        self._pending: builtins.list[_Window] = []
        self._tasks: set[asyncio.Task[None]] = set()

    # -- planning ------------------------------------------------------------------------
    def plan(self, refs: Iterable[tuple[str, str, int, int]]) -> None:
        """Plan ``(key, pack, offset, length)`` chunks not planned yet into windows."""
        by_pack: dict[str, builtins.list[tuple[int, int, str]]] = {}
        for key, target, offset, length in refs:
            if key not in self.slots and length > 0:
                by_pack.setdefault(target, []).append((offset, length, key))
        for target, items in by_pack.items():
            items.sort()
            window: _Window | None = None
            end = 0
            for offset, length, key in items:
                if (
                    window is None
                    or offset < end  # overlapping references: never share a request
                    or offset - end > MAX_GAP
                    or offset + length - window.slots[0].offset > self.span
                ):
                    window = _Window(target)
                slot = _Slot(target, offset, length, window)
                window.slots.append(slot)
                self.slots[key] = slot
                end = offset + length

    # -- reads ---------------------------------------------------------------------------
    async def read(self, key: str, views: builtins.list[memoryview]) -> int | None:
        """Fill ``views`` (exactly the chunk's length) with chunk ``key``; the byte count,
        or None when the chunk is not planned (the caller reads it itself)."""
        slot = self.slots.get(key)
        if slot is None or slot.used or slot.window is None:
            return None
        if sum(v.nbytes for v in views) != slot.length:
            return None
        slot.used = True
        loop = asyncio.get_running_loop()
        if slot.fut is None:
            slot.fut = loop.create_future()
        window = slot.window
        if not window.started:
            slot.views = views
            if not self._pending:
                loop.call_soon(self._start_pending)
            if window not in self._pending:
                self._pending.append(window)
        n = await slot.fut
        if slot.staged is not None:
            staged, slot.staged = slot.staged, None
            self.staged -= len(staged)
            _copy(staged, views, n)
        elif slot.views is not views:  # dropped from its window: not read for us
            return None
        return n

    def _start_pending(self) -> None:
        pending, self._pending = self._pending, []
        for w in pending:
            if not w.started:
                self._start(w)

    def _start(self, w: _Window) -> None:
        """Send one request for ``w``; chunks that cannot be staged end it."""
        dest: builtins.list[memoryview] = []
        taken: builtins.list[_Slot] = []
        held = 0
        for i, s in enumerate(w.slots):
            gap = s.offset - (taken[-1].offset + taken[-1].length) if taken else 0
            if s.views is None:
                if self.staged + held + gap + s.length > self.stage_limit:
                    if not taken:  # nobody waits for it and it does not fit: drop it
                        self._drop(s)
                        continue
                    rest = _Window(w.target, w.slots[i:])
                    for r in rest.slots:
                        r.window = rest
                    if any(r.views is not None for r in rest.slots):
                        self._start(rest)
                    break
                s.staged = bytearray(s.length)
                held += s.length
                views = [memoryview(s.staged)]
            else:
                views = s.views
            if gap:
                dest.append(memoryview(bytearray(gap)))
            dest += views
            taken.append(s)
        w.slots, w.started = taken, True
        if not taken:
            return
        self.staged += held
        for s in taken:
            if s.fut is None:
                s.fut = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(self._send(w, dest))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _drop(self, s: _Slot) -> None:
        s.window = None
        if s.fut is not None and not s.fut.done():
            s.fut.set_result(0)

    async def _send(self, w: _Window, dest: builtins.list[memoryview]) -> None:
        start = w.slots[0].offset
        self.requests += 1
        try:
            n = await self.base.get_into(w.target, dest, start)
        except BaseException as e:
            for s in w.slots:
                if s.staged is not None:
                    self.staged -= len(s.staged)
                    s.staged = None
                assert s.fut is not None
                if not s.fut.done():
                    s.fut.set_exception(e)
                    s.fut.exception()  # raised to the chunk's reader, if one comes
            return
        for s in w.slots:
            assert s.fut is not None
            if not s.fut.done():
                s.fut.set_result(max(0, min(s.length, n - (s.offset - start))))

    def release(self) -> None:
        """Forget staged chunks nobody read (the load is over)."""
        for s in self.slots.values():
            s.staged = None
        self.staged = 0


def _copy(src: bytearray, views: Sequence[memoryview], n: int) -> None:
    pos = 0
    for v in views:
        if pos >= n:
            break
        k = min(v.nbytes, n - pos)
        v[:k] = memoryview(src)[pos : pos + k]
        pos += k


def expected_refs(
    refs: Mapping[str, Any], prefixes: Sequence[str]
) -> list[tuple[str, str, int, int]]:
    """``(key, pack, offset, length)`` of the pack references under ``prefixes``.

    Zarr shards are left out: a load reads them by ranges (the shard index, then the inner
    chunks it needs), never whole, so a window holding them would fetch bytes a second time
    and stage them for readers that never come.  An array is sharded when its ``zarr.json``
    (inline in the index) names the ``sharding_indexed`` codec.
    """
    wanted = tuple(p for p in prefixes if not _sharded(refs.get(f"{p}zarr.json")))
    out = []
    for key, ref in refs.items():
        if ref.target is not None and key.startswith(wanted):
            out.append((key, ref.target, ref.offset, ref.length))
    return out


def _sharded(meta: Any) -> bool:
    """Whether the inline ``zarr.json`` ``meta`` (a Ref, or None) describes a sharded array:
    its codec chain is the ``sharding_indexed`` codec (``quire._handlers.zarr_layout``)."""
    inline = getattr(meta, "inline", None)
    if inline is None:
        return False
    try:
        codecs = json.loads(inline).get("codecs")
    except (ValueError, AttributeError):
        return False  # not zarr metadata quire wrote: read as before (windows are a plan)
    first = codecs[0] if isinstance(codecs, list) and codecs else None
    return isinstance(first, dict) and first.get("name") == "sharding_indexed"
