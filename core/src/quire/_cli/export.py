"""``quire export``: any source written as safetensors (one file, or HF-style shards)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from quire._cli.common import progress_on, side_options
from quire._runtime import progress as _progress
from quire._sources.export import export
from quire._sources.opening import open as open_source


def cmd_export(args: argparse.Namespace) -> int:
    src_opts, dst_opts = side_options(args)
    t0 = time.perf_counter()
    bar = progress_on(args) and not args.quiet
    with (
        open_source(args.src, **(src_opts or {})) as src,
        _progress.Progress("export", args.dst, bar=bar) as rep,
    ):
        written = export(
            src,
            args.dst,
            select=args.select,
            dtype=args.dtype,
            max_shard_bytes=args.max_shard_bytes,
            storage_options=dst_opts,
            progress=rep,
        )
    if not args.quiet:
        print(
            f"exported {src.format} {src.url} -> {args.dst}: {len(written)} file(s), "
            f"{rep.bytes_done / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f}s"
        )
    return 0


def add_export_parser(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = add(
        "export",
        "write any checkpoint (quire, safetensors, Orbax with quire-orbax) as safetensors: "
        "one file, or HF-style shards + model.safetensors.index.json",
    )
    p.add_argument("src")
    p.add_argument("dst", help="a .safetensors URL, or a directory / prefix")
    p.add_argument("--select", metavar="REGEX", help="only tensors whose dotted name matches")
    p.add_argument("--dtype", help="cast floating-point tensors, e.g. bfloat16")
    p.add_argument(
        "--max-shard-bytes", type=int, default=None, help="largest shard (default 5 GiB)"
    )
    p.add_argument("--src-options", metavar="JSON", help="storage options for SRC only")
    p.add_argument("--dst-options", metavar="JSON", help="storage options for DST only")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary")
    p.set_defaults(fn=cmd_export)
