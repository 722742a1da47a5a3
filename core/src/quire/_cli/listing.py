"""``quire ls URL``: every checkpoint under a prefix (whatever its name: committed, partial,
incomplete; sizes of every unit), marking those a ``quire.Checkpointer`` manages; on a
Checkpointer root, its steps (state, size, age, metrics; with ``--local``, which tiers hold
each).  Another format's checkpoint is refused in one line.

Reads listings and commit records only, importing neither JAX nor zarr: ``quire ls``
answers at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from quire._cli.common import EXIT_OK, EXIT_USAGE, storage_options
from quire._cli.targets import not_a_prefix
from quire._cli.text import age, human_bytes, metrics_text, table
from quire._engine import metadata as _metadata
from quire._engine import scan as _scan
from quire._engine.step_reports import StepReport, describe
from quire._format import describe as _describe
from quire._format import root as _root
from quire._runtime import ioloop as _io
from quire._store.base import Backend
from quire._store.url import normalize, open_backend
from quire.errors import QuireError


def open_root(
    url: str, step_format: str | None, so: dict[str, Any] | None
) -> tuple[Backend, str, _root.StepFormat]:
    """A Checkpointer root's backend, URL and step format."""
    u = normalize(url)
    backend = open_backend(u, so)
    try:
        fmt = _io.submit(_root.root_step_format(backend, u, step_format)).result()
    except ValueError as e:
        if isinstance(e, QuireError):
            raise
        raise QuireError(f"{u}: {e}") from e
    return backend, u, fmt


def is_root(backend: Backend) -> bool:
    return bool(_io.submit(backend.exists(_root.ROOT_RECORD)).result())


def nothing_at(backend: Backend) -> bool:
    try:
        files, dirs = _io.submit(backend.list_dir("")).result()
    except (FileNotFoundError, NotADirectoryError):
        return True
    return not files and not dirs


# ----------------------------------------------------------------------------- a root
def local_tier_steps(local: str, fmt: _root.StepFormat) -> dict[int, list[str]]:
    """Step -> names of the process roots (``process_<i>``) of a local tier that commit it."""
    base = open_backend(normalize(local))
    try:
        _, names = _io.submit(base.list_dir("")).result()
    except (FileNotFoundError, NotADirectoryError):
        names = []
    out: dict[int, list[str]] = {}
    for n in sorted(x for x in names if x.startswith("process_")):
        b = open_backend(f"{normalize(local)}/{n}")
        for step in _io.submit(_root.committed_steps(b, fmt)).result():
            out.setdefault(step, []).append(n)
    return out


def _tiers(step: int, committed: bool, local: dict[int, list[str]]) -> list[str]:
    out = []
    if step in local:
        procs = (str(int(p.removeprefix("process_"))) for p in local[step])
        out.append(f"local:{','.join(procs)}")
    return out + (["persistent"] if committed else [])


def _ls_root(args: argparse.Namespace, so: dict[str, Any] | None) -> int:
    backend, u, fmt = open_root(args.root, args.step_format, so)
    reports = _io.submit(describe(backend, u, fmt)).result()
    if args.local is not None:
        return _ls_tiers(u, fmt, reports, local_tier_steps(args.local, fmt), args.json)
    if args.json:
        keys = ("step", "name", "state", "nbytes", "age", "metrics")
        names = ("step", "name", "state", "bytes", "age_seconds", "metrics")
        docs = [{n: getattr(r, k) for n, k in zip(names, keys)} for r in reports]
        print(json.dumps(docs, indent=1))
        return EXIT_OK
    if not reports:
        print(f"{u}: no steps (step format {fmt.pattern!r})")
        return EXIT_OK
    rows = [("STEP", "STATE", "SIZE", "AGE", "METRICS")]
    for r in reports:
        metrics = f"error: {r.error}" if r.error else metrics_text(r.metrics)
        rows.append((str(r.step), r.state, human_bytes(r.nbytes), age(r.age), metrics))
    print(f"{u}: a quire.Checkpointer root (step format {fmt.pattern!r})")
    print("\n".join(table(rows)))
    committed = [r.step for r in reports if r.state == "committed"]
    counts = {s: sum(r.state == s for r in reports) for s in ("committed", "partial", "incomplete")}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    latest = f"; latest committed step {max(committed)}" if committed else ""
    print(f"{len(reports)} step(s): {summary}{latest}")
    return EXIT_OK


