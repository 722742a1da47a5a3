"""Object names under a checkpoint root: a bucket URL's bucket and root, and
:meth:`Backend.list` / :meth:`Backend.list_dir` from a store's prefix listing
(:func:`list_under`, :func:`dir_prefix`, :func:`dir_entries`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


def split_bucket_url(url: str) -> tuple[str, str]:
    """``scheme://bucket/a/b/`` -> ``("bucket", "a/b")``."""
    scheme, _, rest = url.partition("://")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket; use {scheme}://bucket/path/to/checkpoint")
    return bucket, prefix.strip("/")


def dir_prefix(root: str, prefix: str) -> str:
    """The object-name prefix of the "directory" ``prefix`` under ``root`` (``""`` or
    ending in ``/``)."""
    base = "/".join(p for p in (root, prefix.strip("/")) if p)
    return f"{base}/" if base else ""


def dir_entries(under: str, names: list[str], prefixes: list[str]) -> tuple[list[str], list[str]]:
    """:meth:`Backend.list_dir` from a delimited listing of ``under``: object names and
    common prefixes (``under + "x/"``), made relative and sorted."""
    n = len(under)
    return sorted(k[n:] for k in names), sorted(p[n:].rstrip("/") for p in prefixes)


async def list_under(
    lister: Callable[[str, int | None], Awaitable[list[str]]], root: str, prefix: str
) -> list[str]:
    """:meth:`Backend.list` from ``lister(name_prefix, limit)``, a store's listing of the
    object names that start with ``name_prefix`` (sorted, at least ``limit`` of them)."""
    prefix = prefix.strip("/")
    base = "/".join(p for p in (root, prefix) if p)
    under = f"{base}/" if base else ""
    if prefix:
        # The key ``prefix`` itself sorts first among names that start with it.
        children, first = await asyncio.gather(lister(under, None), lister(base, 1))
        found = children + [k for k in first[:1] if k == base]
    else:
        found = await lister(under, None)
    cut = len(root) + 1 if root else 0
    return sorted(k[cut:] for k in found)
