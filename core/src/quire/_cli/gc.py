"""``quire gc URL``: report (dry run) or with ``--yes`` remove the data no commit record
references under a checkpoint, a Checkpointer root or any prefix holding them: killed
saves (their folders too, when they hold nothing), superseded data, finalizes killed after
their commit.  Nothing younger than the grace period, no partial save, no lease of an
incremental save is touched.  Another format's checkpoint is refused in one line."""

from __future__ import annotations

import argparse
import sys

from quire._cli.common import EXIT_OK, EXIT_USAGE, progress_on, storage_options
from quire._cli.listing import is_root, nothing_at, open_root
from quire._cli.targets import not_a_prefix
from quire._cli.text import age, human_bytes
from quire._engine import garbage as _gc
from quire._engine import prefix_garbage
from quire._runtime import ioloop as _io
from quire._runtime import progress as _progress
from quire._store.url import normalize, open_backend

_KINDS = {
    "incomplete": "uncommitted step",
    "superseded": "superseded data",
    "uncommitted": "data of a save that never committed",
    "unfinished": "journal and packs left by a finalize killed after its commit",
}


def print_gc_report(report: _gc.GcReport, url: str, yes: bool, grace_period: float) -> None:
    """Print what ``quire gc`` removed (``yes``) or would remove, and what it kept."""
    verb = "removed" if yes else "would remove"
    for g in report.removable:
        what = _KINDS.get(g.kind, g.kind)
        print(f"{verb} {g.prefix}/  ({what}, {human_bytes(g.nbytes)}, {age(g.age)} old)")
    for g in report.kept:
        why = "age unknown" if g.age is None else f"{age(g.age)} old"
        print(f"kept {g.prefix}/  ({g.kind}, {why}; grace period {age(grace_period)})")
    total = human_bytes(sum(g.nbytes for g in report.removable))
    if not report.removable:
        print(f"{url}: no garbage to remove")
    elif yes:
        print(f"{url}: removed {len(report.removable)} item(s), {total}")
    else:
        print(f"{url}: {len(report.removable)} item(s), {total}; run with --yes to delete")


def cmd_gc(args: argparse.Namespace) -> int:
    so = storage_options(args)
    u = normalize(args.root)
    backend = open_backend(u, so)
    dry = not args.yes
    if args.step_format is not None or is_root(backend):
        root, u, fmt = open_root(u, args.step_format, so)
        with _progress.reporting(progress_on(args) and args.yes, "gc", u):
            report = _io.submit(
                _gc.collect(root, u, fmt, grace_period=args.grace, dry_run=dry)
            ).result()
        print_gc_report(report, u, args.yes, args.grace)
        return EXIT_OK
    not_a_prefix(u, so, "quire keeps no garbage there to collect")
    if nothing_at(backend):
        print(f"quire gc: {u}: not found (nothing is stored there)", file=sys.stderr)
        return EXIT_USAGE
    with _progress.reporting(progress_on(args) and args.yes, "gc", u):
        report = _io.submit(
            prefix_garbage.collect_any(
                backend, u, lambda rel: open_backend(f"{u}/{rel}", so),
                grace_period=args.grace, dry_run=dry,
            )
        ).result()  # fmt: skip
    print_gc_report(report, u, args.yes, args.grace)
    return EXIT_OK
