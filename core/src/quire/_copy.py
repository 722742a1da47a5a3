"""``quire cp``: copy a committed checkpoint between any two backends.

Order (the commit protocol, as for a save):

1. read SRC's commit record ``quire.json`` (nothing else makes a checkpoint);
2. list what it references: each array leaf's ``zarr.json`` and every chunk of its grid,
   every object under each checkpointable unit's location;
3. copy those objects, at most ``max_concurrency`` at a time within ``byte_budget`` bytes,
   checking each chunk's crc32c (and size, and decodability) as it is read - a damaged
   source fails the copy and names the chunk - then ``sync`` DST;
4. COMMIT: ``quire._commit.publish`` writes the very same record at DST (a conditional
   create or, with ``overwrite``, a compare-and-swap over DST's record, after which DST's
   superseded data is deleted).

A crash leaves DST as it was, plus unreferenced objects under ``d/<txid>/`` that
``quire gc`` removes.  Data keeps its txids and locations, so the copy is byte-identical.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from quire import _commit, _format
from quire._budget import ByteBudget
from quire._config import current
from quire._io import run_blocking
from quire._paths import is_safe_location
from quire._text import human_bytes as _human
from quire._tree import from_json, keystr
from quire._url import normalize, open_backend
from quire.backends import Backend
from quire.errors import CorruptCheckpointError
from quire.handlers import StoredObject

__all__ = ["CopyResult", "copy_checkpoint"]

Progress = Callable[[int, int], None]  # (objects done, bytes done)


@dataclasses.dataclass(frozen=True)
class CopyResult:
    """What a copy did: objects and bytes written (the record included), chunks verified."""

    src: str
    dst: str
    objects: int
    bytes: int
    verified: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class _Item:
    """One object to copy: its key, what it belongs to, how to check it, a size estimate."""

    key: str
    owner: str
    check: Callable[[bytes], None] | None = None
    size: int | None = None


# ----------------------------------------------------------------------------- checks
def _check_unit_object(data: bytes) -> None:
    from quire._zarr import crc_bytes

    if len(data) < 4 or crc_bytes(data[:-4]) != data[-4:]:
        raise ValueError("crc32c checksum mismatch")


# ----------------------------------------------------------------------------- planning
def _range_checks(objs: list[StoredObject]) -> Callable[[bytes], None] | None:
    """One check of a whole object from the checks of the ranges leaves own in it."""
    checked = [o for o in objs if o.check is not None or o.length is not None]
    if not checked:
        return None

    def check(data: bytes) -> None:
        for o in checked:
            part = o.cut(data)
            if o.length is not None and len(part) != o.length:
                raise ValueError(f"{len(part)} bytes at {o.offset}, expected {o.length}")
            if o.check is not None:
                o.check(part)

    return check


async def plan(backend: Backend, url: str, doc: dict[str, Any]) -> list[_Item]:
    """Every object SRC's record references, with its check (leaves: their handlers')."""
    from quire._owned import leaf_objects

    items: list[_Item] = []
    listed: list[tuple[str, str, Callable[[bytes], None] | None]] = []
    leaves = []
    packed = {e["txid"] for e in doc.get("indexes", [])}
    checkers: dict[str, Callable[[bytes], None]] = {}
    for name, unit in doc["units"].items():
        if unit["kind"] == "pytree":
            for leaf in from_json(unit["tree"]).leaves():
                loc = leaf.value.get("location")
                if loc is not None and not is_safe_location(loc):
                    raise CorruptCheckpointError(
                        f"{url}/{_format.RECORD}: leaf {keystr(leaf.path)!r} has location "
                        f"{loc!r}, outside d/; refusing to copy it"
                    )
                rec = leaf.value
                if "chunk_shape" in rec and loc is not None and loc.split("/")[1] in packed:
                    # format v2: the leaf's chunks are copied and verified inside its packs
                    from quire._handlers.arrays import layout_from_record
                    from quire._zarr import chunk_checker

                    checkers[loc] = chunk_checker(layout_from_record(rec, url))
                else:
                    leaves.append(leaf)
        elif unit["kind"] == "handler":
            loc = unit["location"]
            if not is_safe_location(loc):
                raise CorruptCheckpointError(
                    f"{url}/{_format.RECORD}: unit {name!r} has location {loc!r}, outside d/"
                )
            listed.append((loc, f"unit {name!r}", _check_unit_object))
    # Objects by key: a packed object holds ranges of several leaves; it is copied once.
    owned: dict[str, tuple[str, list[StoredObject]]] = {}
    for leaf, objs in await leaf_objects(url, backend, leaves):
        for o in objs:
            owned.setdefault(o.key, (keystr(leaf.path), []))[1].append(o)
    for key, (owner, objs) in owned.items():
        whole = objs[0].size if len(objs) == 1 and objs[0].length is None else None
        items.append(_Item(key, owner, _range_checks(objs), whole))
    if packed:
        from quire._packcopy import plan_packed

        items += await plan_packed(backend, url, doc["indexes"], checkers, _Item)
    found = await asyncio.gather(*(backend.list(loc) for loc, _, _ in listed))
    for (_, owner, check), keys in zip(listed, found):
        items += [_Item(k, owner, check) for k in keys]
    return items


# ----------------------------------------------------------------------------- copying
async def copy_checkpoint(
    src: str,
    dst: str,
    *,
    overwrite: bool = False,
    src_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
    progress: Callable[[int, int, int, int], None] | None = None,
) -> CopyResult:
    """Copy the checkpoint at ``src`` to ``dst``; the record is written last.

    Parameters
    ----------
    src, dst : str
        Checkpoint URLs on any backends.
    overwrite : bool
        Replace a checkpoint at ``dst`` (atomically; its old data is deleted after).
    src_options, dst_options : dict, optional
        ``storage_options`` for each side.
    progress : callable, optional
        ``progress(objects_done, objects_total, bytes_done, bytes_total_estimate)``.

    Raises
    ------
    CheckpointNotFoundError
        No checkpoint at ``src``.
    CheckpointExistsError
        A checkpoint is at ``dst`` and ``overwrite`` is False (checked first, and again
        by the conditional create of the record).
    CorruptCheckpointError
        An object of ``src`` is missing or fails its checksum (nothing is committed).
    """
    t0 = time.perf_counter()
    src, dst = normalize(src), normalize(dst)
    if src == dst:
        raise ValueError(f"source and destination are the same checkpoint: {src}")
    sb = open_backend(src, src_options)
    db = open_backend(dst, dst_options)
    try:
        record = await _commit.read(sb, src)
        raw, doc = record.raw, record.doc
        if not overwrite:
            await _commit.ensure_absent(db, dst, "pass --overwrite to replace it")
        items = await plan(sb, src, doc)
        done_bytes, verified = await _copy_objects(sb, db, src, items, progress)
        await db.sync()
        await _commit.publish(
            db, dst, raw, record.txids, overwrite=overwrite, fix="pass --overwrite to replace it"
        )
    finally:
        await sb.close()
        await db.close()
    return CopyResult(
        src, dst, len(items) + 1, done_bytes + len(raw), verified, time.perf_counter() - t0
    )


async def _copy_objects(
    sb: Backend,
    db: Backend,
    src: str,
    items: list[_Item],
    progress: Callable[[int, int, int, int], None] | None,
) -> tuple[int, int]:
    cfg = current()
    budget = ByteBudget(cfg.byte_budget)
    sem = asyncio.Semaphore(max(1, cfg.max_concurrency))
    total_est = sum(i.size or 0 for i in items)
    done = [0, 0, 0]  # objects, bytes, verified

    async def one(item: _Item) -> None:
        async with sem:
            size = item.size if item.size is not None else await sb.size(item.key)
            async with budget.hold(size):
                try:
                    data = await sb.get(item.key)
                except FileNotFoundError:
                    raise CorruptCheckpointError(
                        f"{src}: {item.owner}: {item.key} is missing; the checkpoint is "
                        "damaged (run `quire verify`); nothing was committed at the destination"
                    ) from None
                if item.check is not None:
                    try:
                        await run_blocking(item.check, data)
                    except Exception as e:
                        raise CorruptCheckpointError(
                            f"{src}: {item.owner}: {item.key} fails verification ({e}); the "
                            "checkpoint is damaged (run `quire verify`); nothing was committed "
                            "at the destination"
                        ) from e
                    done[2] += 1
                await db.put(item.key, [data])
        done[0] += 1
        done[1] += len(data)
        if progress is not None:
            progress(done[0], len(items), done[1], max(total_est, done[1]))

    tasks = [asyncio.ensure_future(one(i)) for i in items]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return done[1], done[2]


# ----------------------------------------------------------------------------- CLI
class ProgressBar:
    """A one-line progress bar, redrawn at most 10 times a second; silent off a terminal."""

    def __init__(self, stream: TextIO, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.enabled = bool(getattr(stream, "isatty", lambda: False)())
        self._last = 0.0
        self._t0 = time.perf_counter()
        self._drawn = False

    def __call__(self, done: int, total: int, nbytes: int, est: int) -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self._last < 0.1 and done < total):
            return
        self._last = now
        frac = done / total if total else 1.0
        fill = int(frac * self.width)
        rate = nbytes / max(now - self._t0, 1e-9)
        self.stream.write(
            f"\r[{'#' * fill}{'.' * (self.width - fill)}] {done}/{total} objects  "
            f"{_human(nbytes)}/{_human(est)}  {_human(rate)}/s "
        )
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()


def cli_cp(
    src: str,
    dst: str,
    *,
    overwrite: bool = False,
    src_options: str | None = None,
    dst_options: str | None = None,
    quiet: bool = False,
) -> int:
    """``quire cp``: copy, report, return the exit status."""
    from quire import _io

    opts = []
    for what, text in (("--src-options", src_options), ("--dst-options", dst_options)):
        try:
            value = json.loads(text) if text else None
        except ValueError:
            value = []
        if value is not None and not isinstance(value, dict):
            print(
                f"quire cp: {what} takes a JSON object, e.g. '{{\"anon\": true}}'", file=sys.stderr
            )
            return 2
        opts.append(value)
    bar = ProgressBar(sys.stderr)
    bar.enabled = bar.enabled and not quiet
    try:
        res = _io.submit(
            copy_checkpoint(
                src, dst, overwrite=overwrite, src_options=opts[0], dst_options=opts[1],
                progress=bar,
            )
        ).result()  # fmt: skip
    finally:
        bar.close()
    if not quiet:
        print(
            f"copied {res.src} -> {res.dst}: {res.objects} objects, {_human(res.bytes)}, "
            f"{res.verified} checksums verified, in {res.seconds:.1f}s"
        )
    return 0
