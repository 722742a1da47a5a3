"""The ``quire`` command line: info, verify, ls, gc, cp, diff, plugins.

Exit status (every command): 0 success (checkpoint good, command done); 1 damage found
(a chunk or a record fails its checks: ``CorruptCheckpointError``; ``diff`` found differences);
2 usage error, or nothing found at the URL; 141 when the reader of the output went away
(``quire info --json | head``), like other Unix tools.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import quire
from quire import _ops
from quire._cli import lsgc as _gc_cli
from quire._cli.common import (
    EXIT_DAMAGED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    progress_on,
    side_options,
    storage_options,
)
from quire._cli.diff import add_diff_parser
from quire._cli.export import add_export_parser
from quire._cli.text import human_bytes as _human
from quire._engine import load as _load
from quire._engine import scan as _scan
from quire._format import describe as _describe
from quire._format import root as _root
from quire._format.borrow import borrowed_of
from quire._format.describe import chain_text, counts, ownership
from quire._format.paths import is_chunk
from quire._runtime import ioloop as _io
from quire._runtime import progress as _progress
from quire._runtime.registry import registries
from quire._runtime.version import __version__
from quire._store.url import normalize, open_backend
from quire.errors import CorruptCheckpointError, QuireError
from quire.metadata import LeafMetadata


# ----------------------------------------------------------------------------- info
def _layout(v: Any) -> list[str]:
    """Codecs, chunk grid and layout of one array leaf (issue 10: what ``info`` shows)."""
    extras = [f"nnx.{v.variable}"] if v.variable else []
    if v.handler == "prng_key":
        return [*extras, "prng key"] + ([] if v.checksum else ["no checksum"])
    shape, chunk = tuple(v.shape), tuple(v.chunk_shape or v.shape)
    grid = [-(-s // max(1, c)) for s, c in zip(shape, chunk)]
    extras.append(f"chunks={list(chunk)} grid={grid}" if chunk != shape else "1 chunk")
    if v.codec_chain:  # the chain as stored, each codec with its configuration, lossy marked
        extras.append(f"codecs=[{chain_text(v.codec_chain, v.lossy)}]")
    elif v.codecs:  # a handler that names only its compressors
        extras.append(f"codecs={'+'.join(v.codecs)}")
    if not v.checksum:
        extras.append("no checksum")
    if v.sharding and v.sharding.get("type") == "named":
        extras.append(f"mesh={v.sharding.get('mesh')} spec={v.sharding.get('spec')}")
        types = v.sharding.get("axis_types") or []
        if any(t != "Auto" for t in types):
            extras.append(f"axis_types=[{', '.join(map(str, types))}]")
    elif v.sharding and v.sharding.get("type"):
        extras.append(f"sharding={v.sharding.get('type')}")
    return extras


def _print_tree(node: Any, indent: str, out: list[str], totals: dict[str, int]) -> None:
    items: list[tuple[str, Any]]
    if isinstance(node, dict):
        items = [(str(k), v) for k, v in node.items()]
    elif isinstance(node, list | tuple):
        items = [(f"[{i}]", v) for i, v in enumerate(node)]
    else:
        items = []
    for name, v in items:
        if isinstance(v, LeafMetadata):
            totals["bytes"] += v.nbytes
            totals["arrays"] += 1
            dtype = "prng_key" if v.handler == "prng_key" else v.dtype.name
            out.append(
                f"{indent}{name}: {dtype}{list(v.shape)} {_human(v.nbytes)}  "
                f"({', '.join(_layout(v))})"
            )
        elif isinstance(v, dict | list | tuple):
            out.append(f"{indent}{name}/")
            _print_tree(v, indent + "  ", out, totals)
        else:
            out.append(f"{indent}{name}: {getattr(v, '__name__', str(v))}")
            totals["inline"] += 1


def cmd_info(args: argparse.Namespace) -> int:
    m = quire.metadata(args.url, storage_options=storage_options(args))
    if args.json:
        doc = {k: v for k, v in m.record.items() if not k.startswith("_")}
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    lines: list[str] = []
    totals = {"bytes": 0, "arrays": 0, "inline": 0}
    tree = m.tree if isinstance(m.tree, dict | list | tuple) else {"<root>": m.tree}
    _print_tree(tree, "  ", lines, totals)
    print(f"checkpoint {m.url}")
    print(
        f"  format v{m.format_version}, written by quire {m.library_version}, "
        f"{m.process_count} process(es), created {m.created.isoformat()}"
    )

    print(f"  {_summary(counts(m.tree))}, {totals['inline']} inline leaves")
    lent = borrowed_of(m.record.get("indexes"))
    if lent:  # an incremental step (quire._format.borrow)
        from quire._runtime import ioloop as _io

        so = storage_options(args)
        own, b = _io.submit(ownership(open_backend(m.url, so), m.url, m.record)).result()
        print(
            f"  incremental: owns {_human(own)}, borrows {_human(b)} "
            f"from {len(lent)} pack(s) of earlier steps"
        )
    others = {n: k for n, k in m.units.items() if k != "pytree"}
    for n in others:  # a state per JAX process: say how many
        if "processes" in m.record["units"][n]:
            others[n] += f", per process: {m.record['units'][n]['processes']}"
    if others:
        print("  units: " + ", ".join(f"{n} ({k})" for n, k in others.items()))
    if m.custom:
        print("  metadata: " + json.dumps(m.custom, sort_keys=True))
    print("tree:")
    print("\n".join(lines))
    return EXIT_OK


# ----------------------------------------------------------------------------- verify
def _summary(c: Any) -> str:
    return f"{c.arrays} arrays, {c.chunks} chunks, {_human(c.nbytes)}"


def cmd_verify(args: argparse.Namespace) -> int:
    r = _ops.verify(args.url, storage_options=storage_options(args), progress=progress_on(args))
    url, problems, c = r.url, r.problems, r
    for p in problems:
        err = str(p.error)
        for prefix in (f"chunk {p.object}: ", f"{p.object}: "):  # the path is printed once
            err = err[len(prefix) :] if err.startswith(prefix) else err
        print(f"BAD  {p.path}: {p.object}: {err}")
    if problems:
        units = sum(p.unit is not None for p in problems)
        bad = sum(is_chunk(p.object) for p in problems if p.unit is None)
        headers = len(problems) - units - bad
        also = f", and {headers} array header(s) (zarr.json)" if headers else ""
        also += f", and {units} object(s) of checkpointable units" if units else ""
        print(
            f"{url}: DAMAGED, {bad} of {c.chunks} chunks failed{also} ({_summary(c)})",
            file=sys.stderr,
        )
        return EXIT_DAMAGED
    print(f"{url}: OK, {_summary(c)} verified")
    return EXIT_OK


# ----------------------------------------------------------------------------- cp
def cmd_cp(args: argparse.Namespace) -> int:
    sides = side_options(args)  # a bad -o / --src-options is a usage error first
    res = _ops.copy(args.src, args.dst, overwrite=args.overwrite, storage_options=sides[0],
                    dst_options=sides[1], progress=progress_on(args) and not args.quiet)  # fmt: skip
    if not args.quiet:
        if res.format == "quire":  # copied object by object
            what = f"copied {res.src} -> {res.dst}"
            how = f"(stored as {res.objects} objects, {_human(res.bytes)} written) "
        else:  # SRC in another format (safetensors, Orbax...): converted
            what, how = f"converted {res.format} {res.src} -> {res.dst}", ""
        print(f"{what}: {_summary(res)} verified {how}in {res.seconds:.1f}s")
    return EXIT_OK


# ----------------------------------------------------------------------------- ls / gc
def _open(url: str, so: dict[str, Any] | None) -> tuple[Any, str, Any]:
    u = normalize(url)
    return open_backend(u, so), u, (lambda rel: open_backend(f"{u}/{rel}", so))


def _is_root(backend: Any) -> bool:
    return bool(_io.submit(backend.exists(_root.ROOT_RECORD)).result())


def _nothing_at(backend: Any) -> bool:
    try:
        files, dirs = _io.submit(backend.list_dir("")).result()
    except (FileNotFoundError, NotADirectoryError):
        return True
    return not files and not dirs


def cmd_ls(args: argparse.Namespace) -> int:
    so = storage_options(args)
    backend, u, opener = _open(args.root, so)
    if _is_root(backend):
        return _gc_cli.cli_ls(
            u, step_format=args.step_format, as_json=args.json, storage_options=so,
            local=args.local,
        )  # fmt: skip
    s = _io.submit(_scan.scan(backend, opener)).result()
    if not s.checkpoints:
        if _nothing_at(backend):
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
                m = _io.submit(_load.metadata(f"{u}/{f.path}" if f.path else u, so)).result()
                row["bytes"] = _describe.array_bytes(m.tree)
                row["created"] = m.created.isoformat(timespec="seconds")
            except Exception as e:  # a damaged record: shown, not fatal
                row["error"] = str(e).splitlines()[0]
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return EXIT_OK
    table = [("PATH", "STATE", "SIZE", "CREATED", "MANAGED BY")]
    for r in rows:
        managed = "-"
        if r["checkpointer_root"] is not None:
            managed = f"Checkpointer {r['checkpointer_root']} (step {r['step']})"
        table.append(
            (
                r["path"],
                r["state"],
                "?" if r["bytes"] is None else _human(r["bytes"]),
                r.get("created", "error: " + r["error"] if "error" in r else "-"),
                managed,
            )
        )
    widths = [max(len(t[i]) for t in table) for i in range(4)]
    print(u)
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths)) + "  " + t[4])
    n = {st: sum(r["state"] == st for r in rows) for st in ("committed", "partial", "incomplete")}
    print(f"{len(rows)} checkpoint(s): " + ", ".join(f"{v} {k}" for k, v in n.items() if v))
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    so = storage_options(args)
    backend, u, opener = _open(args.root, so)
    if args.step_format is not None or _is_root(backend):
        with _progress.reporting(progress_on(args) and args.yes, "gc", u):
            return _gc_cli.cli_gc(
                u, yes=args.yes, grace_period=args.grace, step_format=args.step_format,
                storage_options=so,
            )  # fmt: skip
    if _nothing_at(backend):
        print(f"quire gc: {u}: not found (nothing is stored there)", file=sys.stderr)
        return EXIT_USAGE
    with _progress.reporting(progress_on(args) and args.yes, "gc", u):
        report = _io.submit(
            _scan.collect_any(backend, u, opener, grace_period=args.grace, dry_run=not args.yes)
        ).result()
    _gc_cli.print_gc_report(report, u, args.yes, args.grace)
    return EXIT_OK


# ----------------------------------------------------------------------------- plugins
def cmd_plugins(args: argparse.Namespace) -> int:
    reports = {group: reg.report(load=True) for group, reg in registries.items()}
    rows = [i for infos in reports.values() for i in infos]
    wn = max([len(i.name) for i in rows] + [12])
    wd = max([len(i.distribution) for i in rows] + [12])
    wv = max([len(i.version) for i in rows] + [7])
    for group, infos in reports.items():
        print(f"{group}:")
        if not infos:
            print("  (none)")
        for i in infos:
            print(f"  {i.name:<{wn}}  {i.distribution:<{wd}}  {i.version or '-':<{wv}}  {i.status}")
    return EXIT_OK


# ----------------------------------------------------------------------------- parser
def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("storage and display")
    g.add_argument(
        "-o",
        "--option",
        action="append",
        metavar="KEY=VALUE",
        help="an fsspec storage option (repeatable; VALUE is JSON when it parses, e.g. "
        "-o anon=true -o endpoint_url=http://127.0.0.1:9000)",
    )
    g.add_argument("--storage-options", metavar="JSON", help="fsspec storage options as JSON")
    g.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar on stderr (default: when stderr is a terminal)",
    )
    p0 = argparse.ArgumentParser(
        prog="quire",
        description="Inspect, check, copy and clean up quire checkpoints.",
        epilog="exit status: 0 ok; 1 damaged (verify, cp) or different (diff); "
        "2 usage error or nothing found at the URL",
    )
    p0.add_argument("--version", action="version", version=f"quire {__version__}")
    sub = p0.add_subparsers(dest="command", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[common])

    p = add("info", "show a checkpoint's tree (shapes, dtypes, sizes, chunk grid, codecs, layout)")
    p.add_argument("url")
    p.add_argument("--json", action="store_true", help="print the raw commit record")
    p.set_defaults(fn=cmd_info)
    p = add("verify", "read every chunk and check its checksum (exit 1 on any failure)")
    p.add_argument("url")
    p.set_defaults(fn=cmd_verify)
    p = add("plugins", "list installed plugins per entry-point group, with their status")
    p.set_defaults(fn=cmd_plugins)
    p = add(
        "ls",
        "list every checkpoint under a prefix (whatever its name), marking those a "
        "quire.Checkpointer manages; on a Checkpointer root: its steps with state, size, "
        "age and metrics",
    )
    p.add_argument("root", metavar="URL")
    p.add_argument("--step-format", help="step directory pattern (default: the root's own)")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.add_argument(
        "--local",
        metavar="URL",
        help="a quire.LocalTier URL of this root's Checkpointer: show which tiers hold each step",
    )
    p.set_defaults(fn=cmd_ls)
    p = add(
        "gc",
        "remove data no commit record references, under a checkpoint, a Checkpointer root "
        "or any prefix holding them: killed saves, superseded data (dry run unless --yes)",
    )
    p.add_argument("root", metavar="URL")
    p.add_argument("--yes", action="store_true", help="delete (default: only report)")
    p.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="spare data younger than this: a writer may still be at work (default 3600)",
    )
    p.add_argument("--step-format", help="step directory pattern (default: the root's own)")
    p.set_defaults(fn=cmd_gc)
    p = add(
        "cp",
        "copy a committed checkpoint between any two URLs (local, s3://, gs://, ...): "
        "data first, checksums verified, commit record last",
    )
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST")
    p.add_argument("--src-options", metavar="JSON", help="storage options for SRC only")
    p.add_argument("--dst-options", metavar="JSON", help="storage options for DST only")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary")
    p.set_defaults(fn=cmd_cp)
    add_diff_parser(add)
    add_export_parser(add)
    return p0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    try:
        code = int(args.fn(args))
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away (`quire info --json | head`): no traceback, like cat(1).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except UsageError as e:
        print(f"quire {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except CorruptCheckpointError as e:
        print(f"quire {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_DAMAGED
    except QuireError as e:
        print(f"quire {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except FileNotFoundError as e:
        print(f"quire {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
