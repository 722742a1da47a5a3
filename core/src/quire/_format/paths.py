"""Escaping key paths into object keys that can never climb out of the checkpoint."""

from __future__ import annotations

import hashlib
from typing import Any
from urllib.parse import quote

from quire._format.bounds import WRITTEN_COMPONENT as MAX_COMPONENT
from quire._format.bounds import WRITTEN_PATH as MAX_PATH
from quire._format.tree import KeyPath

_SAFE = "-_.~+=,@"


def escape_component(key: object) -> str:
    s = str(key)
    if s == "":
        return "%"  # never produced by percent-encoding, so it cannot collide
    if s in (".", ".."):
        return s.replace(".", "%2E")
    out = quote(s, safe=_SAFE, errors="surrogatepass")
    if len(out) > MAX_COMPONENT:
        h = hashlib.sha256(s.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        out = f"{out[: MAX_COMPONENT - 18]}~{h}"
    return out


def escape_path(path: KeyPath) -> str:
    """``('params', 'w/../x', 0)`` -> ``params/w%2F..%2Fx/0``; long paths are hashed."""
    parts = [escape_component(k) for k in path] or ["%root"]
    s = "/".join(parts)
    if len(s) > MAX_PATH:
        h = hashlib.sha256(repr(path).encode("utf-8", "surrogatepass")).hexdigest()[:24]
        s = f"{s[: MAX_PATH - 40].rsplit('/', 1)[0]}/~{h}"
    return s


def assign_locations(paths: list[KeyPath], prefix: str) -> list[str]:
    """Unique locations under ``prefix``.

    Each key's name is made unique among its siblings case-insensitively (a ``~n``
    suffix), so two keys never share a directory on macOS or Windows file systems.
    """
    names: dict[tuple[str, Any], str] = {}  # (parent dir, key) -> escaped name
    taken: dict[str, set[str]] = {}  # parent dir -> lower-cased names in use
    out = []
    for p in paths:
        parent = ""
        for k in p:
            name = names.get((parent, k))
            if name is None:
                base = escape_component(k)
                used = taken.setdefault(parent, set())
                name, n = base, 1
                while name.lower() in used:
                    n += 1
                    name = f"{base}~{n}"
                used.add(name.lower())
                names[(parent, k)] = name
            parent = f"{parent}/{name}" if parent else name
        rel = parent or "%root"
        if len(rel) > MAX_PATH:
            h = hashlib.sha256(repr(p).encode("utf-8", "surrogatepass")).hexdigest()[:24]
            rel = f"{rel[: MAX_PATH - 40].rsplit('/', 1)[0]}/~{h}"
        out.append(f"{prefix}/{rel}")
    return out


def is_safe_location(loc: object) -> bool:
    """Whether a location read from a record stays inside ``d/`` (and is UTF-8 text: no
    stored object has a name with a lone surrogate)."""
    if not isinstance(loc, str) or not loc.startswith("d/") or "\x00" in loc or "\\" in loc:
        return False
    if not loc.isascii():
        try:
            loc.encode("utf-8")
        except UnicodeEncodeError:
            return False
    return all(part not in ("", ".", "..") for part in loc.split("/"))


def is_chunk(key: str) -> bool:
    """Whether a stored object (or a pack range) is an array chunk (or zarr shard), the
    unit ``quire verify``, ``cp`` and ``info`` count, rather than an array's ``zarr.json``."""
    return not key.endswith("zarr.json")


def location_of(key: str) -> str:
    """The array location of a zarr key: ``<loc>/zarr.json``, ``<loc>/c/<i>/<j>...`` or
    ``<loc>/c``, the one chunk of a 0-d array (zarr's default chunk key encoding joins
    ``c`` and no coordinates)."""
    if key.endswith("/zarr.json"):
        return key[: -len("/zarr.json")]
    if key.endswith("/c"):
        return key[: -len("/c")]
    return key.rsplit("/c/", 1)[0]


def is_chunk_of(key: str, location: str) -> bool:
    """Whether ``key`` is a chunk (or zarr shard) key of the array at ``location``."""
    rest = key[len(location) :] if key.startswith(location) else ""
    return rest == "/c" or rest.startswith("/c/")
