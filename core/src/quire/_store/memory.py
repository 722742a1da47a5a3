"""In-process ``memory://`` backend on fsspec's MemoryFileSystem.

Checkpoints live in fsspec's process-wide memory store, so a ``memory://`` URL saved
by quire is visible to other fsspec users in the same process.  Conditional operations
are made atomic with a lock (the equivalent of O_EXCL for a dict).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

from fsspec.implementations.memory import MemoryFileSystem

from quire._store.base import Backend, Buffer, Capabilities, PreconditionFailed

_lock = threading.RLock()
_generation = itertools.count(1)
_versions: dict[str, str] = {}


class MemoryBackend(Backend):
    """Checkpoints in process memory; ``memory://name`` URLs."""

    capabilities = Capabilities(atomic_create=True, atomic_replace=True, durable=False)

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(url, storage_options)
        self.fs = MemoryFileSystem()
        self.root = "/" + url.split("://", 1)[-1].strip("/")

    def _p(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        try:
            data = self.fs.store[self._p(key)].getvalue()
        except KeyError:
            raise FileNotFoundError(f"memory://{self._p(key)}") from None
        return bytes(data[start:end]) if (start or end is not None) else bytes(data)

    async def size(self, key: str) -> int:
        try:
            return int(self.fs.store[self._p(key)].size)
        except KeyError:
            raise FileNotFoundError(f"memory://{self._p(key)}") from None

    async def exists(self, key: str) -> bool:
        return self._p(key) in self.fs.store

    async def modified(self, key: str) -> float | None:
        try:
            f = self.fs.store[self._p(key)]
        except KeyError:
            raise FileNotFoundError(f"memory://{self._p(key)}") from None
        when = getattr(f, "modified", None)
        return when.timestamp() if when is not None else None

    async def version(self, key: str) -> str | None:
        with _lock:
            p = self._p(key)
            if p not in self.fs.store:
                return None
            return _versions.setdefault(p, str(next(_generation)))

    async def list(self, prefix: str = "") -> list[str]:
        base = self._p(prefix.rstrip("/"))
        n = len(self.root) + 1
        with _lock:
            keys = [p for p in self.fs.store if p == base or p.startswith(base.rstrip("/") + "/")]
        return sorted(p[n:] for p in keys)

    def _write(self, key: str, data: bytes) -> str:
        p = self._p(key)
        self.fs.pipe_file(p, data)
        v = str(next(_generation))
        _versions[p] = v
        return v

    async def put(self, key: str, data: Sequence[Buffer]) -> None:
        blob = b"".join(bytes(memoryview(d).cast("B")) for d in data)
        with _lock:
            self._write(key, blob)

    async def put_if_absent(self, key: str, data: bytes) -> str:
        with _lock:
            if self._p(key) in self.fs.store:
                raise PreconditionFailed(f"memory://{self._p(key)} exists")
            return self._write(key, data)

    async def replace_if_match(self, key: str, data: bytes, version: str) -> str:
        with _lock:
            if await self.version(key) != version:
                raise PreconditionFailed(f"memory://{self._p(key)} changed or vanished")
            return self._write(key, data)

    async def delete(self, keys: Sequence[str]) -> None:
        with _lock:
            for k in keys:
                p = self._p(k)
                self.fs.store.pop(p, None)
                _versions.pop(p, None)


def forget(url: str) -> None:
    """Remove everything under a ``memory://`` URL from the process-wide store (tests'
    clean-up: the store outlives every backend instance)."""
    root = "/" + url.split("://", 1)[-1].strip("/")
    store = MemoryFileSystem.store
    with _lock:
        for k in [k for k in store if k == root or k.startswith(root + "/")]:
            store.pop(k, None)
            _versions.pop(k, None)
