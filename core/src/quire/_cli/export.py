"""``quire export SRC DST``: any source written as safetensors (one file, or HF-style
shards).  A Checkpointer root or a partial save is refused in one line."""

from __future__ import annotations

import argparse
import time

from quire._cli.common import EXIT_OK, UsageError, progress_on, side_options
from quire._cli.targets import one_checkpoint, target
from quire._runtime import progress as _progress
from quire._sources.export import cast_dtype, export, selector
from quire._sources.opening import open as open_source
from quire.errors import QuireError


def _check_arguments(args: argparse.Namespace) -> None:
    """A bad ``--dtype`` or ``--select`` is a usage error, found before SRC is opened."""
    for flag, check, value in (
        ("--dtype", cast_dtype, args.dtype),
        ("--select", selector, args.select),
    ):
        try:
            if value is not None:
                check(value)
        except ValueError as e:
            raise UsageError(f"{flag}: {str(e).removeprefix('export: ')}") from None


def cmd_export(args: argparse.Namespace) -> int:
    src_opts, dst_opts = side_options(args)
    _check_arguments(args)
    t = target(args.src, src_opts)
    one_checkpoint(t, lambda u: f"quire export {u} {args.dst}")
    bar = progress_on(args) and not args.quiet
    with (
        open_source(t.url, **(src_opts or {})) as src,
        _progress.Progress("export", args.dst, bar=bar) as rep,
    ):
        t0 = time.perf_counter()  # the writing (opening loads the source's plugin)
        try:
            written = export(
                src,
                args.dst,
                select=args.select,
                dtype=args.dtype,
                casting=args.casting,
                max_shard_bytes=args.max_shard_bytes,
                storage_options=dst_opts,
                progress=rep,
                overwrite=args.overwrite,
            )
        except (FileExistsError, NotADirectoryError) as e:
            if isinstance(e, QuireError):
                raise
            raise UsageError(f"cannot write {args.dst}: {e}") from None
    if not args.quiet:
        print(
            f"exported {src.format} {src.url} -> {args.dst}: {len(written)} file(s), "
            f"{rep.bytes_done / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f}s"
        )
    return EXIT_OK
