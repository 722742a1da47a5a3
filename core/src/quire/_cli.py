"""The ``quire`` command line: info, verify, plugins, ls, gc, cp."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _print_tree(node: Any, indent: str, out: list[str], totals: dict[str, int]) -> None:
    from quire.metadata import LeafMetadata

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
            extras = []
            dtype = v.dtype.name
            if v.handler == "prng_key":
                dtype = "prng_key"
            if v.codecs:
                extras.append("codecs=" + "+".join(v.codecs))
            if not v.checksum:
                extras.append("no checksum")
            if v.handler != "prng_key" and v.chunk_shape and tuple(v.chunk_shape) != tuple(v.shape):
                extras.append(f"chunks={list(v.chunk_shape)}")
            if v.sharding and v.sharding.get("type") == "named":
                extras.append(f"mesh={v.sharding.get('mesh')} spec={v.sharding.get('spec')}")
            out.append(
                f"{indent}{name}: {dtype}{list(v.shape)} {_human(v.nbytes)}"
                + (f"  ({', '.join(extras)})" if extras else "")
            )
        elif isinstance(v, dict | list | tuple):
            out.append(f"{indent}{name}/")
            _print_tree(v, indent + "  ", out, totals)
        else:
            tname = getattr(v, "__name__", str(v))
            out.append(f"{indent}{name}: {tname}")
            totals["inline"] += 1


def cmd_info(args: argparse.Namespace) -> int:
    import quire

    m = quire.metadata(args.url)
    if args.json:
        doc = {k: v for k, v in m.record.items() if not k.startswith("_")}
        print(json.dumps(doc, indent=2))
        return 0
    lines: list[str] = []
    totals = {"bytes": 0, "arrays": 0, "inline": 0}
    _print_tree(
        m.tree if isinstance(m.tree, dict | list | tuple) else {"<root>": m.tree},
        "  ",
        lines,
        totals,
    )
    print(f"checkpoint {m.url}")
    print(
        f"  format v{m.format_version}, written by quire {m.library_version}, "
        f"{m.process_count} process(es), created {m.created.isoformat()}"
    )
    print(
        f"  {totals['arrays']} arrays ({_human(totals['bytes'])}), {totals['inline']} inline leaves"
    )
    if m.custom:
        print("  metadata: " + json.dumps(m.custom, sort_keys=True))
    print("tree:")
    print("\n".join(lines))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from quire import _engine, _io
    from quire._url import normalize

    url = normalize(args.url)
    checked, problems = _io.submit(_engine.verify(url)).result()
    for p in problems:
        print(f"BAD  {p.path}: {p.object}: {p.error}")
    if problems:
        print(f"{url}: {len(problems)} of {checked} chunks failed verification", file=sys.stderr)
        return 1
    print(f"{url}: OK, {checked} chunks verified")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from quire._gc import cli_ls

    return cli_ls(args.root, step_format=args.step_format, as_json=args.json)


def cmd_gc(args: argparse.Namespace) -> int:
    from quire._gc import cli_gc

    return cli_gc(args.root, yes=args.yes, grace_period=args.grace, step_format=args.step_format)


def cmd_cp(args: argparse.Namespace) -> int:
    from quire._convert import cp_from_source
    from quire._copy import cli_cp

    rc = cp_from_source(args)  # SRC in another format (safetensors, Orbax...): convert it
    if rc is not None:
        return rc

    return cli_cp(
        args.src,
        args.dst,
        overwrite=args.overwrite,
        src_options=args.src_options,
        dst_options=args.dst_options,
        quiet=args.quiet,
    )


def cmd_plugins(args: argparse.Namespace) -> int:
    from quire._registry import registries

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
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="quire", description="Inspect and check quire checkpoints."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "info", help="show a checkpoint's tree (shapes, dtypes, sizes, codecs) and metadata"
    )
    p.add_argument("url")
    p.add_argument("--json", action="store_true", help="print the raw commit record")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser(
        "verify", help="read every chunk and check its checksum (exit 1 on any failure)"
    )
    p.add_argument("url")
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser(
        "plugins", help="list installed plugins per entry-point group, with their status"
    )
    p.set_defaults(fn=cmd_plugins)
    p = sub.add_parser("ls", help="list a Checkpointer root's steps: state, size, age and metrics")
    p.add_argument("root")
    p.add_argument("--step-format", help="step directory pattern (default: the root's own)")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(fn=cmd_ls)
    p = sub.add_parser(
        "gc",
        help="remove uncommitted steps and superseded data of a Checkpointer root "
        "(dry run unless --yes)",
    )
    p.add_argument("root")
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
    p = sub.add_parser(
        "cp",
        help="copy a committed checkpoint between any two URLs (local, s3://, gs://, ...): "
        "data first, checksums verified, commit record last",
    )
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST")
    p.add_argument("--src-options", metavar="JSON", help="storage_options for SRC")
    p.add_argument("--dst-options", metavar="JSON", help="storage_options for DST")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary")
    p.set_defaults(fn=cmd_cp)
    from quire._convert import add_export_parser

    add_export_parser(sub)
    args = parser.parse_args(argv)
    from quire.errors import QuireError

    try:
        return int(args.fn(args))
    except QuireError as e:
        print(f"quire {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"quire {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
