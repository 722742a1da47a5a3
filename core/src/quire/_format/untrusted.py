"""JSON written by someone else: a safetensors header, an HF index, a chunk index.

``json.loads`` alone is not enough for input quire did not write: a document nested 100k
deep raises ``RecursionError`` (not a ``ValueError``), and an object that names a key twice
silently keeps the last value, so two readers of one file may disagree on what it holds.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["untrusted_json"]


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"key {dup[:200]!r} appears twice in one object")
    return out


def untrusted_json(data: bytes | str, *, unique: bool = True) -> Any:
    """Parse ``data``; ``ValueError`` for anything but one well-formed document.

    Parameters
    ----------
    data : bytes or str
        The document (UTF-8 when bytes).
    unique : bool
        Refuse an object that names a key twice (the default).

    Raises
    ------
    ValueError
        Not UTF-8, not JSON, nested too deeply for the parser, or (``unique``) a duplicate
        key; the message says which.
    """
    try:
        return json.loads(data, object_pairs_hook=_unique if unique else None)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None
