"""``quire cp SRC DST``: a committed checkpoint copied between any two URLs (data first,
checksums verified, commit record last), or another format's converted into one.  A
Checkpointer root and a partial save are refused in one line."""

from __future__ import annotations

import argparse

from quire import _ops
from quire._cli.common import EXIT_OK, progress_on, side_options
from quire._cli.targets import one_checkpoint, target
from quire._cli.text import human_bytes, summary


def cmd_cp(args: argparse.Namespace) -> int:
    sides = side_options(args)  # a bad -o / --src-options is a usage error first
    t = target(args.src, sides[0])
    one_checkpoint(t, lambda u: f"quire cp {u} {args.dst}")
    res = _ops.copy(t.url, args.dst, overwrite=args.overwrite, storage_options=sides[0],
                    dst_options=sides[1], progress=progress_on(args) and not args.quiet)  # fmt: skip
    if not args.quiet:
        if res.format == "quire":  # copied object by object
            what = f"copied {res.src} -> {res.dst}"
            how = f"(stored as {res.objects} objects, {human_bytes(res.bytes)} written) "
        else:  # SRC in another format (safetensors, Orbax...): converted
            what, how = f"converted {res.format} {res.src} -> {res.dst}", ""
        print(f"{what}: {summary(res)} verified {how}in {res.seconds:.1f}s")
    return EXIT_OK
