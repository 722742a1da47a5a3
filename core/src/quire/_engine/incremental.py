"""Incremental saves: a step of a Checkpointer root borrows the unchanged bytes of the
previous one (``quire._format.borrow`` has the format; ``docs/format.md`` "Borrowed bytes").

One :class:`Incremental` per process and Checkpointer remembers the last step this process
committed (its own chunk index, root-relative, and each leaf's location, record and — for a
``jax.Array`` — a weak reference).  A save then decides per leaf, cheapest first:

1. the very same ``jax.Array`` object at that key path, with the same storage options:
   the leaf is *carried* — no device-to-host copy, no encode, no hash, no write; its keys
   point at the previous step's bytes (``PackWriter.carry``);
2. else each encoded chunk's xxh3-128 equal to the previous step's at the same key:
   the chunk is borrowed (``PackWriter.put_bound``);
3. else it is written.

Order of one save (what keeps a concurrent gc from deleting borrowed bytes):

1. at the first chunk equal to the previous step's (or before carrying a leaf), write the
   **lease** ``leases/<step>-<txid>-p<process>.json`` naming every pack the previous
   step's index points into (a save where everything changed writes none);
2. check that the previous step's record still exists with the same txids (else borrow
   nothing: retention or an overwrite may have removed it);
3. write, borrowing; commit (the record's ``indexes`` declare the borrowed packs);
4. delete the lease.

The gc marks records first and leases second (``quire._engine.garbage``), so a pack a
save may borrow is marked either through the previous step's record or through the lease.
A lease is honoured for the gc grace period: a save may not run longer than that.
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax

from quire._format import record as _records
from quire._format.borrow import Previous, from_root, root_relative
from quire._format.chunkid import Ref
from quire._format.chunkindex import parse_index
from quire._format.root import INCREMENTAL_MARKER, LEASE_DIR
from quire._format.tree import KeyPath, from_json, keystr
from quire._store.base import Backend
from quire.options import StorageOptions

log = logging.getLogger("quire")


#: Default of ``Checkpointer(compact_below=)`` (``quire._engine.compaction``).
COMPACT_BELOW = 0.5

LeafKey = tuple[str, str]  # (unit, key path as keystr)


@dataclass
class LeafInfo:
    """A leaf of the previous step: where it was, its record, and the object saved."""

    location: str
    record: dict[str, Any]
    value: weakref.ref[Any] | None = None
    storage: StorageOptions | None = None


@dataclass
class Base:
    """The previous step of this process: what a save may borrow."""

    step: str
    txids: list[str]
    previous: Previous
    leaves: dict[LeafKey, LeafInfo] = field(default_factory=dict)


@dataclass
class Carried:
    """A leaf saved by pointing at the previous step's bytes."""

    key: LeafKey
    location: str
    info: LeafInfo


def lease_key(step: str, txid: str, process: int) -> str:
    return f"{LEASE_DIR}/{step}-{txid}-p{process:05d}.json"


