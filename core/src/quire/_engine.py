"""Save, load and the commit protocol (DESIGN.md "Commit protocol").

A save walks the tree in the caller's thread (and, for ``save_async``, copies every
owned shard to host memory there), then runs the rest on quire's event loop:

1. every leaf handler writes its data under ``d/<txid>/`` (a fresh random id),
2. ``backend.sync()`` makes the data durable,
3. COMMIT: ``quire._commit.publish`` creates ``quire.json`` (or swaps it for
   ``overwrite=True``) and only then deletes the old checkpoint's data.

A crash before 3 leaves only unreferenced garbage under a fresh txid; a crash after 3
leaves the new checkpoint whole.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import numpy as np

from quire import _checkpointables, _commit, _format, _handlers, _registry
from quire._budget import ByteBudget
from quire._config import current
from quire._format import PYTREE
from quire._multihost import Coordinator, digest
from quire._paths import assign_locations, escape_component
from quire._tasks import gather_cancelling
from quire._tree import KeyPath, Node, from_json, keystr, to_json, walk
from quire._url import open_backend
from quire.backends import Backend
from quire.errors import (
    CheckpointChangedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    PluginError,
    QuireError,
    TreeMismatchError,
    UnsupportedLeafError,
)
from quire.handlers import LoadContext, LoadEntry, SaveContext, SaveEntry
from quire.metadata import CheckpointMetadata
from quire.options import StorageOptions, StorageSpec

log = logging.getLogger("quire")


def new_txid() -> str:
    return secrets.token_hex(8)


def process_layout() -> tuple[int, int, int]:
    """(process index, process count, primary process)."""
    return jax.process_index(), jax.process_count(), current().primary_process


# ----------------------------------------------------------------------------- saving
@dataclass
class PreparedSave:
    """Units walked and assigned to handlers, ready for the asynchronous part."""

    txid: str
    roots: dict[str, Node]  # pytree units
    groups: dict[str, list[tuple[Node, SaveEntry]]]  # leaf handler id -> leaves (all units)
    objects: dict[str, tuple[str, Any]]  # other units: name -> (checkpointable handler id, obj)
    order: list[str]  # unit names, in the caller's order
    coord: Coordinator
    index: dict[str, Any] | None = None  # format v2: this process's chunk-index entry
    layout: str = "packed"  # "packed" (format v2) or "chunks" (format v1)


def _is_leaf_value(x: Any) -> bool:
    return _handlers.for_value(x) is not None


def _storage_for(storage: StorageSpec, path: KeyPath, leaf: Any) -> StorageOptions:
    base = StorageOptions(checksum=current().checksum, codecs=current().codecs or None)
    if storage is None:
        return base
    if isinstance(storage, StorageOptions):
        return storage
    got = storage(path, leaf)
    if got is None:
        return base
    if not isinstance(got, StorageOptions):
        raise TypeError(
            f"the storage callable returned {type(got).__name__} for {keystr(path)!r}; "
            "return a quire.StorageOptions or None"
        )
    return got


def prepare_save(
    units: Mapping[str, Any],
    storage: StorageSpec,
    *,
    copy: bool,
    url: str,
    layout: str | None = None,
) -> PreparedSave:
    """Walk every unit, choose handlers, assign locations; copy to host when ``copy``.

    With several JAX processes this is a synchronisation point: the primary's txid is
    used everywhere.
    """
    cfg = current()
    coord = Coordinator(url, "save", primary=cfg.primary_process, timeout=cfg.timeout)
    txid = coord.agree_txid()
    roots: dict[str, Node] = {}
    objects: dict[str, tuple[str, Any]] = {}
    groups: dict[str, list[tuple[Node, SaveEntry]]] = collections.defaultdict(list)
    for name, obj in units.items():
        hid = _checkpointables.handler_for(obj) if name != PYTREE else None
        if hid is not None:
            h = _checkpointables.get(hid, url=url)
            objects[name] = (hid, _checkpointables.snapshot(h, obj) if copy else obj)
            continue
        root = walk(obj, _is_leaf_value, what=url if name == PYTREE else f"{url} unit {name!r}")
        roots[name] = root
        leaves = list(root.leaves())
        locs = assign_locations([n.path for n in leaves], f"d/{txid}/{escape_component(name)}")
        for node, loc in zip(leaves, locs):
            h = _handlers.for_value(node.value)
            if h is None:  # pragma: no cover - walk() only stops at handled leaves
                raise UnsupportedLeafError(f"{url}: no handler for leaf {keystr(node.path)!r}")
            entry = SaveEntry(
                node.path, node.value, _storage_for(storage, node.path, node.value), loc
            )
            groups[h.id].append((node, entry))
    if copy:
        for hid, items in groups.items():
            snap = _handlers.get(hid).snapshot([e for _, e in items])
            groups[hid] = [(n, e) for (n, _), e in zip(items, snap)]
    if layout not in (None, "packed", "chunks"):
        raise ValueError(f'layout must be "packed" or "chunks", got {layout!r}')
    return PreparedSave(
        txid, roots, dict(groups), objects, list(units), coord, layout=layout or cfg.layout
    )


async def write_units(
    url: str,
    backend: Backend,
    prep: PreparedSave,
    *,
    stats: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Write every unit's data under ``d/<txid>/`` and make it durable; return the units'
    JSON records.  On failure, remove what was written and re-raise."""
    cfg = current()
    pidx, pcount, primary = process_layout()
    ctx = SaveContext(url, backend, prep.txid, pidx, pcount, primary, ByteBudget(cfg.byte_budget))
    ctx.limit = asyncio.Semaphore(max(1, cfg.max_concurrency))
    records: dict[int, dict[str, Any]] = {}
    unit_records: dict[str, dict[str, Any]] = {}
    sink = None
    if prep.layout == "packed":  # format v2: chunks go into this process's packs
        from quire._pack import PackWriter

        sink = PackWriter(backend, prep.txid, pidx, cfg.pack_bytes, cfg.byte_budget)
        ctx.backend = sink
    try:
        for hid, items in prep.groups.items():
            h = _handlers.get(hid, url=url)
            try:
                recs = await h.save([e for _, e in items], ctx)
            except Exception as e:
                wrapped = _handlers.wrap_failure(
                    h, e, [keystr(x.path) for _, x in items], url, "saving"
                )
                if wrapped is e:
                    raise
                raise wrapped from e
            for (node, _), rec in zip(items, recs):
                if rec.get("handler") != hid:
                    rec = {**rec, "handler": hid}
                records[id(node)] = rec
        for name, (hid, obj) in prep.objects.items():
            unit_records[name] = await _checkpointables.save_unit(
                hid, obj, backend, f"d/{prep.txid}/{escape_component(name)}", url, ctx
            )
        if sink is not None:
            prep.index = await sink.finish()
            ctx.stats["objects"] = sink.packs + 1
        await backend.sync()
    except BaseException:
        if sink is not None:
            await sink.abort()
        # Nothing references this txid; remove what we wrote (GC would, later).  With
        # several processes the primary cleans up once every process has stopped.
        if not prep.coord.active:
            await _commit.drop_txids(backend, url, [prep.txid])
        raise
    if stats is not None:
        stats.update(ctx.stats)
        stats["budget_peak"] = ctx.budget.peak if ctx.budget else 0
    units: dict[str, dict[str, Any]] = {}
    for name in prep.order:
        if name in prep.roots:
            units[name] = {
                "kind": "pytree",
                "tree": to_json(prep.roots[name], lambda n: records[id(n)]),
            }
        else:
            units[name] = unit_records[name]
    return units


