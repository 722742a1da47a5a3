"""A multi-process local tier's restore reader: each byte from the nearest live holder.

:class:`RestoreReader` is a read-only :class:`~quire._store.base.Backend` over one agreed
step (``quire._tiers.restore_plan.RestorePlan``).  The load engine reads the step through it
(``quire._store.url.mounted``: the step's local URL resolves to it for the load), unchanged:
every chunk is checked against the chunk index and its crc32c as in any load.  Each key goes
to its **owner**'s objects (``quire._tiers.ownership.owner_of``: a pack or index to its
process, an object of a per-process unit to its process, anything else to the primary), and
is read from

1. this process's own root, when it holds that owner's objects (its marker);
2. else a live peer holder, over the peer link (``link.fetch_into`` with a byte range:
   only the ranges the load asks for), the one with the fewest bytes in flight
   (``providers.Holder``, whose connections stay open for the load); a holder that fails
   or misses the deadline is treated as lost for the rest of the load and the next one is
   asked;
3. else the persistent tier, only when it holds the agreed step with the same commit
   record (checked once, on first use).

While a further source is left, what a source sent is checked before the load uses it
(``read_checks``): bytes that fail are logged and read again from the next source.  The
commit record is the agreed one, served from memory.  Sizes and listings (for unit
objects, which have no index) come from the holder's marker, or from the persistent tier.
Nothing is written: the writes raise ``PermissionError``.
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from quire._engine import commit as _commit
from quire._format.chunkindex import PACK_DIR
from quire._format.crc import ChunkError
from quire._store.base import Backend, Buffer, Capabilities
from quire._tiers import ownership
from quire._tiers.providers import (
    PEER_STREAMS,
    Holder,
    Provider,
    is_peer,
    is_persistent,
    local_provider,
    peer_provider,
    persistent_provider,
)
from quire._tiers.read_checks import ChunkChecks
from quire._tiers.restore_plan import record_digest
from quire.errors import CorruptCheckpointError, MultiProcessError, PeerError

__all__ = [
    "PEER_STREAMS",
    "Holder",
    "Provider",
    "RestoreReader",
    "agreed_record",
    "local_provider",
    "peer_provider",
    "persistent_provider",
    "read_record",
]

log = logging.getLogger("quire")

RECORD = "quire.json"


class RestoreReader(Backend):
    """Read-only view of one agreed step, each owner's objects from its sources in order.

    Parameters
    ----------
    url : str
        The step's URL in this process's local tier (what messages name).
    raw : bytes
        The agreed commit record.
    doc : dict
        It, parsed.
    primary : int
        The primary process (the owner of unit objects).
    sources : mapping of int to list of Provider
        Per owner, where to read its objects, nearest first.
    persistent_record : callable, optional
        Returns (awaitable) the persistent tier's record bytes for the step; a
        persistent source is used only when they equal ``raw``.
    """

    capabilities = Capabilities(readinto=True)

    def __init__(
        self,
        url: str,
        raw: bytes,
        doc: dict[str, Any],
        primary: int,
        sources: Mapping[int, builtins.list[Provider]],
        persistent_record: Any = None,
        keep_open: Any = None,
    ) -> None:
        super().__init__(url)
        self.raw, self.doc, self.primary = raw, doc, primary
        self.sources = {j: list(s) for j, s in sources.items()}
        self._txid = str(doc["txids"][0])
        self._lost: set[str] = set()
        self._persistent_record = persistent_record
        self._persistent_ok: asyncio.Future[bool] | None = None
        self._keep_open = keep_open
        self._bad: set[tuple[str, str]] = set()  # (source, key): its bytes failed a check
        self._indexes: dict[str, asyncio.Future[bytes]] = {}
        self.checks = ChunkChecks(doc, url, primary, self._index_of)
        self.retried = 0  # reads sent again to the next source after a failed check

    async def close(self) -> None:
        self.close_peers()

    def close_peers(self) -> None:
        """Close the connections kept open to peers."""
        for srcs in self.sources.values():
            for s in srcs:
                s.close()

    @contextmanager
    def keep_open(self) -> Iterator[None]:
        """The local backend's ``keep_open`` scope (each local pack opened once)."""
        if self._keep_open is None:
            yield
        else:
            with self._keep_open():
                yield

    # ---------------------------------------------------------------- routing
    def _owner(self, key: str) -> int | None:
        if not key.startswith(f"d/{self._txid}/"):
            return None
        return ownership.owner_of(key, self.primary, self.doc)

    async def _usable(self, src: Provider) -> bool:
        if src.name in self._lost:
            return False
        if is_persistent(src):
            if self._persistent_ok is None:
                self._persistent_ok = asyncio.ensure_future(self._check_persistent())
            return await asyncio.shield(self._persistent_ok)
        return True

    async def _check_persistent(self) -> bool:
        if self._persistent_record is None:
            return False
        try:
            same = await self._persistent_record() == self.raw
        except Exception as e:
            log.warning("%s: the persistent tier's record of this step: %s", self.url, e)
            return False
        if not same:
            log.warning("%s: the persistent tier holds another record of this step", self.url)
        return bool(same)

    def _order(self, j: int) -> builtins.list[Provider]:
        """Owner ``j``'s sources in the order to ask them: this root first, then the peer
        holders with the fewest bytes asked of them (ties in the order given: rotated per
        process and owner, so that processes spread over them), the persistent tier last."""
        srcs = self.sources[j]
        ranked = iter(sorted((s for s in srcs if is_peer(s)), key=lambda s: s.load()))
        return [next(ranked) if is_peer(s) else s for s in srcs]

    async def _route(self, key: str, op: Any, check: Any = None) -> Any:
        """``op(source)`` on the first usable source of ``key``'s owner; a peer that fails
        is lost for the rest of this load, and the next source is asked.  ``check(result)``
        (awaitable), when given, is run while a later source is left: bytes that fail it
        are read again from the next source (logged), and that source is not asked for
        ``key`` again."""
        j = self._owner(key)
        if j is None or j not in self.sources:
            raise FileNotFoundError(f"{self.url}/{key}: not an object of this step")
        errors = []
        order = self._order(j)
        damaged = False
        for i, src in enumerate(order):
            if (src.name, key) in self._bad or not await self._usable(src):
                continue
            try:
                got = await op(src)
            except MultiProcessError as e:  # a PeerError, or no address published in time
                if src.name not in self._lost:
                    self._lost.add(src.name)
                    log.warning(
                        "%s: reading process %d's objects from %s failed (%s); treated as "
                        "lost, the next holder is asked", self.url, j, src.name, e,
                    )  # fmt: skip
                errors.append(f"{src.name}: {e}")
                continue
            later = any(
                (s.name, key) not in self._bad and s.name not in self._lost for s in order[i + 1 :]
            )
            if check is None or not (later or damaged):
                return got
            try:
                await check(got)
            except (ChunkError, CorruptCheckpointError) as e:
                self._bad.add((src.name, key))
                self.retried += 1
                damaged = True
                log.warning(
                    "%s/%s: the bytes read from %s fail their check (%s); read again from "
                    "the next holder", self.url, key, src.name, e,
                )  # fmt: skip
                errors.append(f"{src.name}: {e}")
                continue
            return got
        if damaged:
            raise CorruptCheckpointError(
                f"{self.url}/{key}: every source of process {j}'s objects that answered sent "
                f"bytes that fail their check ({'; '.join(errors)}), and no other holds this "
                "step with this record: restore an older step, and wipe the damaged holders' "
                "directories"
            )
        raise PeerError(
            f"{self.url}/{key}: no holder of process {j}'s objects answered (each is treated "
            f"as lost), and the persistent tier does not hold this step with this record: "
            f"{'; '.join(errors) or 'no holder left'}"
        )

    async def _check(
        self, key: str, start: int, views: Sequence[memoryview], n: int, whole: bool
    ) -> None:
        """The check of bytes ``[start, start + n)`` of ``key`` read into ``views``."""
        owner = self.checks.index_owner(key)
        if owner is not None:
            if whole:
                self.checks.check_index(owner, b"".join(bytes(v) for v in views))
        elif f"/{PACK_DIR}/" in key:
            await self.checks.check_range(key, start, views, n)
        elif whole and ownership.is_unit_key(key, self.doc):
            self.checks.check_unit(key, b"".join(bytes(v) for v in views))

    async def _index_of(self, owner: int) -> bytes:
        entry = ownership.entry_of(self.doc, owner)
        assert entry is not None
        return await self.get(str(entry["object"]))

    def stats(self) -> dict[str, tuple[int, int]]:
        """Bytes and requests read so far from peers and the persistent tier, per source
        name (sources not read from are left out; this root's reads are not counted)."""
        out: dict[str, tuple[int, int]] = {}
        for srcs in self.sources.values():
            for s in srcs:
                if s.requests:
                    b, r = out.get(s.name, (0, 0))
                    out[s.name] = (b + s.bytes, r + s.requests)
        return out

    # ---------------------------------------------------------------- reads
    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        if key == RECORD:
            return self.raw[start:end]
        if start is None and end is None and self.checks.index_owner(key) is not None:
            if key not in self._indexes:  # read once: the load and the checks both need it
                self._indexes[key] = asyncio.ensure_future(self._get(key, None, None))
            return await asyncio.shield(self._indexes[key])
        return await self._get(key, start, end)

    async def _get(self, key: str, start: int | None, end: int | None) -> bytes:
        whole = not start and end is None

        async def check(data: bytes) -> None:
            await self._check(key, start or 0, [memoryview(data)], len(data), whole)

        return await self._route(key, lambda s: s.get(key, start, end), check)  # type: ignore[no-any-return]

    async def get_into(self, key: str, buffers: Sequence[memoryview], offset: int = 0) -> int:
        if key == RECORD:
            return await super().get_into(key, buffers, offset)

        async def check(n: int) -> None:
            await self._check(key, offset, buffers, n, False)

        return await self._route(key, lambda s: s.get_into(key, buffers, offset), check)  # type: ignore[no-any-return]

    async def _sizes(self, key: str) -> dict[str, int]:
        async def op(s: Provider) -> dict[str, int]:
            return await s.listing()

        return await self._route(key, op)  # type: ignore[no-any-return]

    async def size(self, key: str) -> int:
        if key == RECORD:
            return len(self.raw)
        got = (await self._sizes(key)).get(key)
        if got is None:
            raise FileNotFoundError(f"{self.url}/{key}")
        return got

    async def exists(self, key: str) -> bool:
        try:
            await self.size(key)
        except FileNotFoundError:
            return False
        return True

    async def version(self, key: str) -> str | None:
        if key == RECORD:
            return hashlib.sha256(self.raw).hexdigest()
        try:
            return f"size-{await self.size(key)}"
        except FileNotFoundError:
            return None

    async def list(self, prefix: str = "") -> builtins.list[str]:
        base = prefix.rstrip("/")
        d = f"d/{self._txid}"
        if base.startswith(f"{d}/") and not base.startswith(f"{d}/{PACK_DIR}"):
            owners = [self.primary]
        else:
            owners = sorted(self.sources)
        keys: set[str] = {RECORD}
        for j in owners:
            # a key routed to owner j lists j's objects
            probe = f"{d}/{PACK_DIR}/p{j:05d}.x" if j != self.primary else f"{d}/x"
            keys.update(await self._sizes(probe))
        return sorted(k for k in keys if not base or k == base or k.startswith(f"{base}/"))

    # ---------------------------------------------------------------- no writes
    def _refuse(self, key: str) -> PermissionError:
        return PermissionError(f"{self.url}/{key}: a restore reads this step; it writes nothing")

    async def put(self, key: str, data: Sequence[Buffer]) -> None:
        raise self._refuse(key)

    async def put_if_absent(self, key: str, data: bytes) -> str:
        raise self._refuse(key)

    async def replace_if_match(self, key: str, data: bytes, version: str) -> str:
        raise self._refuse(key)

    async def delete(self, keys: Sequence[str]) -> None:
        raise self._refuse(", ".join(keys))


async def read_record(backend: Backend, url: str) -> bytes:
    """The commit record's bytes at ``backend`` (checked as every record read is)."""
    return (await _commit.read(backend, url)).raw


async def agreed_record(
    holders: Mapping[int, Holder],
    me: int,
    backend: Backend,
    url: str,
    want: str,
    has_rec: builtins.list[int],
    rel: str,
) -> bytes:
    """The agreed record (digest ``want``) of step ``rel``: this root's, else a holder's
    over TCP, through ``holders[h]``'s connections (the next holder when one fails,
    published no address or a malformed one, or sends another record)."""
    if me in has_rec:
        return await read_record(backend, url)
    start = me % len(has_rec)
    errors = []
    for h in has_rec[start:] + has_rec[:start]:
        try:
            got = await holders[h].record(rel)
        except MultiProcessError as e:  # a PeerError, or no address published in time
            log.warning("%s: the commit record from process %d: %s", url, h, e)
            errors.append(f"process {h}: {e}")
            continue
        if record_digest(got) == want:
            return got
        errors.append(f"process {h}: not the agreed record")
    raise PeerError(
        f"{url}: restoring this step: no holder of its commit record answered (each is "
        f"treated as lost): {'; '.join(errors)}"
    )