class Incremental:
    """One process's incremental state in a Checkpointer root (see the module docstring).

    Parameters
    ----------
    root : str
        The Checkpointer root URL.
    compact_below : float
        A save moves the chunks it would borrow from a pack into a pack of its own when
        they are less than this fraction of that pack's bytes (``quire._engine.compaction``);
        0 never moves any.
    """

    def __init__(self, root: str, compact_below: float = COMPACT_BELOW) -> None:
        if not 0 <= compact_below <= 1:
            raise ValueError(f"{root}: compact_below must be within [0, 1], got {compact_below}")
        self.root = root
        self.compact_below = compact_below
        self.base: Base | None = None
        self.pending: Base | None = None
        self.lease_key: str | None = None
        self.stats: dict[str, int] = {}
        self.started = False
        self.marked = False

    async def start(self, root: Backend, latest: str | None) -> None:
        """Before the first save: continue from ``latest``, the root's latest committed
        step (an earlier run's), when it was saved incrementally."""
        self.started = True
        if self.base is None and latest is not None:
            self.base = await resume(root, self.root, latest, jax.process_index())

    # -- prepare (the caller's thread) ---------------------------------------------
    def same(
        self, unit: str, path: KeyPath, value: Any, storage: StorageOptions
    ) -> LeafInfo | None:
        """The previous step's leaf when ``value`` is the very object saved there."""
        if self.base is None or not isinstance(value, jax.Array):
            return None
        info = self.base.leaves.get((unit, keystr(path)))
        if info is None or info.value is None or info.value() is not value:
            return None
        return info if info.storage == storage else None

    # -- write (quire's loop) ------------------------------------------------------
    def candidate(self, step: str, paths: Mapping[str, LeafKey]) -> Previous | None:
        """What a save of ``step`` may borrow from (no I/O): the previous step, its
        locations mapped to the new ones (``paths``: new location -> leaf), or None.  It
        is borrowed from only once :meth:`lease` says so."""
        base = self.base
        if base is None or base.step == step:
            return None
        prev = base.previous
        prev.locations = {
            loc: base.leaves[k].location for loc, k in paths.items() if k in base.leaves
        }
        return prev

    async def lease(self, root: Backend, step: str, txid: str) -> bool:
        """Before the first borrow: write the lease, then check that the previous step
        is still there with the same txids (False: borrow nothing)."""
        base = self.base
        assert base is not None
        if not self.marked:
            await root.put(INCREMENTAL_MARKER, [b'{"incremental": true}'])
            self.marked = True
        self.lease_key = lease_key(step, txid, jax.process_index())
        doc = {"created": time.time(), "packs": base.previous.packs()}
        await root.put(self.lease_key, [json.dumps(doc).encode()])
        try:
            rec = _records.parse(await root.get(f"{base.step}/{_records.RECORD}"), self.root)
        except (FileNotFoundError, ValueError) as e:  # deleted meanwhile, or damaged
            log.info("%s: not borrowing from %s (%s)", self.root, base.step, e)
            return False
        if sorted(rec.get("txids", [])) != sorted(base.txids):
            log.info("%s: not borrowing from %s (saved again since)", self.root, base.step)
            return False
        return True

    async def release(self, root: Backend) -> None:
        """Delete the lease (after the commit, or after a failed save)."""
        lease, self.lease_key = self.lease_key, None
        if lease is not None:
            try:
                await root.delete([lease])
            except Exception:  # broad: gc ignores and removes a lease past the grace period
                pass

    def wrote(
        self,
        step: str,
        txid: str,
        refs: Mapping[str, Any],
        binds: Mapping[str, tuple[str, bool]],
        shards: Mapping[str, str],
        hashes: Mapping[str, str],
        leaves: dict[LeafKey, LeafInfo],
    ) -> None:
        """What this save wrote (becomes the base once committed: :meth:`committed`)."""
        rel = {
            k: [root_relative(step, v[0]), v[1], v[2]] if isinstance(v, list) else v
            for k, v in refs.items()
        }
        base = self.base.previous if self.base is not None else Previous({}, {}, {}, {})
        sizes = base.pack_sizes(step, refs)
        prev = Previous(rel, dict(binds), dict(shards), dict(hashes), sizes)
        self.pending = Base(step, [txid], prev, leaves)

    def committed(self) -> None:
        if self.pending is not None:
            self.base, self.pending = self.pending, None

    def failed(self) -> None:
        self.pending = None


async def resume(root: Backend, url: str, step: str, process: int) -> Base | None:
    """The base of a step committed earlier (by another run): its record and this
    process's index, if the step was saved incrementally (its index has chunk hashes)."""
    try:
        doc = _records.parse(await root.get(f"{step}/{_records.RECORD}"), url)
    except (FileNotFoundError, ValueError):
        return None
    entries = [e for e in doc.get("indexes") or [] if e.get("process") == process]
    if len(entries) != 1:
        return None
    entry = entries[0]
    data = await root.get(f"{step}/{entry['object']}")
    parsed: dict[str, Ref] = parse_index(data, entry, f"{url}/{step}")  # checks it
    meta = json.loads(data)["quire"]
    hashes = meta.get("xxh3")
    if not isinstance(hashes, dict):
        return None
    refs: dict[str, Any] = {}
    binds: dict[str, tuple[str, bool]] = {}
    for k, r in parsed.items():
        if r.inline is not None:
            refs[k] = r.inline.decode()
        else:
            assert r.target is not None
            refs[k] = [root_relative(step, r.target), r.offset, r.length]
        binds[k] = (r.crc, r.trailer)
    shards = {k: r.shard for k, r in parsed.items() if r.shard is not None}
    leaves = dict(record_leaves(doc))
    return Base(step, list(doc["txids"]), Previous(refs, binds, shards, hashes), leaves)


def record_leaves(doc: Mapping[str, Any]) -> Iterator[tuple[LeafKey, LeafInfo]]:
    """Every array leaf of a commit record: its (unit, key path) and its record, with its
    location."""
    for name, unit in doc["units"].items():
        if unit.get("kind") != "pytree":
            continue
        for leaf in from_json(unit["tree"]).leaves():
            loc = leaf.value.get("location")
            if isinstance(loc, str):
                yield (name, keystr(leaf.path)), LeafInfo(loc, dict(leaf.value))


__all__ = [
    "COMPACT_BELOW",
    "Base",
    "Carried",
    "Incremental",
    "LeafInfo",
    "from_root",
    "lease_key",
    "record_leaves",
    "resume",
]