async def save_prepared(
    url: str,
    prep: PreparedSave,
    *,
    metadata: Mapping[str, Any] | None,
    overwrite: bool,
    storage_options: dict[str, Any] | None = None,
    stats: dict[str, Any] | None = None,
) -> None:
    backend = open_backend(url, storage_options)
    coord = prep.coord

    async def work() -> dict[str, dict[str, Any]]:
        if not overwrite:
            await _commit.ensure_absent(
                backend, url, "pass overwrite=True to replace it, or save to another URL"
            )
        return await write_units(url, backend, prep, stats=stats)

    async def do_commit(units: dict[str, dict[str, Any]]) -> None:
        data = _format.build(
            units=units,
            txids=[prep.txid],
            metadata=dict(metadata or {}),
            process_count=coord.count,
            extra={"plugins": plugin_sources(units)},
            indexes=await index_entries(backend, prep, coord.count),
        )
        await _commit.publish(backend, url, data, [prep.txid], overwrite=overwrite, coord=coord)

    await _commit.collective(
        coord,
        url,
        work,
        do_commit,
        lambda: _commit.drop_txids(backend, url, [prep.txid]),
        unit_digests,
    )


async def index_entries(
    backend: Backend, prep: PreparedSave, count: int
) -> list[dict[str, Any]] | None:
    """Format v2: the commit record's ``indexes`` (every process's chunk index)."""
    if prep.layout != "packed":
        return None
    from quire._pack import gather_entries

    return await gather_entries(backend, prep.txid, count, prep.index, jax.process_index())