def _ls_tiers(
    u: str,
    fmt: _root.StepFormat,
    reports: list[StepReport],
    local: dict[int, list[str]],
    as_json: bool,
) -> int:
    by_step = {r.step: r for r in reports}
    rows_json: list[dict[str, Any]] = []
    for step in sorted(set(by_step) | set(local)):
        r = by_step.get(step)
        committed = r is not None and r.state == "committed"
        rows_json.append(
            {
                "step": step,
                "state": r.state if r is not None else "committed",
                "tiers": _tiers(step, committed, local),
                "bytes": r.nbytes if r is not None else None,
                "metrics": r.metrics if r is not None else {},
            }
        )
    if as_json:
        print(json.dumps(rows_json, indent=1))
        return EXIT_OK
    rows = [("STEP", "STATE", "TIERS", "SIZE", "METRICS")]
    for j in rows_json:
        size = "-" if j["bytes"] is None else human_bytes(j["bytes"])
        tiers = " ".join(j["tiers"]) or "-"
        rows.append((str(j["step"]), j["state"], tiers, size, metrics_text(j["metrics"])))
    print(f"{u}: a quire.Checkpointer root with a local tier (step format {fmt.pattern!r})")
    print("\n".join(table(rows)))
    return EXIT_OK


# ----------------------------------------------------------------------------- any prefix
def _size(url: str, so: dict[str, Any] | None) -> tuple[int, str]:
    """Array bytes of every unit of the checkpoint at ``url``, and its creation time."""
    doc = _io.submit(_metadata.record(url, so)).result()
    trees = _metadata.unit_trees(url, doc, as_records=True)
    return _describe.array_bytes(list(trees.values())), doc["_created"].isoformat(
        timespec="seconds"
    )


def cmd_ls(args: argparse.Namespace) -> int:
    so = storage_options(args)
    u = normalize(args.root)
    backend = open_backend(u, so)
    if is_root(backend):
        return _ls_root(args, so)
    s = _io.submit(_scan.scan(backend, lambda rel: open_backend(f"{u}/{rel}", so))).result()
    if not s.checkpoints:
        not_a_prefix(u, so, "quire ls lists quire checkpoints")
        if nothing_at(backend):
            print(f"quire ls: {u}: not found (nothing is stored there)", file=sys.stderr)
            return EXIT_USAGE
        print(f"{u}: no checkpoints (searched {_scan.MAX_DEPTH} levels deep)")
        return EXIT_OK
    rows = []
    for f in s.checkpoints:
        row: dict[str, Any] = {"path": f.path or ".", "state": f.state, "bytes": None}
        row["checkpointer_root"] = None if f.root is None else (f.root or ".")
        row["step"] = f.step
        if f.state == "committed":
            try:
                row["bytes"], row["created"] = _size(f"{u}/{f.path}" if f.path else u, so)
            except Exception as e:  # a damaged record: shown, not fatal
                row["error"] = str(e).splitlines()[0]
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return EXIT_OK
    lines = [("PATH", "STATE", "SIZE", "CREATED", "MANAGED BY")]
    for r in rows:
        managed = "-"
        if r["checkpointer_root"] is not None:
            managed = f"Checkpointer {r['checkpointer_root']} (step {r['step']})"
        size = "?" if r["bytes"] is None else human_bytes(r["bytes"])
        created = r.get("created", "error: " + r["error"] if "error" in r else "-")
        lines.append((r["path"], r["state"], size, created, managed))
    print(u)
    print("\n".join(table(lines)))
    n = {st: sum(r["state"] == st for r in rows) for st in ("committed", "partial", "incomplete")}
    print(f"{len(rows)} checkpoint(s): " + ", ".join(f"{v} {k}" for k, v in n.items() if v))
    return EXIT_OK
