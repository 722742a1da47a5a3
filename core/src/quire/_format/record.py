"""The commit record ``quire.json`` (format versions 1 and 2): building and strict parsing.

Layout::

    {"format": "quire", "version": 1, "created": ISO-8601, "library_version": str,
     "process_count": int, "txids": [str], "metadata": {...user...},
     "units": {
        "pytree": {"kind": "pytree", "tree": <node>},          # quire.save's unit
        "config": {"kind": "json", "value": <any JSON>},
        "data":   {"kind": "handler", "handler": id, "location": "d/<txid>/data",
                   "record": <handler JSON>},
        "iter":   {"kind": "handler", "handler": id, "location": "d/<txid>/iter",
                   "processes": n, "records": [<handler JSON of process 0>, ...]}}}

``<node>`` is described in ``quire._format.tree``.  Version 2 (packed data) adds
``"indexes": [{"txid", "process", "object", "size", "crc32c"}]``, one per process and
txid, naming the chunk-index objects (``quire._format.chunkindex``); everything else is as in 1.

A **per-process** unit (``"processes"``: the handler declared ``per_process``) holds one state
per JAX process: process ``i`` wrote its objects under ``<location>/p<i, 5 digits>/``
(:func:`process_dir`) and its record is ``records[i]``; ``processes`` equals the record's
``process_count``.  A whole unit has one ``record`` and objects directly under its location.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from quire._format import schema as _schema
from quire._format.chunkindex import check_entries
from quire._format.crc import crc32c
from quire._runtime.config import current
from quire._runtime.version import __version__
from quire.errors import CorruptCheckpointError

FORMAT = "quire"
VERSION = 1
PACKED_VERSION = 2
READABLE = (VERSION, PACKED_VERSION)
RECORD = "quire.json"
PYTREE = "pytree"  # the unit name of quire.save's tree
JOURNAL_DIR = "journal"  # <ckpt>/journal/: the partial-save journal


def is_journal_record(name: str) -> bool:
    """Whether ``name`` (in ``journal/``) is a version's record: ``<N>.json``."""
    return name.endswith(".json") and name[:-5].isdigit()


def process_dir(index: int) -> str:
    """The folder of process ``index``'s objects under a per-process unit's location."""
    return f"p{index:05d}"


def build(
    *,
    units: dict[str, dict[str, Any]],
    txids: list[str],
    metadata: dict[str, Any] | None,
    process_count: int,
    extra: dict[str, Any] | None = None,
    indexes: list[dict[str, Any]] | None = None,
) -> bytes:
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(),
        "library_version": __version__,
        "process_count": process_count,
        "txids": txids,
        "metadata": metadata or {},
        "units": units,
        **(extra or {}),
    }
    if indexes is not None:  # format version 2: chunks live in packs
        doc["version"] = PACKED_VERSION
        doc["indexes"] = indexes
    try:
        doc["checksum"] = record_checksum(doc)
        return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"user metadata must be JSON-serialisable (str keys; numbers, strings, lists, dicts): {e}"
        ) from e


def _bad(url: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{url}/{RECORD} is not a valid quire commit record: {why}. The checkpoint is damaged or "
        "was not written by quire; restore it from a copy"
    )


def record_checksum(doc: dict[str, Any]) -> str:
    """crc32c (hex) of the record without its ``checksum`` field, in canonical JSON
    (sorted keys, compact separators, ASCII): a flipped byte in an inline value — a
    scalar, a string, a JSON unit — is caught like a flipped byte in a chunk."""

    body = {k: v for k, v in doc.items() if k != "checksum" and not k.startswith("_")}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return f"crc32c:{crc32c(canon.encode()):08x}"


def verify_record() -> bool:
    """Whether records must carry a valid checksum here (the ``verify_record`` option)."""
    return current().verify_record


def parse(raw: bytes, url: str) -> dict[str, Any]:
    """Parse and validate a commit record; ``CorruptCheckpointError`` on any defect."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(url, f"not JSON ({e}); it may be truncated") from e
    except RecursionError as e:
        raise _bad(url, "nested too deeply") from e
    except ValueError as e:  # e.g. an integer beyond the parser's digit limit
        raise _bad(url, f"unreadable JSON value ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _bad(url, "missing 'format': 'quire'")
    v = doc.get("version")
    if type(v) is not int:
        raise _bad(url, f"version {v!r} is not an integer")
    if v not in READABLE:
        raise CorruptCheckpointError(
            f"{url}/{RECORD} has format version {v}; this quire reads versions "
            f"{', '.join(map(str, READABLE))}. "
            "Upgrade quire to read it"
        )
    stored = doc.get("checksum")
    if not verify_record():
        pass
    elif not isinstance(stored, str) or not stored:
        raise CorruptCheckpointError(
            f"{url}/{RECORD} has no valid checksum ({_schema._short(stored)}): a record without one could "
            "be damaged or altered unnoticed; restore it from a copy, or load it with "
            "quire.Context(verify_record=False) if you trust it"
        )
    else:
        try:
            actual = record_checksum(doc)
        except (TypeError, ValueError) as e:
            raise _bad(url, f"cannot be checked ({e})") from e
        if stored != actual:
            raise CorruptCheckpointError(
                f"{url}/{RECORD} fails its checksum (stored {stored!r}, computed {actual!r}): "
                "the commit record was modified or damaged; restore it from a copy"
            )
    if not isinstance(doc.get("metadata"), dict):
        raise _bad(url, "'metadata' is not an object")
    txids = doc.get("txids")
    if not isinstance(txids, list) or not all(isinstance(t, str) and t.isalnum() for t in txids):
        raise _bad(url, "'txids' is not a list of ids")
    if type(doc.get("process_count")) is not int:
        raise _bad(url, "'process_count' is not an integer")
    try:
        created = datetime.datetime.fromisoformat(doc["created"])
    except (KeyError, TypeError, ValueError) as e:
        raise _bad(url, "'created' is not an ISO timestamp") from e
    doc["_created"] = created
    if v == PACKED_VERSION:
        for entry in check_entries(doc.get("indexes"), url):
            if entry["txid"] not in txids:
                raise _bad(url, f"chunk index of txid {entry['txid']!r}, which is not in 'txids'")
    elif "indexes" in doc:
        raise _bad(url, "'indexes' in a version-1 record")
    _schema.check_commit(doc, f"{url}/{RECORD}")  # every unit, leaf and location
    return doc
