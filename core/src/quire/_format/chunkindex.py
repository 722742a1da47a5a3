"""Format version 2: the chunk index and the backend view that reads chunks out of packs.

Each process that saves writes, next to its pack objects, one **chunk index** object
``d/<txid>/%packs/p<process>.index.json`` in fsspec's reference-filesystem form::

    {"version": 1,
     "refs": {"<zarr key>": ["d/<txid>/%packs/p<process>-<seq>", offset, length]
                            | "<inline UTF-8 text>"},
     "quire": {"format": 3, "txid": "<txid>", "process": <int>,
               "crc32": {"<zarr key>": "<8 hex digits>"},
               "crc32c": {"<zarr key>": "<8 hex digits>"},
               "shards": {"<zarr shard key>": "<8 hex digits x (1 + inner chunks)>"}}}

Zarr keys are relative to the checkpoint root (``d/<txid>/pytree/params/w/c/0/1``,
``.../zarr.json``); targets are relative too, so a copied checkpoint needs no rewrite and
``fsspec.filesystem("reference", fo=index, remote_protocol="dir",
remote_options={"path": <checkpoint root>, ...})`` serves it to zarr with no quire code.

Every key is in exactly one of two maps that bind it to its stored bytes, in an index
whose size and crc32c are in the commit record (``quire._format.chunkid``): ``quire.crc32c`` holds
the crc32c trailer of a chunk whose codec chain ends with ``crc32c`` (compared with the
chunk's last 4 bytes; the decoder's crc32c check binds the rest, so identity costs no
pass of its own), ``quire.crc32`` the CRC-32 (zlib's polynomial) of the exact bytes of
every other key (zarr shards, chunks without a crc32c, ``zarr.json``).  A chunk swapped
with another (of the same array or of another array), moved to another offset, or copied
in from another checkpoint fails it.  Index format 2 has ``quire.crc32`` only (what quire
wrote before the trailer binding; still read); format 3 adds ``quire.crc32c`` and is
written when some key is trailer-bound (an older quire refuses it as an unknown index
version).  ``quire.shards`` (any format; older quire ignores it) also binds each zarr shard
by its shard index's and inner chunks' crc32c trailers, which :class:`~quire._format.packedreader.PackedReader` checks
on the range reads a load makes of a shard.

The commit record names the index objects (``"indexes"``: txid, process, object, size,
crc32c), never the chunks: a loader reads the index of its own process first and the
others only for chunks it did not find there.
"""

from __future__ import annotations

import asyncio
import builtins
import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from quire._format.borrow import check_borrowed
from quire._format.bounds import MAX_INDEX_BYTES, MAX_OBJECT_BYTES
from quire._format.chunkcheck import raise_not_data
from quire._format.chunkid import FORMATS, TRAILER_FORMAT, Ref, crc_hex
from quire._format.crc import ChunkError, crc32c
from quire._format.paths import is_safe_location
from quire._format.shardid import valid_shard_binding
from quire._store.base import Backend
from quire.errors import CorruptCheckpointError

PACK_DIR = "%packs"  # never produced by key escaping ('%' is always followed by two hex digits)


def pack_dir(txid: str) -> str:
    return f"d/{txid}/{PACK_DIR}"


def pack_key(txid: str, process: int, seq: int) -> str:
    return f"{pack_dir(txid)}/p{process:05d}-{seq:05d}"


def is_pack_key(key: object) -> bool:
    """Whether ``key`` names a pack object ``d/<txid>/%packs/<name>``.  An index usually
    points at packs of its own txid only; one written by a finalize that rewrote packs
    also points at kept packs of the older versions (see ``quire._engine.packrewrite``)."""
    if not isinstance(key, str) or not is_safe_location(key):
        return False
    parts = key.split("/")
    return len(parts) == 4 and parts[2] == PACK_DIR and parts[1].isalnum()


def target_allowed(
    target: object, txids: Collection[str] | None, borrowed: Collection[str] = ()
) -> bool:
    """Whether a chunk index may point a key at ``target``: **the one place that rule
    lives** (every reader parses indexes through :func:`parse_index`, which asks it).

    A ref resolves to a pack object inside the checkpoint (``d/<txid>/%packs/<name>``,
    :func:`is_pack_key`) of a txid the commit record lists (``txids``; for a partial-save
    journal, the txids of its versions' indexes).  Data of a txid the record does not list
    is garbage to ``quire gc``, and may be another checkpoint's: a ref into it is damage,
    however well its binding matches.  ``txids=None`` (a writer re-reading indexes it
    checked already) checks the form only.

    The one exception is a **borrowed** pack of an incremental Checkpointer root: a target
    ``../<step>/d/<txid>/%packs/<name>`` (:func:`quire._format.borrow.is_borrowed_target`)
    that this index's record entry declares in ``borrowed`` (``borrowed``).  The declaring
    record is what makes that pack live for the root's mark-and-sweep gc (docs/format.md,
    "Borrowed bytes"); an undeclared one is refused like any other ref out of the record."""
    if isinstance(target, str) and target in borrowed:
        return True
    if not is_pack_key(target):
        return False
    assert isinstance(target, str)
    return txids is None or target.split("/")[1] in txids


