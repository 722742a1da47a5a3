"""``quire cp`` of format-v2 data: index objects and packs are copied as objects, and each is
verified as it is read: an index against the commit record (size, crc32c), a pack chunk by
chunk against its index (``quire._format.chunkcheck.check_stored``: the CRC-32 bound to the key, or
for a trailer-bound chunk the crc32c of its message against its trailer and the index) and
the chunk's own codec chain."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from quire._format.chunkcheck import check_stored
from quire._format.chunkid import Ref
from quire._format.chunkindex import ChunkError, parse_index
from quire._format.paths import is_chunk_of, location_of
from quire._store.base import Backend
from quire.errors import CorruptCheckpointError


def _index_check(
    entry: Mapping[str, Any], url: str, txids: Collection[str]
) -> Callable[[bytes], None]:
    def check(data: bytes) -> None:
        parse_index(data, entry, url, txids)

    return check


def _pack_check(
    refs: list[tuple[str, Ref]], checkers: Mapping[str, Callable[[bytes], None]]
) -> Callable[[bytes], None]:
    def check(data: bytes) -> None:
        mv = memoryview(data)
        for key, ref in refs:
            off, n = ref.offset, ref.length
            if off + n > len(mv):
                raise ValueError(f"{key}: the pack is truncated")
            part = mv[off : off + n]
            check_stored(ref, key, part)  # a ChunkError (ValueError) names the key
            loc = location_of(key)
            if loc in checkers and is_chunk_of(key, loc):
                checkers[loc](bytes(part))

    return check


async def plan_packed(
    backend: Backend,
    url: str,
    entries: Sequence[Mapping[str, Any]],
    checkers: Mapping[str, Callable[[bytes], None]],
    item: Callable[..., Any],
    is_chunk: Callable[[str], bool],
    txids: Collection[str],
) -> list[Any]:
    """``_copy._Item`` s for every index object and pack the record's indexes name."""
    items = []
    # A pack may be named by several indexes (a finalize that rewrote packs points its new
    # index at kept packs of older versions): each pack is copied once, checked for all.
    by_pack: dict[str, list[tuple[str, Ref]]] = {}
    owner: dict[str, int] = {}
    for e in entries:
        try:
            refs = parse_index(await backend.get(e["object"]), e, url, txids)
        except (FileNotFoundError, ChunkError) as err:
            raise CorruptCheckpointError(
                f"{url}: chunk index {e['object']}: {err or 'missing'}; the checkpoint is "
                "damaged (run `quire verify`); nothing was committed at the destination"
            ) from err
        items.append(
            item(
                e["object"],
                f"chunk index of process {e['process']}",
                _index_check(e, url, txids),
                e["size"],
            )
        )
        for key, ref in refs.items():
            if ref.target is not None:
                by_pack.setdefault(ref.target, []).append((key, ref))
                owner.setdefault(ref.target, e["process"])
    for pack, rs in sorted(by_pack.items()):
        size = max(r.offset + r.length for _, r in rs)
        n = sum(is_chunk(key) for key, _ in rs)
        items.append(
            item(pack, f"pack of process {owner[pack]}", _pack_check(rs, checkers), size, n)
        )
    return items
