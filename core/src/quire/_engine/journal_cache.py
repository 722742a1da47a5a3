"""The partial-save journal records this process has read and parsed, per checkpoint URL.

Records are immutable once created, but a journal may be discarded (or removed) and a new
one started at the same URL, by another process too.  So a URL's cached records hold for
one journal only: the one whose record 1 has the digest given to :func:`check`.  A reader
(``quire._engine.journal.read_records``) fetches record 1 on every read (one small GET)
and calls :func:`check` first: a new journal drops the old one's records.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

_lock = threading.Lock()
_records: dict[tuple[str, int], dict[str, Any]] = {}
_first: dict[str, bytes] = {}  # url -> digest of record 1 of the journal cached


def digest(raw: bytes) -> bytes:
    """What tells one journal from another at a URL: the digest of its record 1's bytes."""
    return hashlib.sha256(raw).digest()


def check(url: str, first: bytes) -> None:
    """The journal at ``url`` has record 1 of digest ``first``: drop records of another."""
    with _lock:
        if _first.get(url) != first:
            _drop(url)
            _first[url] = first


def get(url: str, n: int) -> dict[str, Any] | None:
    """Record ``n`` of ``url``'s journal, if cached (after :func:`check`)."""
    with _lock:
        return _records.get((url, n))


def put(url: str, first: bytes, n: int, doc: dict[str, Any]) -> None:
    """Cache record ``n`` of the journal whose record 1 has digest ``first``, unless another
    journal was seen at ``url`` meanwhile."""
    with _lock:
        if _first.get(url) == first:
            _records[(url, n)] = doc


def forget(url: str) -> None:
    """Drop everything cached for ``url`` (its journal was finalized or discarded)."""
    with _lock:
        _drop(url)


def _drop(url: str) -> None:
    for k in [k for k in _records if k[0] == url]:
        del _records[k]
    _first.pop(url, None)
