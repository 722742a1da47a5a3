"""``quire cp`` from any source, and ``quire export``: the CLI side of sources.

``_cli`` calls :func:`cp_from_source` first (it returns None when SRC is a quire checkpoint,
which the byte-level copier handles) and :func:`add_export_parser` to add ``export``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from quire.sources import Source

__all__ = ["add_export_parser", "convert", "cp_from_source"]


class _Progress:
    """A minimal byte-count progress line on a terminal (silent otherwise)."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        stream = stream if stream is not None else sys.stderr  # the current one, not import's
        self.total, self.done, self.stream = total, 0, stream
        self.enabled = enabled and bool(getattr(stream, "isatty", lambda: False)())
        self.t0 = self.last = time.perf_counter()

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if self.enabled and (now - self.last > 0.1 or self.done >= self.total):
            self.last = now
            frac = self.done / self.total if self.total else 1.0
            fill = int(frac * 30)
            self.stream.write(
                f"\r[{'#' * fill}{'.' * (30 - fill)}] {self.done / 2**20:.1f}/"
                f"{self.total / 2**20:.1f} MiB"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.done:
            self.stream.write("\n")
            self.stream.flush()


def _total(src: Source) -> int:
    return sum(getattr(v, "nbytes", 0) for _, v in src.leaves())


def convert(
    src: Any,
    dst: str,
    *,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
    progress: Any = None,
    verify: bool = True,
) -> tuple[int, int]:
    """Write source ``src`` (any format) as a quire checkpoint at ``dst``, then verify it.

    Leaves are read as numpy arrays (within the byte budget while reading) and saved in one
    commit; returns (bytes written, chunks verified).
    """
    from quire import _api, _engine, _io
    from quire._materialize import materialize_tree
    from quire._url import normalize
    from quire.errors import CorruptCheckpointError
    from quire.sources import open as open_source

    source = src if isinstance(src, Source) else open_source(src, **(storage_options or {}))
    tree = _io.submit(materialize_tree(source.tree, None, what=f"source {source.url}")).result()
    nbytes = _total(source)
    meta = {"converted_from": source.url, "source_format": source.format}
    _api.save(dst, tree, overwrite=overwrite, metadata=meta, storage_options=dst_options)
    if progress is not None:
        progress(nbytes)
    checked = 0
    if verify:
        checked, problems = _io.submit(_engine.verify(normalize(dst), dst_options)).result()
        if problems:
            raise CorruptCheckpointError(
                f"{dst}: {len(problems)} chunk(s) failed verification after conversion: "
                + "; ".join(f"{p.path}: {p.error}" for p in problems[:5])
            )
    return nbytes, checked


def _options(text: str | None, what: str) -> dict[str, Any] | None:
    if not text:
        return None
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"{what} takes a JSON object, e.g. '{{\"anon\": true}}'")
    return value


def cp_from_source(args: argparse.Namespace) -> int | None:
    """``quire cp SRC DST`` when SRC is not a quire checkpoint; None when it is one."""
    from quire._quire_source import QuireSource
    from quire._url import normalize
    from quire.sources import open as open_source

    src_opts = _options(args.src_options, "--src-options")
    if QuireSource.detect(normalize(args.src), dict(src_opts or {})):
        return None  # a quire checkpoint: copied object by object, verified
    src = open_source(args.src, **(src_opts or {}))
    bar = _Progress(_total(src), enabled=not args.quiet)
    t0 = time.perf_counter()
    try:
        nbytes, checked = convert(
            src,
            args.dst,
            overwrite=args.overwrite,
            dst_options=_options(args.dst_options, "--dst-options"),
            progress=bar,
        )
    finally:
        bar.close()
    if not args.quiet:
        print(
            f"converted {src.format} {src.url} -> {args.dst}: {nbytes / 2**20:.1f} MiB, "
            f"{checked} chunks verified, in {time.perf_counter() - t0:.1f}s"
        )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from quire._export import export
    from quire.sources import open as open_source

    src = open_source(args.src, **(_options(args.src_options, "--src-options") or {}))
    bar = _Progress(_total(src), enabled=not args.quiet)
    t0 = time.perf_counter()
    try:
        written = export(
            src,
            args.dst,
            select=args.select,
            dtype=args.dtype,
            max_shard_bytes=args.max_shard_bytes,
            storage_options=_options(args.dst_options, "--dst-options"),
            progress=bar,
        )
    finally:
        bar.close()
    if not args.quiet:
        print(
            f"exported {src.format} {src.url} -> {args.dst}: {len(written)} file(s), "
            f"{bar.done / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f}s"
        )
    return 0


def add_export_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write any checkpoint (quire, safetensors, Orbax with quire-orbax) as safetensors: "
        "one file, or HF-style shards + model.safetensors.index.json",
    )
    p.add_argument("src")
    p.add_argument("dst", help="a .safetensors URL, or a directory / prefix")
    p.add_argument("--select", metavar="REGEX", help="only tensors whose dotted name matches")
    p.add_argument("--dtype", help="cast floating-point tensors, e.g. bfloat16")
    p.add_argument(
        "--max-shard-bytes", type=int, default=None, help="largest shard (default 5 GiB)"
    )
    p.add_argument("--src-options", metavar="JSON", help="storage_options for SRC")
    p.add_argument("--dst-options", metavar="JSON", help="storage_options for DST")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary")
    p.set_defaults(fn=cmd_export)
