"""``quire info URL``: what a checkpoint holds, whatever it is.

* a quire checkpoint: every unit (the tree of ``quire.save``, each pytree unit of
  ``quire.save_checkpointables``, checkpointable units with their handlers), each array's
  shape, dtype, size, chunk grid, codecs and layout;
* a partial save not finalized: its journal's current state, the same way;
* another format's checkpoint (safetensors file, HF directory, Orbax step...): its arrays
  and metadata, as ``quire.open`` reads them;
* a ``quire.Checkpointer`` root: refused in one line naming its latest step.

A quire checkpoint is described from ``quire.json`` alone, importing neither JAX nor zarr:
``quire info`` answers at once.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from quire._cli.common import EXIT_OK, storage_options
from quire._cli.targets import one_checkpoint, target
from quire._cli.text import human_bytes, summary
from quire._engine import metadata as _metadata
from quire._format.borrow import borrowed_of
from quire._format.describe import ARRAYS, ArrayRecord, chain_text, counts, ownership
from quire._format.record import PYTREE
from quire._runtime import ioloop as _io
from quire._store.url import open_backend
from quire.metadata import LeafMetadata

#: A leaf's line and its bytes, or None for an inline leaf.
Describe = Callable[[Any], "tuple[str, int] | None"]


# ----------------------------------------------------------------------------- trees
def _layout(v: LeafMetadata | ArrayRecord) -> list[str]:
    """Codecs, chunk grid and layout of one array leaf (issue 10: what ``info`` shows)."""
    extras = [f"nnx.{v.variable}"] if v.variable else []
    if v.handler == "prng_key":
        return [*extras, "prng key"] + ([] if v.checksum else ["no checksum"])
    shape, chunk = tuple(v.shape), tuple(v.chunk_shape or v.shape)
    grid = [-(-s // max(1, c)) for s, c in zip(shape, chunk)]
    extras.append(f"chunks={list(chunk)} grid={grid}" if chunk != shape else "1 chunk")
    if v.codec_chain:  # the chain as stored, each codec with its configuration, lossy marked
        extras.append(f"codecs=[{chain_text(v.codec_chain, v.lossy)}]")
    elif v.codecs:  # a handler that names only its compressors
        extras.append(f"codecs={'+'.join(v.codecs)}")
    if not v.checksum:
        extras.append("no checksum")
    if v.sharding and v.sharding.get("type") == "named":
        extras.append(f"mesh={v.sharding.get('mesh')} spec={v.sharding.get('spec')}")
        types = v.sharding.get("axis_types") or []
        if any(t != "Auto" for t in types):
            extras.append(f"axis_types=[{', '.join(map(str, types))}]")
    elif v.sharding and v.sharding.get("type"):
        extras.append(f"sharding={v.sharding.get('type')}")
    return extras


def _stored_leaf(v: Any) -> tuple[str, int] | None:
    if not isinstance(v, ARRAYS):
        return None
    name = v.dtype if isinstance(v.dtype, str) else v.dtype.name  # an ArrayRecord's: its name
    dtype = "prng_key" if v.handler == "prng_key" else name
    return f"{dtype}{list(v.shape)} {human_bytes(v.nbytes)}  ({', '.join(_layout(v))})", v.nbytes


def tree_lines(node: Any, indent: str, describe: Describe, totals: dict[str, int]) -> list[str]:
    """One line per node of ``node``: containers as ``name/``, arrays by ``describe``,
    inline leaves by their type (a value's: its repr too); ``totals`` counts them."""
    items: list[tuple[str, Any]]
    if isinstance(node, dict):
        items = [(str(k), v) for k, v in node.items()]
    elif isinstance(node, list | tuple):
        items = [(f"[{i}]", v) for i, v in enumerate(node)]
    else:
        items = [("<root>", node)]
    out: list[str] = []
    for name, v in items:
        leaf = describe(v)
        if leaf is not None:
            totals["bytes"] += leaf[1]
            totals["arrays"] += 1
            out.append(f"{indent}{name}: {leaf[0]}")
        elif isinstance(v, dict | list | tuple):
            out.append(f"{indent}{name}/")
            out += tree_lines(v, indent + "  ", describe, totals)
        else:
            text = v.__name__ if isinstance(v, type) else f"{type(v).__name__} {v!r}"[:80]
            out.append(f"{indent}{name}: {text}")
            totals["inline"] += 1
    return out


def _trees(trees: dict[str, Any], describe: Describe, totals: dict[str, int]) -> list[str]:
    """The ``tree:`` section (the ``pytree`` unit) and one per other pytree unit."""
    out: list[str] = []
    for name, tree in trees.items():
        out.append("tree:" if name == PYTREE else f"unit {name}:")
        out += tree_lines(tree, "  ", describe, totals)
    return out


def _totals() -> dict[str, int]:
    return {"bytes": 0, "arrays": 0, "inline": 0}


# ----------------------------------------------------------------------------- kinds
def _checkpoint(url: str, so: dict[str, Any] | None, as_json: bool) -> int:
    doc = _io.submit(_metadata.record(url, so)).result()
    if as_json:
        print(json.dumps({k: v for k, v in doc.items() if not k.startswith("_")}, indent=2))
        return EXIT_OK
    trees = _metadata.unit_trees(url, doc, as_records=True)
    totals = _totals()
    lines = _trees(trees, _stored_leaf, totals)
    print(f"checkpoint {url}")
    print(
        f"  format v{doc['version']}, written by quire {doc.get('library_version', '')}, "
        f"{doc['process_count']} process(es), created {doc['_created'].isoformat()}"
    )
    print(f"  {summary(counts(list(trees.values())))}, {totals['inline']} inline leaves")
    lent = borrowed_of(doc.get("indexes"))
    if lent:  # an incremental step (quire._format.borrow)
        own, b = _io.submit(ownership(open_backend(url, so), url, doc)).result()
        print(
            f"  incremental: owns {human_bytes(own)}, borrows {human_bytes(b)} "
            f"from {len(lent)} pack(s) of earlier steps"
        )
    units = []
    for n, unit in doc["units"].items():
        if n == PYTREE:
            continue
        per = f", per process: {unit['processes']}" if "processes" in unit else ""
        units.append(f"{n} ({unit.get('handler', unit['kind'])}{per})")  # per JAX process
    if units:
        print("  units: " + ", ".join(units))
    if doc["metadata"]:
        print("  metadata: " + json.dumps(doc["metadata"], sort_keys=True))
    print("\n".join(lines))
    return EXIT_OK


def _partial(url: str, so: dict[str, Any] | None, as_json: bool, versions: int) -> int:
    from quire._engine import journal as _journal  # JAX: only a partial save needs it
    from quire._engine.verify import stored

    if as_json:  # the journal's records, as stored
        records = _io.submit(_journal.read_records(open_backend(url, so), url)).result()
        print(json.dumps([{k: v for k, v in r.items() if not k.startswith("_")}
                          for r in records], indent=2, default=str))  # fmt: skip
        return EXIT_OK
    what = _io.submit(stored(url, so)).result()
    totals = _totals()
    lines = _trees(what.trees, _stored_leaf, totals)
    print(f"partial save {url} (not finalized: journal at version {versions})")
    print(f"  {summary(counts(list(what.trees.values())))}, {totals['inline']} inline leaves")
    if what.custom:
        print("  metadata: " + json.dumps(what.custom, sort_keys=True, default=str))
    print("\n".join(lines))
    return EXIT_OK


def _source(url: str, so: dict[str, Any] | None, as_json: bool) -> int:
    from quire._sources.lazy import LazyValue
    from quire._sources.opening import open as open_source

    def lazy(v: Any) -> tuple[str, int] | None:
        if not isinstance(v, LazyValue):
            return None
        return f"{v.dtype.name}{list(v.shape)} {human_bytes(v.nbytes)}", int(v.nbytes)

    with open_source(url, **(so or {})) as src:
        if as_json:
            leaves = {
                k: {"shape": list(v.shape), "dtype": v.dtype.name, "nbytes": int(v.nbytes)}
                if isinstance(v, LazyValue)
                else {"value": v}
                for k, v in src.leaves()
            }
            doc = {"format": src.format, "url": src.url, "metadata": src.metadata}
            print(json.dumps({**doc, "leaves": leaves}, indent=2, default=repr))
            return EXIT_OK
        totals = _totals()
        lines = tree_lines(src.tree, "  ", lazy, totals)
        print(f"{src.format} checkpoint {src.url}")
        print(
            f"  {totals['arrays']} arrays, {human_bytes(totals['bytes'])}, "
            f"{totals['inline']} inline leaves"
        )
        if src.metadata:
            print("  metadata: " + json.dumps(src.metadata, sort_keys=True, default=repr))
        print("tree:")
        print("\n".join(lines))
    return EXIT_OK


def cmd_info(args: argparse.Namespace) -> int:
    so = storage_options(args)
    t = target(args.url, so)
    one_checkpoint(t, lambda u: f"quire info {u}", partial_ok=True)
    if t.kind == "checkpoint":
        return _checkpoint(t.url, so, args.json)
    if t.kind == "partial":
        return _partial(t.url, so, args.json, t.versions)
    return _source(t.url, so, args.json)
