"""``quire cp`` of an incremental step: the copy is self-contained.

A step that borrows bytes (``quire._format.borrow``) points its chunk index at packs of
sibling steps, ``../<step>/d/<T>/%packs/<name>``.  A copy cannot reach those siblings, so
:class:`Unborrow` makes it own them: each borrowed pack is copied whole (checked chunk by
chunk against the borrowing index, as every pack is) to ``d/<T>/%packs/<name>`` inside the
destination (``T`` is a random txid of another step, distinct from the step's own), each
index is rewritten with those targets and without its ``borrowed`` declaration, and the
record names the indexes' new sizes and crc32c, ``T`` among its ``txids`` and no borrowed
pack.  Nothing else changes: keys, locations and the other txids stay as they were.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from quire._format import record as _records
from quire._format.borrow import UP, borrowed_of
from quire._format.chunkindex import index_entry


class Unborrow:
    """The rewrites a copy of a borrowing record needs (``None`` from :meth:`of` if none)."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        self.borrowed = borrowed_of(doc.get("indexes"))
        self.entries: dict[str, dict[str, Any]] = {}  # index object -> its new record entry

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> Unborrow | None:
        u = cls(doc)
        return u if u.borrowed else None

    @staticmethod
    def dest(key: str) -> str:
        """Where a borrowed pack goes in the copy (the rest keep their keys)."""
        return key.split("/", 2)[2] if key.startswith(UP) else key

    def index(self, entry: Mapping[str, Any]) -> Any:
        """The rewrite of one index object (its new entry is kept for :meth:`record`)."""

        def rewrite(data: bytes) -> bytes:
            doc = json.loads(data)
            doc["refs"] = {
                k: [self.dest(v[0]), *v[1:]] if isinstance(v, list) else v
                for k, v in doc["refs"].items()
            }
            doc["quire"].pop("borrowed", None)
            out = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
            self.entries[entry["object"]] = index_entry(
                entry["txid"], entry["process"], entry["object"], out, {}
            )
            return out

        return rewrite

    def record(self, raw: bytes) -> tuple[bytes, list[str]]:
        """The copy's record (after every index was rewritten) and its txids."""
        doc = json.loads(raw)
        doc["indexes"] = [self.entries.get(e["object"], e) for e in doc["indexes"]]
        lent = {self.dest(t).split("/")[1] for t in self.borrowed}
        doc["txids"] = sorted(set(doc["txids"]) | lent)
        doc["checksum"] = _records.record_checksum(doc)
        return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode(), doc["txids"]
