"""Replaying the partial-save journal: version N's tree is the merge of records 1..N.

Fragments merge into the state (dicts by key, lists by index, the later version wins),
then deletions apply.  Pure functions over tree JSON (see :mod:`quire._engine.journal`), plus
:func:`drop_dead`, which deletes the data a finalize or discard left unreferenced, and
:func:`replayed`, the state with the backend its data reads through.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterable, Sequence
from typing import Any

from quire._engine.load import packed_view
from quire._format.tree import KeyPath, from_json
from quire._store.base import Backend


def merge(base: dict[str, Any] | None, frag: dict[str, Any]) -> dict[str, Any]:
    if base is None or frag["kind"] == "leaf" or base["kind"] != frag["kind"]:
        return copy.deepcopy(frag)
    out = dict(base)
    if frag["kind"] == "dict":
        keys = list(base["keys"])
        kids = list(base["children"])
        for k, c in zip(frag["keys"], frag["children"]):
            if k in keys:
                i = keys.index(k)
                kids[i] = merge(kids[i], c)
            else:
                keys.append(k)
                kids.append(copy.deepcopy(c))
        out["keys"], out["children"] = keys, kids
    else:
        kids = list(base["children"])
        for i, c in enumerate(frag["children"]):
            if i < len(kids):
                kids[i] = merge(kids[i], c)
            else:
                kids.append(copy.deepcopy(c))
        out["children"] = kids
    if "type" in frag:
        out["type"] = frag["type"]
    return out


def find(node: dict[str, Any] | None, path: Sequence[Any]) -> dict[str, Any] | None:
    for k in path:
        if node is None or node["kind"] == "leaf":
            return None
        if node["kind"] == "dict":
            if k not in node["keys"]:
                return None
            node = node["children"][node["keys"].index(k)]
        else:
            if not isinstance(k, int) or not 0 <= k < len(node["children"]):
                return None
            node = node["children"][k]
    return node


def delete(node: dict[str, Any] | None, path: Sequence[Any]) -> dict[str, Any] | None:
    if node is None or not path:
        return node
    parent = find(node, path[:-1])
    if parent is None or parent["kind"] == "leaf":
        return node
    k = path[-1]
    if parent["kind"] == "dict" and k in parent["keys"]:
        i = parent["keys"].index(k)
        del parent["keys"][i]
        del parent["children"][i]
    elif parent["kind"] != "dict" and isinstance(k, int) and 0 <= k < len(parent["children"]):
        del parent["children"][k]
    return node


def replay(records: Iterable[dict[str, Any]]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(tree JSON, merged metadata) after applying ``records`` in order."""
    state: dict[str, Any] | None = None
    meta: dict[str, Any] = {}
    for r in records:
        if r.get("tree") is not None:
            state = merge(state, r["tree"])
        for p in r.get("deleted", []):
            state = delete(state, p)
        meta.update(r.get("metadata", {}))
    return state, meta


def leaf_paths(tree: dict[str, Any] | None) -> list[KeyPath]:
    if tree is None:
        return []
    return [leaf.path for leaf in from_json(tree).leaves()]


def overlaps(a: KeyPath, b: KeyPath) -> bool:
    n = min(len(a), len(b))
    return tuple(a[:n]) == tuple(b[:n])


def locations(tree: dict[str, Any] | None) -> set[str]:
    out = set()
    if tree is not None:
        for leaf in from_json(tree).leaves():
            loc = leaf.value.get("location")
            if isinstance(loc, str) and loc.startswith("d/"):
                out.add(loc)
    return out


def txids_of(tree: dict[str, Any] | None) -> set[str]:
    return {loc.split("/")[1] for loc in locations(tree)}


async def drop_dead(
    backend: Backend, records: Sequence[dict[str, Any]], dead: set[str], dead_locs: set[str]
) -> None:
    """Delete the data of the ``dead`` txids and of the leaf locations ``dead_locs``.

    Format v2 keeps a packed txid's chunks in its packs, so its dead leaf locations
    usually hold nothing: one listing per such txid finds what is there, instead of one
    listing per dead location.  Dead bytes inside packs are the finalize rewrite's job.
    """
    sem = asyncio.Semaphore(16)
    packed = {e.get("txid") for r in records for e in r.get("indexes") or []}
    listed: dict[str, set[str]] = {}
    for loc in dead_locs:
        if loc.split("/")[1] in packed:
            listed.setdefault(loc.split("/")[1], set()).add(loc)
    one_by_one = dead_locs - {loc for locs in listed.values() for loc in locs}

    async def drop(prefix: str) -> None:
        async with sem:
            await backend.delete_prefix(prefix)

    async def drop_listed(txid: str, locs: set[str]) -> None:
        async with sem:
            keys = await backend.list(f"d/{txid}/")
        doomed = [k for k in keys if any(k.startswith(loc + "/") for loc in locs)]
        if doomed:
            await backend.delete(doomed)

    await asyncio.gather(
        *(drop(f"d/{t}") for t in dead),
        *(drop(loc) for loc in one_by_one),
        *(drop_listed(t, locs) for t, locs in listed.items()),
    )


def replayed(
    backend: Backend, url: str, records: list[dict[str, Any]]
) -> tuple[dict[str, Any], Backend, dict[str, Any]]:
    """The state ``records`` replay to: its JSON tree, the backend its data reads through
    (format v2: the live versions' chunk indexes) and its merged metadata."""
    state, meta = replay(records)
    tree = state if state is not None else {"kind": "dict", "keys": [], "children": []}
    view = packed_view(backend, url, {"indexes": live_indexes(records, txids_of(state))})
    return tree, view, meta


def live_indexes(records: list[dict[str, Any]], live: set[str]) -> list[dict[str, Any]]:
    """The chunk indexes (format v2) of the versions whose data is still live.  Until
    finalize, their packs keep the bytes of replaced leaves; finalize rewrites the packs
    less than half live (``quire._engine.packrewrite``)."""
    return [e for r in records if r.get("txid") in live for e in r.get("indexes", [])]
