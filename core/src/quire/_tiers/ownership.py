"""A multi-process local tier step, object by object: who owns what, who holds it, copies.

A step saved by N processes into their own roots (``quire._tiers.spread_save``) has one
commit record (the same bytes in every root) and one **object set per owner process**:

* process ``j``'s chunk index ``d/<txid>/%packs/p<j>.index.json`` (when it wrote chunks) and
  the packs that index points into (``p<j>-<seq>``);
* its objects of the per-process checkpointable units, under ``<location>/p<j>/``;
* for the primary, also every object under the locations of the whole checkpointable units
  (only the primary writes those).

A root **holds** owner ``j``'s set when it has a marker ``d/<txid>/%tier/p<j>.json`` naming
every object of the set with its size, and every named object has that size.  The marker
is written last, after the objects were checked and synced: the owner's own objects once
its local commit is done; a peer's or the persistent tier's copy once every object of it
passed its check (:func:`check_objects`):

* the index against the commit record's entry (size, crc32c),
* every pack chunk by chunk against that index (the CRC-32 bound to the key, or the crc32c
  trailer) and the chunk's own codec chain,
* every unit object against its crc32c trailer,
* and the names: exactly the owner's set, nothing else (a name outside the set - ``..``,
  another txid, another process's pack - is refused before anything is written).

``%tier`` cannot be produced by key escaping (a ``%`` is always followed by two hex digits),
and the markers live under the txid, so they go with the step's data.  ``quire cp`` and
promotion copy what the record references, never the markers.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from quire._engine import commit as _commit
from quire._engine.copying import _check_unit_object, _copy_objects, _Item
from quire._engine.packcopy import _index_check, _pack_check
from quire._format.chunkid import Ref
from quire._format.chunkindex import PACK_DIR, ChunkError, parse_index
from quire._format.paths import is_safe_location
from quire._format.record import process_dir
from quire._format.tree import from_json
from quire._format.untrusted import untrusted_json
from quire._handlers.arrays import layout_from_record
from quire._handlers.zarr_io import chunk_checker
from quire._runtime.multihost import Coordinator
from quire._store.base import Backend
from quire._store.url import open_backend
from quire.errors import CorruptCheckpointError

__all__ = [
    "MAX_OBJECT_BYTES",
    "TIER_DIR",
    "check_objects",
    "decode",
    "encode",
    "entry_of",
    "fetch_owner",
    "holds",
    "is_safe_key",
    "is_size",
    "is_unit_key",
    "mark_own",
    "marked",
    "marker_key",
    "owned_sizes",
    "owned_unit_locations",
    "owner_of",
    "owners",
    "owns_unit_key",
    "pack_extents",
    "parse_marker",
    "promote_spread",
    "read_owned",
    "receive",
    "refused",
    "unit_locations",
]

log = logging.getLogger("quire")

TIER_DIR = "%tier"
_HEADER = 8


# ----------------------------------------------------------------------------- who owns what
def owner_of(key: str, primary: int, doc: Mapping[str, Any] | None = None) -> int:
    """The process whose part of a step ``key`` is: a pack's or index's own process, with
    ``doc`` an object's of a per-process unit its process, else the primary (whole units)."""
    parts = key.split("/")
    name = parts[-1]
    if len(parts) == 4 and parts[2] == PACK_DIR and name[:1] == "p" and name[1:6].isdigit():
        return int(name[1:6])
    for u in _per_process_units(doc or {}):
        head, sep, _ = key.removeprefix(f"{u['location']}/").partition("/")
        j = int(head[1:]) if sep and head[:1] == "p" and head[1:].isdigit() else -1
        if 0 <= j < int(u["processes"]) and head == process_dir(j):
            return j
    return primary


