"""What a save's commit record holds beside its trees: every process's records of the
per-process units and its chunk-index entry (format v2, ``indexes``), which the processes
other than the primary :func:`share` through the key-value store; the third-party plugins a
reader needs (``plugins``); and the digests every process must agree on before the commit
(``quire._engine.commit.collective``).  Save, the partial-save journal, a spread save
(``quire._tiers.spread_save``) and a promotion build their records here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from quire._format import record as _records
from quire._format.bounds import is_distribution_name
from quire._format.chunkindex import check_entries
from quire._format.tree import from_json, keystr
from quire._handlers import codecs as _codecs
from quire._handlers import unit_ops as _checkpointables
from quire._runtime import registry as _registry
from quire._runtime.multihost import Coordinator, digest
from quire._store.base import Backend
from quire.errors import CorruptCheckpointError, MultiProcessError

if TYPE_CHECKING:
    from quire._engine.save import PreparedSave

__all__ = [
    "build_record",
    "index_entries",
    "plugin_sources",
    "prepared_indexes",
    "share",
    "shared",
    "unit_digests",
]


async def share(coord: Coordinator, units: Mapping[str, dict[str, Any]], index: Any) -> None:
    """A process other than the primary, its writes done and before it reports so: what
    the primary's commit record needs of it, through the key-value store: its records of
    the per-process units and its chunk-index entry (``index``; None: it owned no chunk).
    The primary reads each index object once, when the commit checks that every chunk is
    in one (``quire._engine.completeness``), not also to describe it."""
    if coord.active and not coord.is_primary:
        await coord.share({"records": _checkpointables.own_records(coord, units), "index": index})


async def shared(coord: Coordinator) -> dict[int, Any]:
    """The primary, once every process reported its writes done: what each other process
    published with :func:`share` (nothing with one process)."""
    return await coord.shared() if coord.active else {}


def index_entries(
    coord: Coordinator, txid: str, own: dict[str, Any] | None, got: Mapping[int, Any], url: str
) -> list[dict[str, Any]] | None:
    """Format v2: the commit record's ``indexes``: this process's entry ``own`` and the
    others' from ``got`` (:func:`shared`), in process order; None when no process owned a
    chunk.  ``MultiProcessError`` for a process that shared none, or one of another save."""
    out = []
    for p in range(coord.count):
        if p == coord.index:
            given = own
        else:
            value = got.get(p)
            if not isinstance(value, Mapping) or "index" not in value:
                raise MultiProcessError(
                    f"{url}: process {p} reported its writes done without its chunk-index "
                    "entry; nothing is committed"
                )
            given = value["index"]
        if given is None:  # a process that owned no chunk wrote no index
            continue
        try:
            (entry,) = check_entries([given], url)
        except CorruptCheckpointError:
            entry = None
        if entry is None or entry["txid"] != txid or entry["process"] != p:
            raise MultiProcessError(
                f"{url}: process {p} shared a chunk-index entry that is not one of process "
                f"{p}'s for this save ({str(given)[:200]!r}); nothing is committed"
            )
        out.append(entry)
    return out or None


def _indexes_of(
    prep: PreparedSave, got: Mapping[int, Any], url: str
) -> list[dict[str, Any]] | None:
    """The ``indexes`` of ``prep``'s commit record (None: format v1, or no chunk)."""
    if prep.layout != "packed":
        return None
    return index_entries(prep.coord, prep.txid, prep.index, got, url)


async def prepared_indexes(prep: PreparedSave, url: str) -> list[dict[str, Any]] | None:
    """The ``indexes`` of ``prep``'s commit record, with what the others shared (the
    partial-save journal's version record)."""
    return _indexes_of(prep, await shared(prep.coord), url)


async def build_record(
    backend: Backend,
    prep: PreparedSave,
    units: dict[str, dict[str, Any]],
    metadata: Mapping[str, Any] | None,
) -> bytes:
    """The commit record of ``prep``'s save: its units (every process's records of the
    per-process ones), txid, metadata, the plugins it needs and (format v2) every process's
    chunk index."""
    url = backend.url
    got = await shared(prep.coord)
    records = {p: v.get("records") for p, v in got.items() if isinstance(v, Mapping)}
    units = _checkpointables.gather_records(prep.coord, units, url, records)
    return _records.build(
        units=units,
        txids=[prep.txid],
        metadata=dict(metadata or {}),
        process_count=prep.coord.count,
        extra={"plugins": plugin_sources(units)},
        indexes=_indexes_of(prep, got, url),
    )


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
            if group == "quire.codecs":  # a quire.codecs plugin, or a codec zarr knows
                dist = _codecs.distribution(name)
            else:
                dist = _registry.registries[group].distribution(name)
        except Exception:
            dist = None
        if dist and dist.lower() != "quire" and is_distribution_name(dist):
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
    return out | _checkpointables.per_process_digests(units)


def _structure(node: dict[str, Any]) -> Any:
    if node["kind"] == "leaf":
        return None
    return [node["kind"], node.get("keys"), [_structure(c) for c in node["children"]]]
