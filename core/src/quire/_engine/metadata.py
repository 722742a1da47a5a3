"""``quire.metadata``: a committed checkpoint's record, each leaf described by its handler.

Reads ``quire.json`` only.  Nothing here imports JAX or zarr (the built-in array handlers'
descriptions come from :mod:`quire._handlers.descriptions`), nor numpy for the records
``quire info`` and ``quire ls`` show (``as_records``): they start at once.
"""

from __future__ import annotations

import collections
from dataclasses import replace
from typing import Any

from quire._engine import commit as _commit
from quire._format.describe import ARRAYS
from quire._format.record import PYTREE
from quire._format.tree import Node, from_json
from quire._handlers.descriptions import built_in, describe
from quire._store.url import open_backend
from quire.errors import CorruptCheckpointError, QuireError
from quire.metadata import CheckpointMetadata


def rebuild_saved(node: Node, values: dict[int, Any]) -> Any:
    """The tree of saved containers with ``values[id(leaf)]`` at each leaf."""
    if node.kind == "leaf":
        return values[id(node)]
    kids = [rebuild_saved(c, values) for c in node.children]
    if node.kind == "dict":
        return dict(zip(node.keys, kids))
    if node.kind == "tuple" and node.typename is None:
        return tuple(kids)
    return kids


def metadata_from_doc(url: str, doc: dict[str, Any]) -> CheckpointMetadata:
    unit = doc["units"].get(PYTREE)
    tree = metadata_tree(url, unit["tree"]) if unit and unit.get("kind") == "pytree" else None
    return CheckpointMetadata(
        tree=tree,
        custom=doc["metadata"],
        created=doc["_created"],
        format_version=doc["version"],
        url=url,
        library_version=str(doc.get("library_version", "")),
        process_count=doc["process_count"],
        txids=tuple(doc["txids"]),
        units={k: v.get("handler", v["kind"]) for k, v in doc["units"].items()},
        record=doc,
    )


def metadata_tree(url: str, tree_json: dict[str, Any], *, as_records: bool = False) -> Any:
    """The saved tree with each leaf described by its handler (:class:`quire.metadata.LeafMetadata`
    for arrays, the type of inline values).  With ``as_records``, the built-in array
    handlers' leaves are :class:`quire._format.describe.ArrayRecord` (their dtype by name):
    what ``quire info`` and ``quire ls`` show, read without numpy."""
    saved = from_json(tree_json)
    by_handler: dict[str, list[Node]] = collections.defaultdict(list)
    for leaf in saved.leaves():
        by_handler[leaf.value["handler"]].append(leaf)
    metas: dict[int, Any] = {}
    for hid, leaves in by_handler.items():
        read = built_in(hid) if as_records else None
        try:
            ms: list[Any] = [] if read is None else [read(leaf.value) for leaf in leaves]
            if read is None or None in ms:  # a numpy scalar's type: its handler's (numpy)
                ms = describe(hid, [leaf.value for leaf in leaves], url=url)
        except QuireError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(
                f"{url}/quire.json: malformed {hid!r} leaf record: {e!r}"
            ) from e
        for leaf, m in zip(leaves, ms):
            variable = leaf.value.get("variable")
            if isinstance(m, ARRAYS) and variable is not None:
                m = replace(m, variable=variable)
            metas[id(leaf)] = m
    return rebuild_saved(saved, metas)


def unit_trees(url: str, doc: dict[str, Any], *, as_records: bool = False) -> dict[str, Any]:
    """The metadata tree (:func:`metadata_tree`) of every pytree unit of the record ``doc``,
    by unit name: one, ``"pytree"``, for ``quire.save``; one per unit for
    ``quire.save_checkpointables``."""
    return {
        name: metadata_tree(url, unit["tree"], as_records=as_records)
        for name, unit in doc["units"].items()
        if unit.get("kind") == "pytree"
    }


async def record(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The checked commit record of the checkpoint at ``url``."""
    return (await _commit.read(open_backend(url, storage_options), url)).doc


async def metadata(url: str, storage_options: dict[str, Any] | None = None) -> CheckpointMetadata:
    backend = open_backend(url, storage_options)
    doc = (await _commit.read(backend, url)).doc
    return metadata_from_doc(url, doc)
