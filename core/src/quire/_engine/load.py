"""Load: the read side of a checkpoint (the write side is ``quire._engine.save``; what
``quire.metadata`` reads is ``quire._engine.metadata``, verify ``quire._engine.verify``)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import jax

from quire._engine import commit as _commit
from quire._engine.metadata import rebuild_saved
from quire._engine.pairing import pair_with_target, sharding_misfit
from quire._engine.shared_reads import plan_shared, prefetch_shared
from quire._format import packedreader as _packedreader
from quire._format.record import PYTREE
from quire._format.tree import Node, from_json
from quire._handlers import select as _selection
from quire._handlers import unit_ops as _checkpointables
from quire._handlers.base import LoadContext, LoadEntry
from quire._handlers.casting import CastingSpec, check_spec, stored_dtype
from quire._handlers.meshes import Placer
from quire._runtime import registry as _registry
from quire._runtime.budget import ByteBudget
from quire._runtime.config import current
from quire._runtime.tasks import gather_cancelling
from quire._store.base import Backend
from quire._store.url import open_backend
from quire.errors import (
    CheckpointChangedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    PluginError,
    TreeMismatchError,
)

log = logging.getLogger("quire")


def packed_view(backend: Backend, url: str, doc: Mapping[str, Any]) -> Backend:
    """A backend that reads format-v2 chunks out of packs (``backend`` itself for v1)."""
    return _packedreader.reader(
        backend, url, doc.get("indexes"), jax.process_index(), doc.get("txids")
    )


async def read_for_data(
    url: str, storage_options: dict[str, Any] | None
) -> tuple[dict[str, Any], Backend]:
    """The checked commit record at ``url`` and the backend to read its data through
    (:func:`packed_view`: format-v2 chunks come out of packs)."""
    backend = open_backend(url, storage_options)
    doc = (await _commit.read(backend, url)).doc
    return doc, packed_view(backend, url, doc)


# ----------------------------------------------------------------------------- loading
def pytree_unit(doc: dict[str, Any], url: str, name: str = PYTREE) -> dict[str, Any]:
    """The JSON tree of pytree unit ``name``; a clear error when it is not there.

    A checkpoint of named units (``quire.save_checkpointables``, ``Checkpointer.save(...,
    units=...)``) has no unit ``"pytree"``: when it holds exactly one unit and that unit is a
    pytree, that unit is the tree (nothing else would be left behind); with several, the
    error names the call that loads them, with their names.
    """
    units = doc["units"]
    unit = units.get(name)
    if unit is None and name == PYTREE and len(units) == 1:
        unit = next(iter(units.values()))
    if unit is None or unit.get("kind") != "pytree":
        have = ", ".join(f"{k!r} ({v.get('kind')})" for k, v in units.items()) or "none"
        targets = ", ".join(
            f"{k!r}: {'target' if v.get('kind') == 'pytree' else 'None'}" for k, v in units.items()
        )
        raise CheckpointNotFoundError(
            f"checkpoint {url} has no pytree unit {name!r}: it holds named units ({have}). "
            f"Load them with quire.load_checkpointables(url, {{{targets}}}), or "
            f"Checkpointer.load_checkpointables(step, {{...}}) for a Checkpointer's step "
            "(a None target: the unit as saved)"
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
    casting: CastingSpec = None,
) -> Any:
    return await load_tree(
        url,
        pytree_unit(doc, url, unit),
        packed_view(backend, url, doc),
        abstract,
        partial=partial,
        plugins=doc.get("plugins"),
        casting=casting,
    )


async def load_tree(
    url: str,
    tree_json: dict[str, Any],
    backend: Backend,
    abstract: Any,
    *,
    partial: bool,
    plugins: Mapping[str, str] | None = None,
    casting: CastingSpec = None,
) -> Any:
    try:
        return await _load_tree(url, tree_json, backend, abstract, partial=partial, casting=casting)
    except PluginError as e:
        # Name the package that wrote the missing plugin's data, when the record says.
        hinted = _registry.record_hint(e, plugins)
        if hinted is e:
            raise
        raise hinted from e


def _is_none(rec: Any) -> bool:
    return bool(rec.get("handler") == "none")


async def _load_tree(
    url: str,
    tree_json: dict[str, Any],
    backend: Backend,
    abstract: Any,
    *,
    partial: bool,
    casting: CastingSpec,
) -> Any:
    saved = from_json(tree_json)
    if abstract is None:
        pairs = [(leaf, leaf.value, None, "same_kind") for leaf in saved.leaves()]
    else:
        handler_cache: dict[str, Any] = {}
        # Targets on an abstract mesh (jax.eval_shape of a sharded state) made concrete.
        placer = Placer(leaf.value.get("sharding") for leaf in saved.leaves())
        placed: dict[int, Any] = {}

        def check(t: Node, rec: Any) -> str | None:
            target, why = placer.target(t.value)
            if why is not None:
                return why
            placed[id(t)] = target
            h = handler_cache.get(rec["handler"]) or _selection.get(rec["handler"], url=url)
            handler_cache[rec["handler"]] = h
            why = h.check(LoadEntry(t.path, rec, target))
            if why is None and not isinstance(target, type):
                why = sharding_misfit(
                    getattr(target, "sharding", None), getattr(target, "shape", None)
                )
            return why

        pairing = pair_with_target(
            saved,
            abstract,
            partial=partial,
            check=check,
            subject=f"checkpoint {url}",
            is_empty=_is_none,
            casting=casting,
            dtype_of=stored_dtype,
        )
        pairs = [
            (n, rec, placed.get(id(n), target), pairing.casting(n))
            for n, rec, target in pairing.pairs
        ]
    cfg = current()
    shared = cfg.replica_reads
    if shared is None:  # on where reading costs more than exchanging: object stores
        shared = url.split("://", 1)[0] not in ("file", "local", "memory") and "://" in url
    if shared and jax.process_count() > 1:
        # chunks several processes need: each read once, then exchanged
        plan = plan_shared(((rec, target) for _, rec, target, _ in pairs), url)
        if plan and sum(it[3] for it in plan) >= cfg.replica_read_min_bytes:
            backend = await prefetch_shared(url, backend, plan)
    expect = getattr(backend, "expect", None)  # format v2: plan large pack reads
    if expect is not None and jax.process_count() == 1:
        expect(rec.get("location") for _, rec, _, _ in pairs)
    ctx = LoadContext(url, backend, jax.process_index(), jax.process_count())
    ctx.limit = asyncio.Semaphore(max(1, current().max_concurrency))
    ctx.budget = ByteBudget(current().byte_budget)
    groups: dict[str, list[tuple[Node, LoadEntry]]] = collections.defaultdict(list)
    for node, rec, target, how in pairs:
        groups[rec["handler"]].append((node, LoadEntry(node.path, rec, target, casting=how)))
    values: dict[int, Any] = {}

    async def run(hid: str, items: list[tuple[Node, LoadEntry]]) -> None:
        h = _selection.get(hid, url=url)
        entries = [e for _, e in items]
        with _selection.failures_named(h, entries, url, "loading"):
            got = await h.load(entries, ctx)
        for (node, _), v in zip(items, got):
            values[id(node)] = v

    await gather_cancelling(*(run(h, items) for h, items in groups.items()))
    if abstract is None:
        return rebuild_saved(saved, values)
    return pairing.rebuild(values)


async def load(
    url: str,
    abstract: Any,
    *,
    partial: bool,
    storage_options: dict[str, Any] | None = None,
    casting: CastingSpec = None,
) -> Any:
    check_spec(casting)
    backend = open_backend(url, storage_options)

    async def attempt(doc: dict[str, Any]) -> Any:
        return await load_doc(url, doc, backend, abstract, partial=partial, casting=casting)

    with keeping_open(backend):
        return await _reloading(backend, url, attempt)


def keeping_open(backend: Backend) -> contextlib.AbstractContextManager[Any]:
    """The backend's ``keep_open()`` scope where it has one (local disks: each pack is
    opened once per load), else nothing."""
    keep = getattr(backend, "keep_open", None)
    return keep() if callable(keep) else contextlib.nullcontext()


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


async def load_units(
    url: str,
    targets: Mapping[str, Any] | None,
    *,
    partial: bool = False,
    storage_options: dict[str, Any] | None = None,
    casting: CastingSpec = None,
) -> dict[str, Any]:
    """Load the named units (all when ``targets`` is None); each target is an abstract tree
    for pytree units, or the object / None for other units."""
    check_spec(casting)
    backend = open_backend(url, storage_options)
    with keeping_open(backend):
        return await _reloading(
            backend,
            url,
            lambda doc: _load_units(url, doc, backend, targets, partial=partial, casting=casting),
        )


async def _load_units(
    url: str,
    doc: dict[str, Any],
    backend: Backend,
    targets: Mapping[str, Any] | None,
    *,
    partial: bool,
    casting: CastingSpec,
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
                url,
                unit["tree"],
                backend,
                target,
                partial=partial,
                plugins=doc.get("plugins"),
                casting=casting,
            )
        else:
            try:
                out[name] = await _checkpointables.load_unit(unit, backend, url, target, name)
            except PluginError as e:
                hinted = _registry.record_hint(e, doc.get("plugins"))
                if hinted is e:
                    raise
                raise hinted from e

    await gather_cancelling(*(one(n) for n in names))
    return {n: out[n] for n in names}
