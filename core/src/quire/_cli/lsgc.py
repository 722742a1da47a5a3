"""``quire ls`` / ``quire gc`` over a Checkpointer root: rendering of :mod:`quire._engine.garbage`'s reports."""

from __future__ import annotations

import json
from typing import Any

from quire._cli.text import human_bytes as _human
from quire._engine.garbage import DEFAULT_GRACE_PERIOD, GcReport, collect, describe
from quire._format.root import StepFormat, committed_steps, root_step_format
from quire._runtime import ioloop as _io
from quire._store.base import Backend
from quire._store.url import normalize, open_backend
from quire.errors import QuireError


def age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = max(0.0, seconds)
    for limit, div, unit in ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h")):
        if s < limit:
            return f"{s / div:.0f}{unit}"
    return f"{s / 86400:.1f}d"


def metrics_text(m: dict[str, Any]) -> str:
    if not m:
        return "-"
    out = []
    for k, v in sorted(m.items()):
        out.append(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(out)


def _open(
    url: str, step_format: str | None, storage_options: dict[str, Any] | None = None
) -> tuple[Backend, str, StepFormat]:
    u = normalize(url)
    backend = open_backend(u, storage_options)
    try:
        fmt = _io.submit(root_step_format(backend, u, step_format)).result()
    except ValueError as e:
        if isinstance(e, QuireError):
            raise
        raise QuireError(f"{u}: {e}") from e
    return backend, u, fmt


def local_tier_steps(local: str, fmt: StepFormat) -> dict[int, list[str]]:
    """Step -> names of the process roots (``process_<i>``) of a local tier that commit it."""
    base = open_backend(normalize(local))
    try:
        _, names = _io.submit(base.list_dir("")).result()
    except (FileNotFoundError, NotADirectoryError):
        names = []
    out: dict[int, list[str]] = {}
    for n in sorted(x for x in names if x.startswith("process_")):
        b = open_backend(f"{normalize(local)}/{n}")
        for step in _io.submit(committed_steps(b, fmt)).result():
            out.setdefault(step, []).append(n)
    return out


def _tiers(step: int, committed: bool, local: dict[int, list[str]] | None) -> list[str]:
    out = []
    if local is not None and step in local:
        procs = (str(int(p.removeprefix("process_"))) for p in local[step])
        out.append(f"local:{','.join(procs)}")
    return out + (["persistent"] if committed else [])


def cli_ls(
    url: str,
    *,
    step_format: str | None = None,
    as_json: bool = False,
    storage_options: dict[str, Any] | None = None,
    local: str | None = None,
) -> int:
    """``quire ls ROOT [--local URL]``: one line per step directory; exit 0 (2 on errors).

    With ``local`` (a ``quire.LocalTier`` URL), a TIERS column says which tiers hold each
    step (``local:<process indexes>``, ``persistent``), and local-only steps are listed too.
    """
    backend, u, fmt = _open(url, step_format, storage_options)
    reports = _io.submit(describe(backend, u, fmt)).result()
    tiers = None if local is None else local_tier_steps(local, fmt)
    if tiers is not None:
        return _ls_tiers(u, fmt, reports, tiers, as_json)
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "step": r.step,
                        "name": r.name,
                        "state": r.state,
                        "bytes": r.nbytes,
                        "age_seconds": r.age,
                        "metrics": r.metrics,
                    }
                    for r in reports
                ],
                indent=1,
            )
        )
        return 0
    if not reports:
        print(f"{u}: no steps (step format {fmt.pattern!r})")
        return 0
    rows = [("STEP", "STATE", "SIZE", "AGE", "METRICS")]
    for r in reports:
        rows.append(
            (
                str(r.step),
                r.state,
                _human(r.nbytes),
                age(r.age),
                f"error: {r.error}" if r.error else metrics_text(r.metrics),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    print(f"{u}: a quire.Checkpointer root (step format {fmt.pattern!r})")
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4])
    committed = [r.step for r in reports if r.state == "committed"]
    counts = {s: sum(r.state == s for r in reports) for s in ("committed", "partial", "incomplete")}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    latest = f"; latest committed step {max(committed)}" if committed else ""
    print(f"{len(reports)} step(s): {summary}{latest}")
    return 0


def cli_gc(
    url: str,
    *,
    yes: bool = False,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    step_format: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """``quire gc ROOT``: report (or with ``yes``, remove) garbage; exit 0 (2 on errors)."""
    backend, u, fmt = _open(url, step_format, storage_options)
    report = _io.submit(
        collect(backend, u, fmt, grace_period=grace_period, dry_run=not yes)
    ).result()
    print_gc_report(report, u, yes, grace_period)
    return 0


_KINDS = {
    "incomplete": "uncommitted step",
    "superseded": "superseded data",
    "uncommitted": "data of a save that never committed",
    "unfinished": "journal and packs left by a finalize killed after its commit",
}


def print_gc_report(report: GcReport, url: str, yes: bool, grace_period: float) -> None:
    """Print what ``quire gc`` removed (``yes``) or would remove, and what it kept."""
    verb = "removed" if yes else "would remove"
    for g in report.removable:
        what = _KINDS.get(g.kind, g.kind)
        print(f"{verb} {g.prefix}/  ({what}, {_human(g.nbytes)}, {age(g.age)} old)")
    for g in report.kept:
        why = "age unknown" if g.age is None else f"{age(g.age)} old"
        print(f"kept {g.prefix}/  ({g.kind}, {why}; grace period {age(grace_period)})")
    total = _human(sum(g.nbytes for g in report.removable))
    if not report.removable:
        print(f"{url}: no garbage to remove")
    elif yes:
        print(f"{url}: removed {len(report.removable)} item(s), {total}")
    else:
        print(f"{url}: {len(report.removable)} item(s), {total}; run with --yes to delete")


def _ls_tiers(
    u: str, fmt: StepFormat, reports: list[Any], local: dict[int, list[str]], as_json: bool
) -> int:
    by_step = {r.step: r for r in reports}
    rows_json = []
    for step in sorted(set(by_step) | set(local)):
        r = by_step.get(step)
        state = r.state if r is not None else "committed"
        committed = r is not None and r.state == "committed"
        rows_json.append(
            {
                "step": step,
                "state": state,
                "tiers": _tiers(step, committed, local),
                "bytes": r.nbytes if r is not None else None,
                "metrics": r.metrics if r is not None else {},
            }
        )
    if as_json:
        print(json.dumps(rows_json, indent=1))
        return 0
    rows = [("STEP", "STATE", "TIERS", "SIZE", "METRICS")]
    for j in rows_json:
        size = "-" if j["bytes"] is None else _human(j["bytes"])
        tiers = " ".join(j["tiers"]) or "-"
        rows.append((str(j["step"]), j["state"], tiers, size, metrics_text(j["metrics"])))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    print(f"{u}: a quire.Checkpointer root with a local tier (step format {fmt.pattern!r})")
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4])
    return 0
