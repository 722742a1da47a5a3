"""What a save's commit record holds beside its trees: the units every process gathered,
the third-party plugins a reader needs (``plugins``), every process's chunk index (format v2,
``indexes``), and the digests every process must agree on before the commit
(``quire._engine.commit.collective``).  Save, the partial-save journal and a spread save
(``quire._tiers.spread_save``) build their records here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax

from quire._format import record as _records
from quire._format.bounds import is_distribution_name
from quire._format.pack import gather_entries
from quire._format.tree import from_json, keystr
from quire._handlers import codecs as _codecs
from quire._handlers import unit_ops as _checkpointables
from quire._runtime import registry as _registry
from quire._runtime.multihost import digest
from quire._store.base import Backend

if TYPE_CHECKING:
    from quire._engine.save import PreparedSave

__all__ = ["build_record", "index_entries", "plugin_sources", "unit_digests"]


async def build_record(
    backend: Backend,
    prep: PreparedSave,
    units: dict[str, dict[str, Any]],
    metadata: Mapping[str, Any] | None,
) -> bytes:
    """The commit record of ``prep``'s save: its units, txid, metadata, the plugins it
    needs and (format v2) every process's chunk index."""
    units = await _checkpointables.gather_records(prep.coord, units, backend.url)
    return _records.build(
        units=units,
        txids=[prep.txid],
        metadata=dict(metadata or {}),
        process_count=prep.coord.count,
        extra={"plugins": plugin_sources(units)},
        indexes=await index_entries(backend, prep, prep.coord.count),
    )


async def index_entries(
    backend: Backend, prep: PreparedSave, count: int
) -> list[dict[str, Any]] | None:
    """Format v2: the commit record's ``indexes`` (every process's chunk index)."""
    if prep.layout != "packed":
        return None

    return await gather_entries(backend, prep.txid, count, prep.index, jax.process_index())


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
