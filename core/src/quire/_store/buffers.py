"""Buffer helpers of the object-store backends: flat views of the buffers a backend is
handed, byte-range slices of them without copying, reading a response stream into them, a
large ranged read as concurrent spans, and :class:`PartBuffers` (writes at offsets gathered
into upload parts).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from quire._runtime.tasks import gather_all
from quire._store.base import Buffer


def flat_views(data: Sequence[Buffer]) -> list[memoryview]:
    """Flat byte views of the non-empty buffers of ``data``."""
    return [v for v in (memoryview(d).cast("B") for d in data) if v.nbytes]


def byte_slice(bufs: Sequence[memoryview], start: int, stop: int) -> list[memoryview]:
    """The pieces of the concatenation of ``bufs`` in ``[start, stop)``, without copying.

    Parameters
    ----------
    bufs : sequence of memoryview
        The buffers, in order.
    start, stop : int
        The byte range of their concatenation.
    """
    out = []
    pos = 0
    for v in bufs:
        end = pos + v.nbytes
        if end > start and pos < stop:
            out.append(v[max(start - pos, 0) : min(stop, end) - pos])
        pos = end
        if pos >= stop:
            break
    return out


async def read_into(stream: Any, bufs: Sequence[memoryview], block: int = 4 << 20) -> int:
    """Copy from ``stream`` (anything with ``async read(n)``) into ``bufs`` in order.

    Parameters
    ----------
    stream : Any
        An async reader: ``await stream.read(n)`` returns at most ``n`` bytes.
    bufs : sequence of memoryview
        Writable buffers, filled in order.
    block : int
        The largest read.
    """
    n = 0
    for v in bufs:
        pos = 0
        while pos < v.nbytes:
            chunk = await stream.read(min(v.nbytes - pos, block))
            if not chunk:
                return n
            v[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
            n += len(chunk)
    return n


async def read_spans(
    read: Callable[[int, list[memoryview], int], Coroutine[Any, Any, int]],
    bufs: list[memoryview],
    offset: int,
    span: int,
) -> int:
    """Fill ``bufs`` from ``offset`` with concurrent ``read(start, views, length)`` calls of
    at most ``span`` bytes each; the byte count (short when the object ends early)."""
    total = sum(v.nbytes for v in bufs)
    spans = [(a, min(a + span, total)) for a in range(0, total, span)]
    counts = await gather_all([read(offset + a, byte_slice(bufs, a, b), b - a) for a, b in spans])
    n = 0
    for (a, b), got in zip(spans, counts):
        n += got
        if got < b - a:  # the object ended inside this span
            break
    return n


class PartBuffers:
    """Bytes written at any offsets, gathered into parts of a fixed size: the bookkeeping
    of a streamed upload (multipart, resumable) fed by concurrent writes at offsets, as
    ``Backend.stream_writer`` objects are.

    Parameters
    ----------
    size : int
        Bytes per part (the last part of the object may be shorter).

    Attributes
    ----------
    buffers : dict of int to bytearray
        Parts being filled (and full ones the caller has not taken), by index from 0.
    filled : dict of int to int
        Bytes received so far for each part in ``buffers``.
    end : int
        One past the highest byte written: the object's size once every write is in.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.buffers: dict[int, bytearray] = {}
        self.filled: dict[int, int] = {}
        self.end = 0

    def add(self, data: Sequence[Any], offset: int) -> list[int]:
        """Copy ``data`` (buffers, in order) in at ``offset``.

        Parameters
        ----------
        data : sequence of bytes-like
            The bytes to write, back to back.
        offset : int
            Where the first byte goes in the object.

        Returns
        -------
        list of int
            The indexes of the parts this write completed.
        """
        done = []
        for buf in data:
            mv = memoryview(buf).cast("B")
            while mv.nbytes:
                i, at = divmod(offset, self.size)
                part = self.buffers.get(i)
                if part is None:
                    part = self.buffers[i] = bytearray(self.size)
                    self.filled[i] = 0
                n = min(mv.nbytes, self.size - at)
                part[at : at + n] = mv[:n]
                self.filled[i] += n
                if self.filled[i] == self.size:
                    done.append(i)
                mv, offset = mv[n:], offset + n
        self.end = max(self.end, offset)
        return done

    def full(self, i: int) -> bool:
        """Whether part ``i`` has every byte (and has not been taken).

        Parameters
        ----------
        i : int
            A part index.
        """
        return self.filled.get(i) == self.size

    def take(self, i: int) -> bytearray:
        """Remove part ``i`` and return its buffer.

        Parameters
        ----------
        i : int
            A part index.
        """
        self.filled.pop(i, None)
        return self.buffers.pop(i)

    def tail(self) -> tuple[int, int]:
        """(index of the last part, its length when shorter than ``size``, else 0)."""
        return divmod(self.end, self.size)

    def whole(self) -> bool:
        """Whether every byte below :attr:`end` not yet taken has arrived (no holes):
        only the last part may be left, holding exactly its bytes."""
        last, rest = self.tail()
        if not rest:
            return not self.buffers
        return set(self.buffers) == {last} and self.filled.get(last) == rest
