"""Descriptors a local load keeps open: each pack object is opened once per load.

A format-v2 load reads hundreds of ranges out of a few pack files; opening the file for
each (the symlink-safe ``openat2`` walk, plus the close) costs more than many of those
reads.  While :meth:`quire._store.local.LocalBackend.keep_open` is in effect, reads of
pack objects share one descriptor per pack, closed when the load ends, or, for a read
still in flight then (a cancelled load's worker thread), by that read when it finishes.
Only pack objects are kept (data under ``d/<txid>/`` is written once, so a kept
descriptor never reads stale bytes), and at most ``MAX_OPEN`` of them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

MAX_OPEN = 64
_PACKS = "/%packs/"  # quire._format.chunkindex.PACK_DIR, between the txid and the pack name


def keepable(key: str) -> bool:
    """Whether ``key`` names a pack object (``d/<txid>/%packs/<name>``)."""
    return key.startswith("d/") and _PACKS in key and not key.endswith(".json")


class OpenFiles:
    """Shared read-only descriptors by key, each with a count of the reads using it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[str, list[int]] = {}  # key -> [fd, reads using it]
        self._closed = False

    def acquire(self, key: str, opener: Callable[[], int]) -> tuple[int, bool]:
        """``(fd, shared)``: the kept descriptor of ``key`` (opened now if need be), or a
        fresh one the caller closes itself (``shared`` False) when no more may be kept."""
        with self._lock:
            ent = self._fds.get(key)
            if ent is None:
                if self._closed or len(self._fds) >= MAX_OPEN:
                    return opener(), False
                ent = self._fds[key] = [opener(), 0]
            ent[1] += 1
            return ent[0], True

    def release(self, key: str) -> None:
        """One read of ``key`` is done with its shared descriptor."""
        with self._lock:
            ent = self._fds[key]
            ent[1] -= 1
            if self._closed and not ent[1]:
                del self._fds[key]
                os.close(ent[0])

    def close(self) -> None:
        """Close every descriptor no read is using; the others close on their release."""
        with self._lock:
            self._closed = True
            for key, (fd, users) in list(self._fds.items()):
                if not users:
                    del self._fds[key]
                    os.close(fd)