def index_key(txid: str, process: int) -> str:
    return f"{pack_dir(txid)}/p{process:05d}.index.json"


def index_entry(
    txid: str, process: int, key: str, data: bytes, borrowed: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """The commit record's description of one index object; ``borrowed`` (an incremental
    step: ``quire._format.borrow``) the packs of earlier steps it points into, with the
    bytes it borrows from each (None: read from ``data``)."""
    if borrowed is None and b'"borrowed"' in data:
        try:
            borrowed = json.loads(data)["quire"].get("borrowed")
        except (ValueError, KeyError, TypeError):
            borrowed = None
    out: dict[str, Any] = {
        "txid": txid,
        "process": process,
        "object": key,
        "size": len(data),
        "crc32c": crc_hex(crc32c(data)),
    }
    if borrowed:
        out["borrowed"] = dict(sorted(borrowed.items()))
    return out


def check_entries(entries: Any, url: str) -> list[dict[str, Any]]:
    """Validate a record's ``indexes`` list; ``CorruptCheckpointError`` naming the defect."""
    if not isinstance(entries, list):
        raise CorruptCheckpointError(
            f"{url}/quire.json: 'indexes' is not a list; the commit record is damaged"
        )
    for e in entries:
        ok = (
            isinstance(e, dict)
            and isinstance(e.get("txid"), str)
            and e["txid"].isalnum()
            and type(e.get("process")) is int
            and e["process"] >= 0
            and type(e.get("size")) is int
            and 0 <= e["size"] <= MAX_INDEX_BYTES
            and isinstance(e.get("crc32c"), str)
            and e.get("object") == index_key(e["txid"], e["process"])
            and ("borrowed" not in e or check_borrowed(e["borrowed"]))
        )
        if not ok:
            raise CorruptCheckpointError(
                f"{url}/quire.json: malformed chunk-index entry {str(e)[:200]!r}; "
                "the commit record is damaged (restore it from a copy)"
            )
    return list(entries)


def parse_index(
    data: bytes, entry: Mapping[str, Any], url: str, txids: Collection[str] | None = None
) -> dict[str, Ref]:
    """The refs of one index object, checked against its record entry; every ref must
    point where :func:`target_allowed` allows (``txids``: those the record lists)."""
    where = f"{url}/{entry['object']}"
    if len(data) != entry["size"] or crc_hex(crc32c(data)) != entry["crc32c"]:
        raise ChunkError(
            f"chunk index {entry['object']} has {len(data)} bytes / crc32c "
            f"{crc_hex(crc32c(data))}, the commit record says {entry['size']} / {entry['crc32c']}"
        )
    try:
        doc = json.loads(data)
        refs, meta = doc["refs"], doc["quire"]
        fmt = meta.get("format")
        if doc.get("version") != 1 or fmt not in FORMATS:
            raise ValueError(
                f"unknown index version {fmt!r}: this quire reads index formats "
                f"{', '.join(map(str, FORMATS))}; upgrade quire to read it"
            )
        crcs = meta["crc32"]
        trailers = meta["crc32c"] if fmt == TRAILER_FORMAT else {}
        if fmt != TRAILER_FORMAT and "crc32c" in meta:
            raise ValueError(f"'crc32c' in an index of format {fmt}")
        if meta.get("txid") != entry["txid"] or meta.get("process") != entry["process"]:
            raise ValueError("index of another save or process")
        shards = meta.get("shards", {})
        if not all(isinstance(x, dict) for x in (refs, crcs, trailers, shards)):
            raise TypeError("refs")
    except RecursionError:  # a forged index nested too deeply for the parser
        raise ChunkError(f"chunk index {where} is malformed (nested too deeply)") from None
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ChunkError(f"chunk index {where} is malformed ({e!r})") from e
    prefix = f"d/{entry['txid']}/"
    # A target outside the checkpoint only as a borrowed pack the record declares.
    borrowed = entry.get("borrowed") or {}
    out: dict[str, Ref] = {}
    for key, v in refs.items():
        crc, tcrc = crcs.get(key), trailers.get(key)
        trailer = tcrc is not None
        bind = tcrc if trailer else crc
        if (
            not key.startswith(prefix)
            or not is_safe_location(key)
            or not isinstance(bind, str)
            or (trailer and (crc is not None or key.endswith("/zarr.json") or isinstance(v, str)))
        ):  # one binding per key; a trailer only for a chunk in a pack
            raise ChunkError(f"chunk index {where}: bad entry for key {key[:200]!r}")
        if isinstance(v, str):
            if key in shards:
                raise ChunkError(f"chunk index {where}: bad shard binding for key {key[:200]!r}")
            out[key] = Ref(None, 0, len(v.encode()), bind, v.encode())
            continue
        if (
            not isinstance(v, list)
            or len(v) != 3
            or any(type(x) is not int or not 0 <= x < MAX_OBJECT_BYTES for x in v[1:])
        ):
            raise ChunkError(f"chunk index {where}: bad reference {str(v)[:200]!r} for {key!r}")
        if not target_allowed(v[0], txids, borrowed):
            raise ChunkError(
                f"chunk index {where}: key {key[:200]!r} points at {str(v[0])[:200]!r}, not a "
                "pack of a txid the commit record lists, nor a borrowed pack it declares"
            )
        shard = shards.get(key)
        if shard is not None and (
            trailer or not valid_shard_binding(shard) or 16 * (len(shard) // 8 - 1) + 4 > v[2]
        ):  # a zarr shard is CRC-32-bound as a whole, and holds its index
            raise ChunkError(f"chunk index {where}: bad shard binding for key {key[:200]!r}")
        out[key] = Ref(v[0], v[1], v[2], bind, trailer=trailer, shard=shard)
    if not shards.keys() <= out.keys():
        raise ChunkError(f"chunk index {where}: a shard binding for a key it does not hold")
    return out


class ChunkIndex:
    """The refs of a checkpoint's index objects, loaded lazily: own process first."""

    def __init__(
        self,
        base: Backend,
        url: str,
        entries: Sequence[Mapping[str, Any]],
        process: int = 0,
        txids: Collection[str] | None = None,
    ) -> None:
        self.base = base
        self.url = url
        self.process = process
        # Where refs may point (``target_allowed``): the record's txids, else the entries'.
        self.txids = frozenset(txids if txids is not None else (e["txid"] for e in entries))
        self.by_txid: dict[str, list[Mapping[str, Any]]] = {}
        for e in entries:
            self.by_txid.setdefault(e["txid"], []).append(e)
        self._loads: dict[str, asyncio.Future[dict[str, Ref]]] = {}  # object -> its read
        self.loaded: list[str] = []  # index objects read (tests count them)

    async def _load(self, entry: Mapping[str, Any]) -> dict[str, Ref]:
        """The refs of one index object, read once: every caller awaits one shared task.
        The task is shielded from its waiters: when one is cancelled (the first failing
        leaf of a load cancels its siblings) the read goes on for the others, and its
        outcome, a value or the typed error, is what each remaining waiter gets."""
        key = entry["object"]
        task = self._loads.get(key)
        if task is None:
            task = asyncio.ensure_future(self._fetch(entry))
            # Its error is seen even when every waiter was cancelled (no "never retrieved").
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._loads[key] = task
        return await asyncio.shield(task)

    async def _fetch(self, entry: Mapping[str, Any]) -> dict[str, Ref]:
        key = entry["object"]
        try:
            data = await self.base.get(key)
        except FileNotFoundError as e:
            raise ChunkError(f"chunk index {key} is missing") from e
        except OSError as e:
            raise_not_data(e, key)
        refs = parse_index(data, entry, self.url, self.txids)
        self.loaded.append(key)
        return refs

    def owns(self, key: str) -> bool:
        parts = key.split("/", 2)
        return len(parts) > 2 and parts[0] == "d" and parts[1] in self.by_txid

    async def lookup(self, key: str) -> Ref | None:
        parts = key.split("/", 2)
        entries = self.by_txid.get(parts[1]) if len(parts) > 2 and parts[0] == "d" else None
        if not entries:
            return None
        own = [e for e in entries if e["process"] == self.process]
        rest = [e for e in entries if e["process"] != self.process]
        for group in (own, rest):
            maps = await asyncio.gather(*(self._load(e) for e in group))
            for m in maps:
                ref = m.get(key)
                if ref is not None:
                    return ref
        return None

    async def own_refs(self) -> builtins.list[dict[str, Ref]]:
        """The refs of this process's index objects."""
        own = [e for es in self.by_txid.values() for e in es if e["process"] == self.process]
        return list(await asyncio.gather(*(self._load(e) for e in own)))

    async def all_refs(self) -> dict[str, Ref]:
        out: dict[str, Ref] = {}
        entries = [e for es in self.by_txid.values() for e in es]
        for m in await asyncio.gather(*(self._load(e) for e in entries)):
            out.update(m)
        return out