def _per_process_units(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    units = doc.get("units") or {}
    return [u for u in units.values() if u.get("kind") == "handler" and "processes" in u]


def owners(doc: Mapping[str, Any], primary: int) -> list[int]:
    """Every process that owns objects of the step: those with a chunk index, those of a
    per-process unit, the primary."""
    out = {int(e["process"]) for e in doc.get("indexes") or []} | {primary}
    for u in _per_process_units(doc):
        out.update(range(int(u["processes"])))
    return sorted(out)


def entry_of(doc: Mapping[str, Any], owner: int) -> dict[str, Any] | None:
    for e in doc.get("indexes") or []:
        if int(e["process"]) == owner:
            return dict(e)
    return None


def unit_locations(doc: Mapping[str, Any]) -> list[str]:
    return [u["location"] for u in doc["units"].values() if u.get("kind") == "handler"]


def owned_unit_locations(doc: Mapping[str, Any], owner: int, primary: int) -> list[str]:
    """Where ``owner``'s objects of checkpointable units lie: its folder of each per-process
    unit, and for the primary the location of each whole unit."""
    out = []
    for u in doc["units"].values():
        if u.get("kind") != "handler":
            continue
        if "processes" in u:
            if owner < int(u["processes"]):
                out.append(f"{u['location']}/{process_dir(owner)}")
        elif owner == primary:
            out.append(u["location"])
    return out


def owns_unit_key(key: str, doc: Mapping[str, Any], owner: int, primary: int) -> bool:
    """Whether ``key`` is an object of a checkpointable unit that ``owner`` owns."""
    locs = owned_unit_locations(doc, owner, primary)
    return is_safe_location(key) and any(key.startswith(f"{loc}/") for loc in locs)


def _checkers(doc: Mapping[str, Any], url: str) -> dict[str, Callable[[bytes], None]]:
    """Each packed array leaf's chunk check (its codec chain), by location."""
    out: dict[str, Callable[[bytes], None]] = {}
    for unit in doc["units"].values():
        if unit.get("kind") != "pytree":
            continue
        for leaf in from_json(unit["tree"]).leaves():
            rec, loc = leaf.value, leaf.value.get("location")
            if "chunk_shape" in rec and isinstance(loc, str):
                out[loc] = chunk_checker(layout_from_record(rec, url))
    return out


def is_unit_key(key: str, doc: Mapping[str, Any]) -> bool:
    """Whether ``key`` lies under one of the step's checkpointable-unit locations."""
    return is_safe_location(key) and any(key.startswith(f"{loc}/") for loc in unit_locations(doc))


def pack_extents(
    doc: Mapping[str, Any], url: str, owner: int, index: bytes, sender: str
) -> dict[str, int]:
    """The packs ``owner``'s chunk index ``index`` points into, with the bytes each must
    have at least (the end of its last range); the index is checked against the record."""
    entry = entry_of(doc, owner)
    assert entry is not None
    try:
        refs = parse_index(index, entry, url, doc["txids"])
    except (ChunkError, CorruptCheckpointError) as e:
        raise refused(url, sender, owner, f"its chunk index fails its check ({e})") from e
    out: dict[str, int] = {}
    for ref in refs.values():
        if ref.target is not None:
            out[ref.target] = max(out.get(ref.target, 0), ref.offset + ref.length)
    return out


def is_safe_key(key: str, doc: Mapping[str, Any]) -> bool:
    """Whether ``key`` may name an object of the step ``doc`` describes (under its txid)."""
    return is_safe_location(key) and key.startswith(f"d/{_txid(doc)}/")


def marker_key(txid: str, owner: int) -> str:
    return f"d/{txid}/{TIER_DIR}/p{owner:05d}.json"


def _txid(doc: Mapping[str, Any]) -> str:
    (txid,) = doc["txids"]  # a local tier save has exactly one
    return str(txid)


def refused(url: str, sender: str, owner: int, why: str) -> CorruptCheckpointError:
    msg = (
        f"{url}: refused the copy of process {owner}'s objects from {sender}: {why}; nothing "
        "of it was written (the step keeps its other holders)"
    )
    log.warning("%s", msg)
    return CorruptCheckpointError(msg)


# ----------------------------------------------------------------------------- checking
def check_objects(
    doc: Mapping[str, Any],
    url: str,
    owner: int,
    primary: int,
    objects: Mapping[str, bytes],
    sender: str,
) -> None:
    """Raise ``CorruptCheckpointError`` (logged) unless ``objects`` are exactly ``owner``'s
    set of the step ``doc`` describes, each verified (see the module docstring)."""
    txids = doc["txids"]
    allowed: dict[str, Callable[[bytes], None]] = {}
    entry = entry_of(doc, owner)
    if entry is not None:
        data = objects.get(entry["object"])
        if data is None:
            raise refused(url, sender, owner, f"its chunk index {entry['object']} is missing")
        try:
            refs = parse_index(data, entry, url, txids)
        except (ChunkError, CorruptCheckpointError) as e:
            raise refused(url, sender, owner, f"its chunk index fails its check ({e})") from e
        allowed[entry["object"]] = _index_check(entry, url, txids)
        by_pack: dict[str, list[tuple[str, Ref]]] = {}
        for key, ref in refs.items():
            if ref.target is not None:
                by_pack.setdefault(ref.target, []).append((key, ref))
        checkers = _checkers(doc, url)
        for pack, rs in by_pack.items():
            if owner_of(pack, primary) != owner:
                raise refused(url, sender, owner, f"its index points at {pack}, not its own")
            if pack not in objects:
                raise refused(url, sender, owner, f"pack {pack} is missing")
            allowed[pack] = _pack_check(rs, checkers)
    for key in objects:
        if key in allowed:
            continue
        if not owns_unit_key(key, doc, owner, primary):
            raise refused(url, sender, owner, f"{key!r} is not an object of its part of the step")
        allowed[key] = _check_unit_object
    for key, data in objects.items():
        try:
            allowed[key](data)
        except Exception as e:
            raise refused(url, sender, owner, f"{key} fails its check ({e})") from e


# ----------------------------------------------------------------------------- markers
async def _write_marker(backend: Backend, txid: str, owner: int, sizes: Mapping[str, int]) -> None:
    body = json.dumps({"owner": owner, "objects": dict(sorted(sizes.items()))}).encode()
    await backend.put(marker_key(txid, owner), [body])
    await backend.sync()


#: The largest size a marker may give (requests carry sizes, and a pull's sum, as u64).
MAX_OBJECT_BYTES = 2**63 - 1


def is_size(n: object) -> bool:
    """Whether ``n`` (from a marker) is an int from 0 to :data:`MAX_OBJECT_BYTES`."""
    return type(n) is int and 0 <= n <= MAX_OBJECT_BYTES


def parse_marker(raw: bytes, doc: Mapping[str, Any], owner: int) -> dict[str, int] | None:
    """The objects a marker for ``owner`` names with their sizes, or None (malformed,
    naming an object outside the step's txid, or a size no object has: :func:`is_size`)."""
    try:
        got = untrusted_json(raw)
        objs = got["objects"]
        ok = got["owner"] == owner and isinstance(objs, dict)
        ok = ok and all(
            isinstance(k, str) and is_safe_key(k, doc) and is_size(n) for k, n in objs.items()
        )
    except (ValueError, KeyError, TypeError):
        return None
    return {str(k): int(n) for k, n in objs.items()} if ok else None


async def marked(backend: Backend, doc: Mapping[str, Any], owner: int) -> dict[str, int] | None:
    """The objects a root's marker for ``owner`` names, or None (no marker, or damaged)."""
    try:
        raw = await backend.get(marker_key(_txid(doc), owner))
    except FileNotFoundError:
        return None
    return parse_marker(raw, doc, owner)


_marked = marked


async def owned_sizes(
    backend: Backend, url: str, doc: Mapping[str, Any], owner: int, primary: int
) -> dict[str, int]:
    """``owner``'s set of the step at ``backend`` (a root without markers: the persistent
    tier), each object with its size."""
    keys = await _own_keys(backend, url, doc, owner, primary)
    sizes = await asyncio.gather(*(backend.size(k) for k in keys))
    return dict(zip(keys, sizes))


async def holds(backend: Backend, doc: Mapping[str, Any], owner: int) -> bool:
    """Whether this root holds ``owner``'s whole set (marker, and every object's size)."""
    objs = await _marked(backend, doc, owner)
    if objs is None:
        return False

    async def one(key: str, n: int) -> bool:
        try:
            return await backend.size(key) == n
        except FileNotFoundError:
            return False

    return all(await asyncio.gather(*(one(k, n) for k, n in objs.items())))


async def _own_keys(
    backend: Backend,
    url: str,
    doc: Mapping[str, Any],
    owner: int,
    primary: int,
    read: dict[str, bytes] | None = None,
) -> list[str]:
    """``owner``'s set, from its index at ``backend`` (kept in ``read``) and a listing of
    its unit locations."""
    keys: list[str] = []
    entry = entry_of(doc, owner)
    if entry is not None:
        data = await backend.get(entry["object"])
        if read is not None:
            read[entry["object"]] = data
        refs = parse_index(data, entry, url, doc["txids"])
        keys.append(entry["object"])
        keys += sorted({r.target for r in refs.values() if r.target is not None})
    locs = owned_unit_locations(doc, owner, primary)
    found = await asyncio.gather(*(backend.list(loc) for loc in locs))
    keys += [k for ks in found for k in ks]
    return keys


async def mark_own(
    backend: Backend, url: str, doc: Mapping[str, Any], me: int, primary: int
) -> None:
    """After this process's local commit: mark its own objects as held here."""
    keys = await _own_keys(backend, url, doc, me, primary)
    sizes = await asyncio.gather(*(backend.size(k) for k in keys))
    await _write_marker(backend, _txid(doc), me, dict(zip(keys, sizes)))


# ----------------------------------------------------------------------------- payloads
def encode(objects: Sequence[tuple[str, bytes]]) -> bytes:
    """One owner's objects as one payload: a JSON header of (name, size), then the bytes."""
    header = json.dumps([[k, len(d)] for k, d in objects]).encode()
    return b"".join([len(header).to_bytes(_HEADER, "little"), header, *(d for _, d in objects)])


def decode(payload: bytes | memoryview, url: str, sender: str, owner: int) -> dict[str, bytes]:
    """The objects of a payload; ``CorruptCheckpointError`` (logged) when malformed."""
    mv = memoryview(payload).cast("B")
    try:
        n = int.from_bytes(mv[:_HEADER], "little")
        if len(mv) < _HEADER or n > len(mv) - _HEADER:
            raise ValueError("truncated header")
        entries = untrusted_json(bytes(mv[_HEADER : _HEADER + n]))
        if not isinstance(entries, list):
            raise ValueError("header is not a list")
        out: dict[str, bytes] = {}
        pos = _HEADER + n
        for item in entries:
            key, size = item
            if not isinstance(key, str) or isinstance(size, bool) or not isinstance(size, int):
                raise ValueError(f"bad entry {item!r}")
            if not is_safe_location(key):
                raise ValueError(f"unsafe object name {key!r}")
            if key in out or size < 0 or pos + size > len(mv):
                raise ValueError(f"{key!r}: duplicate, or truncated payload")
            out[key] = bytes(mv[pos : pos + size])
            pos += size
        if pos != len(mv):
            raise ValueError(f"{len(mv) - pos} bytes after the last object")
    except (ValueError, TypeError) as e:
        raise refused(url, sender, owner, f"malformed payload ({e})") from e
    return out


async def read_owned(
    backend: Backend, doc: Mapping[str, Any], owner: int
) -> list[tuple[str, bytes]]:
    """The objects of ``owner``'s set this root holds (by its marker), to send."""
    objs = await _marked(backend, doc, owner)
    if objs is None:
        raise FileNotFoundError(f"no marker for process {owner}'s objects")
    keys = sorted(objs)
    datas = await asyncio.gather(*(backend.get(k) for k in keys))
    return list(zip(keys, datas))


async def receive(
    backend: Backend,
    url: str,
    doc: Mapping[str, Any],
    owner: int,
    primary: int,
    objects: Mapping[str, bytes],
    sender: str,
) -> None:
    """Check ``objects`` (``owner``'s set), write them into this root, sync, then mark."""
    check_objects(doc, url, owner, primary, objects, sender)
    for key, data in objects.items():
        await backend.put(key, [data])
    await backend.sync()
    await _write_marker(backend, _txid(doc), owner, {k: len(d) for k, d in objects.items()})


async def fetch_owner(
    src: Backend,
    src_url: str,
    dst: Backend,
    dst_url: str,
    doc: Mapping[str, Any],
    owner: int,
    primary: int,
) -> int:
    """Copy ``owner``'s set of the step from ``src`` (the persistent tier's copy of the same
    record) into ``dst``, checked; returns the bytes read."""
    read: dict[str, bytes] = {}
    keys = await _own_keys(src, src_url, doc, owner, primary, read)
    rest = [k for k in keys if k not in read]
    read.update(zip(rest, await asyncio.gather(*(src.get(k) for k in rest))))
    datas = [read[k] for k in keys]
    await receive(
        dst, dst_url, doc, owner, primary, dict(zip(keys, datas)), f"the persistent tier {src_url}"
    )
    return sum(map(len, datas))


# ----------------------------------------------------------------------------- promotion
async def promote_spread(
    src: str,
    dst: str,
    coord: Coordinator,
    *,
    overwrite: bool,
    src_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
) -> None:
    """Promotion of a multi-process local step: every process copies its own objects from
    its root ``src`` to the shared ``dst`` (each checked on the way), syncs; then, once all
    succeeded, the primary creates ``dst``'s ``quire.json`` (the very same record) with the
    commit protocol's conditional create: the persistent commit."""
    sb, db = open_backend(src, src_options), open_backend(dst, dst_options)
    try:
        record = await _commit.read(sb, src)
        doc = record.doc
        keys = await _own_keys(sb, src, doc, coord.index, coord.primary)
        entry = entry_of(doc, coord.index)
        checks: dict[str, Callable[[bytes], None]] = {}
        if entry is not None:
            refs = parse_index(await sb.get(entry["object"]), entry, src, doc["txids"])
            checks[entry["object"]] = _index_check(entry, src, doc["txids"])
            by_pack: dict[str, list[tuple[str, Ref]]] = {}
            for key, ref in refs.items():
                if ref.target is not None:
                    by_pack.setdefault(ref.target, []).append((key, ref))
            checkers = _checkers(doc, src)
            checks.update({p: _pack_check(rs, checkers) for p, rs in by_pack.items()})
        who = f"process {coord.index}'s part"
        items = [_Item(k, who, checks.get(k, _check_unit_object)) for k in keys]

        async def work() -> None:
            if not overwrite:
                await _commit.ensure_absent(db, dst, "pass force=True to replace it")
            await _copy_objects(sb, db, src, items, None)
            await db.sync()

        async def commit(_: None) -> None:
            # every process's index is in this root too (spread_save), and each was
            # checked against the record as it was copied: the check reads them here
            await _commit.publish(
                db, dst, record.raw, record.txids, overwrite=overwrite, coord=coord,
                indexes_from=sb,
            )  # fmt: skip

        async def cleanup() -> None:
            kept = await _commit._txids_at(db, dst)
            await _commit.drop_txids(db, dst, sorted(record.txids - kept))

        await _commit.collective(coord, dst, work, commit, cleanup, lambda _: {})
    finally:
        await sb.close()
        await db.close()
