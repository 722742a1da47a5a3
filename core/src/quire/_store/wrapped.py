"""A Backend that forwards every call to the backend it wraps.

Format v2's pack writer and packed read view each change a few calls (writes of chunk
keys, reads of indexed keys) and pass the rest through unchanged: they subclass this.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence

from quire._store.base import Backend, Buffer


class Wrapped(Backend):
    """``base``'s URL, options and capabilities; every call delegated to ``base``."""

    def __init__(self, base: Backend) -> None:
        super().__init__(base.url, base.storage_options)
        self.base = base
        self.capabilities = base.capabilities  # type: ignore[misc]

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return await self.base.get(key, start, end)

    async def size(self, key: str) -> int:
        return await self.base.size(key)

    async def exists(self, key: str) -> bool:
        return await self.base.exists(key)

    async def modified(self, key: str) -> float | None:
        return await self.base.modified(key)

    async def version(self, key: str) -> str | None:
        return await self.base.version(key)

    async def list(self, prefix: str = "") -> builtins.list[str]:
        return await self.base.list(prefix)

    async def list_dir(self, prefix: str = "") -> tuple[builtins.list[str], builtins.list[str]]:
        return await self.base.list_dir(prefix)

    async def put(self, key: str, data: Sequence[Buffer]) -> None:
        await self.base.put(key, data)

    async def put_if_absent(self, key: str, data: bytes) -> str:
        return await self.base.put_if_absent(key, data)

    async def replace_if_match(self, key: str, data: bytes, version: str) -> str:
        return await self.base.replace_if_match(key, data, version)

    async def delete(self, keys: Sequence[str]) -> None:
        await self.base.delete(keys)

    async def delete_prefix(self, prefix: str) -> None:
        await self.base.delete_prefix(prefix)

    async def sync(self) -> None:
        await self.base.sync()
