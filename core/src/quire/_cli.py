"""The ``quire`` command line: info, verify, plugins."""

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


def cmd_plugins(args: argparse.Namespace) -> int:
    from quire._registry import registries

    for group, reg in registries.items():
        print(f"{group}:")
        infos = reg.report(load=True)
        if not infos:
            print("  (none)")
        for i in infos:
            ver = f" {i.version}" if i.version else ""
            print(f"  {i.name:<14} {i.distribution}{ver:<10} {i.status}")
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