def packed_view(backend: Backend, url: str, doc: Mapping[str, Any]) -> Backend:
    """A backend that reads format-v2 chunks out of packs (``backend`` itself for v1)."""
    from quire._chunkindex import reader

    return reader(backend, url, doc.get("indexes"), jax.process_index())


def plugin_sources(units: Mapping[str, dict[str, Any]]) -> dict[str, str]:
    """``{"group:id": distribution}`` for every third-party plugin the units need, so that
    a reader lacking one is told which package to install."""
    wanted: set[tuple[str, str]] = set()
    for unit in units.values():
        if unit["kind"] == "handler":
            wanted.add(("quire.checkpointables", unit["handler"]))
        elif unit["kind"] == "pytree":
            for leaf in from_json(unit["tree"]).leaves():
                wanted.add(("quire.leaf_handlers", leaf.value["handler"]))
                for c in leaf.value.get("codecs", []):
                    if isinstance(c, dict) and isinstance(c.get("name"), str):
                        wanted.add(("quire.codecs", c["name"]))
    out = {}
    for group, name in sorted(wanted):
        try:
            dist = _registry.registries[group].distribution(name)
        except Exception:
            dist = None
        if dist and dist.lower() != "quire":
            out[f"{group}:{name}"] = dist
    return out


def unit_digests(units: Mapping[str, dict[str, Any]]) -> dict[str, str]:
    """A digest per leaf record (and per JSON unit): what every process must agree on."""
    out: dict[str, str] = {}
    for name, unit in units.items():
        if unit["kind"] == "pytree":
            for leaf in from_json(unit["tree"]).leaves():
                out[f"{name}:{keystr(leaf.path)}"] = digest(leaf.value)
            out[f"{name}:<structure>"] = digest(_structure(unit["tree"]))
        elif unit["kind"] == "json":
            out[name] = digest(unit["value"])
    return out


def _structure(node: dict[str, Any]) -> Any:
    if node["kind"] == "leaf":
        return None
    return [node["kind"], node.get("keys"), [_structure(c) for c in node["children"]]]


# ----------------------------------------------------------------------------- loading
def _is_abstract_leaf(x: Any) -> bool:
    if x is None or isinstance(x, type):
        return True
    if isinstance(x, jax.ShapeDtypeStruct | jax.Array | np.ndarray | np.generic):
        return True
    if type(x) in (bool, int, float, complex, str, bytes):
        return True
    return _handlers.for_value(x) is not None


def _diff_message(url: str, missing: list[str], extra: list[str], bad: list[str]) -> str:
    lines = [f"checkpoint {url} does not match the target tree:"]
    if missing:
        lines.append(
            f"  in the checkpoint, missing from the target ({len(missing)}): " + ", ".join(missing)
        )
    if extra:
        lines.append(
            f"  in the target, missing from the checkpoint ({len(extra)}): " + ", ".join(extra)
        )
    if bad:
        lines.append(f"  mismatched ({len(bad)}): " + "; ".join(bad))
    fix = "fix the abstract tree"
    if missing and not extra and not bad:
        fix = "pass partial=True to load only the keys in the target, or " + fix
    lines.append(f"  To fix: {fix}.")
    return "\n".join(lines)


def pytree_unit(doc: dict[str, Any], url: str, name: str = PYTREE) -> dict[str, Any]:
    """The JSON tree of pytree unit ``name``; a clear error when it is not there."""
    unit = doc["units"].get(name)
    if unit is None or unit.get("kind") != "pytree":
        have = ", ".join(f"{k!r} ({v.get('kind')})" for k, v in doc["units"].items()) or "none"
        raise CheckpointNotFoundError(
            f"checkpoint {url} has no pytree unit {name!r} (units: {have}); "
            "use quire.load_checkpointables(url) to load its units"
        )
    tree: dict[str, Any] = unit["tree"]
    return tree


async def load_doc(
    url: str,
    doc: dict[str, Any],
    backend: Backend,
    abstract: Any,
    *,
    partial: bool,
    unit: str = PYTREE,
) -> Any:
    return await load_tree(
        url,
        pytree_unit(doc, url, unit),
        packed_view(backend, url, doc),
        abstract,
        partial=partial,
        plugins=doc.get("plugins"),
    )


