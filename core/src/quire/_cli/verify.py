"""``quire verify URL``: every stored object of a checkpoint checked against its checksums
(array chunks and headers in every unit, the objects of checkpointable units), for a
committed checkpoint or a partial save; exit 1 on any damage.  A Checkpointer root, and
another format's checkpoint (it stores no checksums), are refused in one line."""

from __future__ import annotations

import argparse
import sys

from quire import _ops
from quire._cli.common import EXIT_DAMAGED, EXIT_OK, UsageError, progress_on, storage_options
from quire._cli.targets import a_checkpoint, one_checkpoint, other_format, target
from quire._cli.text import summary
from quire._format.paths import is_chunk


def cmd_verify(args: argparse.Namespace) -> int:
    so = storage_options(args)
    t = target(args.url, so)
    one_checkpoint(t, lambda u: f"quire verify {u}", partial_ok=True)
    if t.kind == "other" and (fmt := other_format(t.url, so)) is not None:
        raise UsageError(
            f"{t.url} is {a_checkpoint(fmt)}, which stores no checksums: there is nothing to "
            f"verify it against; quire cp {t.url} DST converts it into a quire checkpoint "
            "and verifies that"
        )
    r = _ops.verify(t.url, storage_options=so, progress=progress_on(args))
    what = f" (partial save, journal at version {r.versions})" if r.versions else ""
    leaf_units = {None} | {n for n, k in r.units.items() if k == "pytree"}
    chunks = headers = objects = 0
    for p in r.problems:
        err = str(p.error)
        for prefix in (f"chunk {p.object}: ", f"{p.object}: "):  # the path is printed once
            err = err[len(prefix) :] if err.startswith(prefix) else err
        if p.unit not in leaf_units:  # an object of a checkpointable unit
            objects += 1
            print(f"BAD  {p.unit}: {p.object}: {err}")
            continue
        chunks += is_chunk(p.object)
        headers += not is_chunk(p.object)
        path = p.path if p.unit is None else f"{p.unit}/{p.path}"
        print(f"BAD  {path}: {p.object}: {err}")
    if r.problems:
        also = f", and {headers} array header(s) (zarr.json)" if headers else ""
        also += f", and {objects} object(s) of checkpointable units" if objects else ""
        print(
            f"{r.url}{what}: DAMAGED, {chunks} of {r.chunks} chunks failed{also} ({summary(r)})",
            file=sys.stderr,
        )
        return EXIT_DAMAGED
    print(f"{r.url}{what}: OK, {summary(r)} verified")
    return EXIT_OK
