"""Fallback backend for any fsspec protocol quire has no dedicated backend for.

It declares ``atomic_create=False``: its "conditional create" is an existence check
followed by a write, which two concurrent writers can both pass.  quire warns when it
commits through it; install a dedicated backend for a real atomic commit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import fsspec

from quire._runtime.ioloop import run_blocking
from quire._store.base import Backend, Buffer, Capabilities, PreconditionFailed


class FsspecBackend(Backend):
    """Any fsspec file system, through its synchronous API in quire's I/O pool."""

    capabilities = Capabilities(atomic_create=False, atomic_replace=False)

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(url, storage_options)
        self.fs, self.root = fsspec.core.url_to_fs(url, **self.storage_options)
        self.root = self.root.rstrip("/")

    def _p(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return await run_blocking(self.fs.cat_file, self._p(key), start=start, end=end)

    async def size(self, key: str) -> int:
        return int((await run_blocking(self.fs.info, self._p(key)))["size"])

    async def exists(self, key: str) -> bool:
        return bool(await run_blocking(self.fs.exists, self._p(key)))

    async def version(self, key: str) -> str | None:
        try:
            info = await run_blocking(self.fs.info, self._p(key))
        except FileNotFoundError:
            return None
        for k in ("ETag", "etag", "generation", "mtime", "created"):
            if info.get(k) is not None:
                return f"{info[k]}-{info.get('size')}"
        return str(info.get("size"))

    async def list(self, prefix: str = "") -> list[str]:
        base = self._p(prefix.rstrip("/"))
        try:
            found = await run_blocking(self.fs.find, base)
        except FileNotFoundError:
            return []
        n = len(self.root) + 1
        return sorted(p[n:] for p in found)

    async def put(self, key: str, data: Sequence[Buffer]) -> None:
        blob = b"".join(bytes(memoryview(d).cast("B")) for d in data)
        await run_blocking(self.fs.pipe_file, self._p(key), blob)

    async def put_if_absent(self, key: str, data: bytes) -> str:
        if await self.exists(key):
            raise PreconditionFailed(f"{self._p(key)} exists")
        await self.put(key, [data])
        return await self.version(key) or ""

    async def replace_if_match(self, key: str, data: bytes, version: str) -> str:
        if await self.version(key) != version:
            raise PreconditionFailed(f"{self._p(key)} changed or vanished")
        await self.put(key, [data])
        return await self.version(key) or ""

    async def delete(self, keys: Sequence[str]) -> None:
        for k in keys:
            with contextlib.suppress(FileNotFoundError):
                await run_blocking(self.fs.rm_file, self._p(k))