async def load_tree(
    url: str,
    tree_json: dict[str, Any],
    backend: Backend,
    abstract: Any,
    *,
    partial: bool,
    plugins: Mapping[str, str] | None = None,
) -> Any:
    try:
        return await _load_tree(url, tree_json, backend, abstract, partial=partial)
    except PluginError as e:
        # Name the package that wrote the missing plugin's data, when the record says.
        hinted = _registry.record_hint(e, plugins)
        if hinted is e:
            raise
        raise hinted from e


async def _load_tree(
    url: str,
    tree_json: dict[str, Any],
    backend: Backend,
    abstract: Any,
    *,
    partial: bool,
) -> Any:
    saved = from_json(tree_json)
    saved_leaves = {leaf.path: leaf for leaf in saved.leaves()}
    if abstract is None:
        target_root = saved
        pairs = [(leaf, leaf.value, None) for leaf in saved.leaves()]
    else:
        target_root = walk(abstract, _is_abstract_leaf, what="abstract tree")
        tleaves = list(target_root.leaves())
        tpaths = {t.path for t in tleaves}
        missing = [] if partial else [keystr(p) for p in saved_leaves if p not in tpaths]
        extra = [keystr(t.path) for t in tleaves if t.path not in saved_leaves]
        pairs = [
            (t, saved_leaves[t.path].value, t.value) for t in tleaves if t.path in saved_leaves
        ]
        handler_cache: dict[str, Any] = {}
        bad = []
        for t, rec, target in pairs:
            h = handler_cache.get(rec["handler"]) or _handlers.get(rec["handler"], url=url)
            handler_cache[rec["handler"]] = h
            why = h.check(LoadEntry(t.path, rec, target))
            if why:
                bad.append(f"{keystr(t.path)!r}: {why}")
        if missing or extra or bad:
            raise TreeMismatchError(
                _diff_message(url, missing, extra, bad),
                missing=missing,
                extra=extra,
                mismatched=bad,
            )
    ctx = LoadContext(url, backend, jax.process_index(), jax.process_count())
    ctx.limit = asyncio.Semaphore(max(1, current().max_concurrency))
    ctx.budget = ByteBudget(current().byte_budget)
    groups: dict[str, list[tuple[Node, LoadEntry]]] = collections.defaultdict(list)
    for node, rec, target in pairs:
        groups[rec["handler"]].append((node, LoadEntry(node.path, rec, target)))
    values: dict[int, Any] = {}

    async def run(hid: str, items: list[tuple[Node, LoadEntry]]) -> None:
        h = _handlers.get(hid, url=url)
        try:
            got = await h.load([e for _, e in items], ctx)
        except Exception as e:
            wrapped = _handlers.wrap_failure(
                h, e, [keystr(x.path) for _, x in items], url, "loading"
            )
            if wrapped is e:
                raise
            raise wrapped from e
        for (node, _), v in zip(items, got):
            values[id(node)] = v

    await gather_cancelling(*(run(h, items) for h, items in groups.items()))
    if abstract is None:
        return _rebuild_saved(saved, values)
    return target_root.rebuild(lambda n: values[id(n)])


def _rebuild_saved(node: Node, values: dict[int, Any]) -> Any:
    if node.kind == "leaf":
        return values[id(node)]
    kids = [_rebuild_saved(c, values) for c in node.children]
    if node.kind == "dict":
        return dict(zip(node.keys, kids))
    if node.kind == "tuple" and node.typename is None:
        return tuple(kids)
    return kids


async def load(
    url: str, abstract: Any, *, partial: bool, storage_options: dict[str, Any] | None = None
) -> Any:
    backend = open_backend(url, storage_options)

    async def attempt(doc: dict[str, Any]) -> Any:
        return await load_doc(url, doc, backend, abstract, partial=partial)

    return await _reloading(backend, url, attempt)


T = TypeVar("T")
MAX_RELOADS = 3  # loads retried when the checkpoint was overwritten under them


def _same_record(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in ("checksum", "txids", "created"))


