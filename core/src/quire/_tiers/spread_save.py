"""A local tier's save with several JAX processes: every process saves into its own root.

The processes save step S together, as one collective save (``quire._engine.commit.collective``,
one txid, the primary's decision), but each writes its packs and chunk index into its own
root (``<local>/process_<i>/<S>``), so the coordination keys come from a name shared by every
process (the Checkpointer's, not the per-process URL).  Order:

1. every process writes its data under ``d/<txid>/`` of its own root (``write_units``);
2. the processes exchange their chunk-index objects (small) through
   :func:`quire._runtime.collective.exchange` and each writes the others' next to its own,
   then syncs: every root holds every process's index, so the primary can build the record
   and any process can later check any process's packs against it;
3. the primary builds the commit record and commits it in its own root (the conditional
   create; an overwrite's compare-and-swap); the record's text is the outcome every other
   process hears;
4. every other process commits the identical record in its own root.

A step counts as a local tier step of the run only when every process's objects have a
holder (``quire._tiers.spread`` agrees on that through the key-value store):
a crash between 3 and 4 leaves some roots without the record, which restore treats as
those processes not holding the step.  A failure in 1 or 2 aborts the save on every process,
and each removes its own txid.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quire._engine import commit as _commit
from quire._engine.record_parts import build_record, unit_digests
from quire._engine.save import PreparedSave, write_units
from quire._format.chunkindex import index_key
from quire._runtime.collective import exchange
from quire._runtime.config import current
from quire._runtime.ioloop import run_blocking
from quire._store.base import Backend
from quire._store.url import open_backend
from quire.errors import MultiProcessError

__all__ = ["save_spread"]

_FAILED, _NONE, _INDEX = b"F", b"N", b"I"


async def _share_indexes(backend: Backend, url: str, prep: PreparedSave, failed: bool) -> None:
    """Step 2: every process's chunk index into every root (a failed process says so)."""
    coord = prep.coord
    payload = _FAILED if failed else _NONE
    if not failed and prep.index is not None:
        payload = _INDEX + await backend.get(index_key(prep.txid, coord.index))
    timeout = coord.timeout
    group = list(range(coord.count))
    rows = await run_blocking(exchange, f"{coord.key}/indexes", group, payload, timeout, url)
    bad = [p for p, row in zip(group, rows) if bytes(row[:1]) == _FAILED and p != coord.index]
    if bad:
        raise MultiProcessError(
            f"{url}: process(es) {', '.join(map(str, bad))} failed writing their part of this "
            "local tier save; nothing is committed"
        )
    for p, row in zip(group, rows):
        if p != coord.index and bytes(row[:1]) == _INDEX:
            await backend.put(index_key(prep.txid, p), [bytes(row[1:])])
    await backend.sync()


async def save_spread(
    url: str,
    prep: PreparedSave,
    *,
    metadata: Mapping[str, Any] | None,
    overwrite: bool,
    storage_options: dict[str, Any] | None = None,
    stats: dict[str, Any] | None = None,
) -> None:
    """Save ``prep`` into this process's own root ``url`` (see the module docstring)."""
    backend = open_backend(url, storage_options)
    coord = prep.coord
    if prep.layout != "packed":
        raise NotImplementedError(
            f"{url}: a multi-process local tier saves packed checkpoints only (format v2); "
            f'leave layout={current().layout!r} at its default "packed"'
        )

    async def work() -> dict[str, dict[str, Any]]:
        units: dict[str, dict[str, Any]] | None = None
        error: BaseException | None = None
        try:
            if not overwrite:
                await _commit.ensure_absent(
                    backend, url, "pass overwrite=True to replace it, or save to another URL"
                )
            units = await write_units(url, backend, prep, stats=stats)
        except Exception as e:
            error = e
        # Every process takes part in the exchange, failed or not: no one waits in vain.
        await _share_indexes(backend, url, prep, error is not None)
        if error is not None:
            raise error
        assert units is not None
        return units

    async def do_commit(units: dict[str, dict[str, Any]]) -> str:
        data = await build_record(backend, prep, units, metadata)
        await _commit.publish(backend, url, data, [prep.txid], overwrite=overwrite)
        return data.decode()

    try:
        text = await _commit.collective(
            coord,
            url,
            work,
            do_commit,
            lambda: _commit.drop_txids(backend, url, [prep.txid]),
            unit_digests,
        )
    except BaseException:
        if not coord.is_primary:  # the primary's clean-up ran inside the collective
            await _commit.drop_txids(backend, url, [prep.txid])
        raise
    if not coord.is_primary:
        raw = str(text).encode()  # the primary's record; publish checks it as a load would
        await _commit.publish(backend, url, raw, [prep.txid], overwrite=overwrite)
