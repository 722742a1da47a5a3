"""Host buffers that ``jax.device_put`` can take without a copy.

On the CPU platform XLA adopts (aliases) a C-contiguous numpy buffer whose address is a
multiple of 64 bytes instead of copying it; any other buffer is copied, and that copy
into freshly allocated device memory costs more than reading the bytes from the page
cache did (measured: 19 ms against 0.04 ms for 32 MiB).  ``numpy.empty`` only promises
16-byte alignment, so loads allocate the buffers they read device shards into here.
The aliased buffer is then owned by the device array (donating it makes XLA allocate a
new buffer; the host bytes are never written again).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

ALIGN = 64  # XLA's CPU client adopts host buffers aligned to this many bytes


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts at a multiple of ``ALIGN``."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.empty(n + ALIGN, np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off : off + n].view(dt).reshape(shape)


def is_aligned(a: np.ndarray) -> bool:
    return bool(a.flags.c_contiguous) and a.ctypes.data % ALIGN == 0


def for_device(a: np.ndarray, dtype: Any = None) -> np.ndarray:
    """``a`` as ``dtype`` (its own by default), C-contiguous and aligned: ``a`` itself
    when it already is, else one aligned copy (with the cast folded in)."""
    dt = a.dtype if dtype is None else np.dtype(dtype)
    if a.dtype == dt and is_aligned(a):
        return a
    out = aligned_empty(a.shape, dt)
    np.copyto(out, a, casting="unsafe")
    return out


class StagingPool:
    """Host staging buffers that ``save_async`` copies mutable leaves into, reused across saves.

    A fresh buffer per save costs page faults on first touch (as much as the copy itself)
    and leaves the allocator's arenas fragmented, so a training loop's RSS creeps up save
    after save.  The pool keeps the buffers it hands out, keyed by shape and dtype, and
    hands one out again only when nothing but the pool refers to it: every numpy view of
    a buffer (and every memoryview of such a view) holds a reference to it, so a buffer a
    save, a codec or a pack writer still reads is never reused; a failed save's buffers
    come back the same way.  The pool owns at most ``limit`` bytes (the byte budget, passed
    by the caller); beyond it, idle buffers of other shapes are dropped, and a buffer that
    still does not fit is an ordinary allocation, freed when its save ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bufs: dict[tuple[tuple[int, ...], np.dtype[Any]], list[np.ndarray]] = {}
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers the pool owns (in use or idle)."""
        return self._bytes

    def take(self, shape: tuple[int, ...], dtype: Any, limit: int) -> np.ndarray:
        """A C-contiguous buffer of ``shape`` and ``dtype`` no one else refers to.

        Parameters
        ----------
        shape : tuple of int
        dtype : numpy dtype
        limit : int
            The most bytes the pool may own.
        """
        dt = np.dtype(dtype)
        # The dtype itself, not its type string: ml_dtypes' types share one ('<V1' for
        # every float8 and sub-byte int), and a buffer of another dtype would turn the
        # caller's copy into a value conversion.
        key = (tuple(shape), dt)
        with self._lock:
            bufs = self._bufs.setdefault(key, [])
            for i in range(len(bufs)):
                if _idle(bufs, i):
                    return bufs[i]
            out = np.empty(shape, dt)
            if self._bytes + out.nbytes > limit:
                self._evict(out.nbytes, limit)
            if self._bytes + out.nbytes <= limit:
                bufs.append(out)
                self._bytes += out.nbytes
            return out

    def _evict(self, need: int, limit: int) -> None:
        for bufs in self._bufs.values():
            i = 0
            while i < len(bufs) and self._bytes + need > limit:
                if _idle(bufs, i):
                    self._bytes -= bufs.pop(i).nbytes
                else:
                    i += 1

    def clear(self) -> None:
        """Forget every buffer (those in use stay alive until their saves end)."""
        with self._lock:
            self._bufs.clear()
            self._bytes = 0


def _refs(bufs: list[np.ndarray], i: int) -> int:
    return sys.getrefcount(bufs[i])


# References to a buffer only its pool's list holds, as _refs counts them (measured, not
# assumed: the count includes getrefcount's own argument).  A view or holder adds one.
_IDLE_REFS = _refs([np.empty(0)], 0)


def _idle(bufs: list[np.ndarray], i: int) -> bool:
    return _refs(bufs, i) <= _IDLE_REFS


staging = StagingPool()  # one per process: every save's staging buffers come from here