async def _reloading(
    backend: Backend, url: str, attempt: Callable[[dict[str, Any]], Awaitable[T]]
) -> T:
    """Run ``attempt`` on the current record; when it finds data missing or damaged and
    ``quire.json`` has changed meanwhile (an overwrite deleted the old data), re-read the
    record and retry, at most MAX_RELOADS times, then raise CheckpointChangedError."""
    for n in range(MAX_RELOADS + 1):
        doc = (await _commit.read(backend, url)).doc
        try:
            return await attempt(doc)
        except CorruptCheckpointError as e:
            try:
                now = (await _commit.read(backend, url)).doc
            except CheckpointNotFoundError:
                raise CheckpointNotFoundError(
                    f"the checkpoint at {url} was deleted while it was being loaded"
                ) from e
            if _same_record(doc, now):
                raise  # the record did not change: the data is really damaged
            if n == MAX_RELOADS:
                raise CheckpointChangedError(
                    f"the checkpoint at {url} was overwritten {n + 1} times while it was being "
                    "loaded; nothing is damaged: load it again once its writer is done"
                ) from e
            log.info("%s was overwritten during the load; reading the new version", url)
    raise AssertionError("unreachable")  # pragma: no cover


# ----------------------------------------------------------------------------- metadata
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


def metadata_tree(url: str, tree_json: dict[str, Any]) -> Any:
    saved = from_json(tree_json)
    by_handler: dict[str, list[Node]] = collections.defaultdict(list)
    for leaf in saved.leaves():
        by_handler[leaf.value["handler"]].append(leaf)
    metas: dict[int, Any] = {}
    for hid, leaves in by_handler.items():
        try:
            h = _handlers.get(hid, url=url)
            ms = h.metadata([leaf.value for leaf in leaves])
        except QuireError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(
                f"{url}/quire.json: malformed {hid!r} leaf record: {e!r}"
            ) from e
        for leaf, m in zip(leaves, ms):
            metas[id(leaf)] = m
    return _rebuild_saved(saved, metas)


async def load_units(
    url: str,
    targets: Mapping[str, Any] | None,
    *,
    partial: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load the named units (all when ``targets`` is None); each target is an abstract tree
    for pytree units, or the object / None for other units."""
    backend = open_backend(url, storage_options)
    return await _reloading(
        backend, url, lambda doc: _load_units(url, doc, backend, targets, partial=partial)
    )


async def _load_units(
    url: str,
    doc: dict[str, Any],
    backend: Backend,
    targets: Mapping[str, Any] | None,
    *,
    partial: bool,
) -> dict[str, Any]:
    backend = packed_view(backend, url, doc)
    units = doc["units"]
    names = list(units) if targets is None else list(targets)
    missing = [n for n in names if n not in units]
    if missing:
        raise TreeMismatchError(
            f"checkpoint {url} has no unit(s) {', '.join(map(repr, missing))} "
            f"(it has {', '.join(map(repr, units)) or 'none'}); fix the names you ask for",
            extra=missing,
        )
    out: dict[str, Any] = {}

    async def one(name: str) -> None:
        unit = units[name]
        target = None if targets is None else targets[name]
        if unit["kind"] == "pytree":
            out[name] = await load_tree(
                url, unit["tree"], backend, target, partial=partial, plugins=doc.get("plugins")
            )
        else:
            try:
                out[name] = await _checkpointables.load_unit(unit, backend, url, target)
            except PluginError as e:
                hinted = _registry.record_hint(e, doc.get("plugins"))
                if hinted is e:
                    raise
                raise hinted from e

    await asyncio.gather(*(one(n) for n in names))
    return {n: out[n] for n in names}


async def metadata(url: str, storage_options: dict[str, Any] | None = None) -> CheckpointMetadata:
    backend = open_backend(url, storage_options)
    doc = (await _commit.read(backend, url)).doc
    return metadata_from_doc(url, doc)


# ----------------------------------------------------------------------------- verify
@dataclass(frozen=True)
class VerifyProblem:
    path: str
    object: str
    error: str


async def verify(
    url: str,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[int, list[VerifyProblem]]:
    """Have every leaf's handler check every object it owns; (objects checked, problems)."""
    from quire._owned import verify_leaves

    backend = open_backend(url, storage_options)
    doc = (await _commit.read(backend, url)).doc
    backend = packed_view(backend, url, doc)
    all_leaves = []
    for unit in doc["units"].values():
        if unit["kind"] == "pytree":
            saved = from_json(unit["tree"])
            all_leaves += list(saved.leaves())
    checked, found = await verify_leaves(url, backend, all_leaves, progress)
    return checked, [VerifyProblem(keystr(p.path), p.key, p.error) for p in found]
