"""``quire diff A B``: any two checkpoints or sources compared (``-o`` / ``--storage-options``
apply to both sides, ``--a-options`` / ``--b-options`` to one, and win)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable

import quire
from quire._cli.common import EXIT_DAMAGED, EXIT_OK, one_side_options, progress_on, storage_options
from quire._sources.opening import opened


# ----------------------------------------------------------------------------- diff
def cmd_diff(args: argparse.Namespace) -> int:
    so = storage_options(args) or {}
    sides = [one_side_options(so, args.a_options, "--a-options"),
             one_side_options(so, args.b_options, "--b-options")]  # fmt: skip
    with contextlib.ExitStack() as stack:
        a, b = (stack.enter_context(opened(u, o)) for u, o in zip((args.a, args.b), sides))
        r = quire.diff(
            a, b, values=args.values, atol=args.atol, rtol=args.rtol,
            metadata=args.metadata, progress=progress_on(args),
        )  # fmt: skip
    print("\n".join(r.lines()))
    return EXIT_OK if r.same else EXIT_DAMAGED


def add_diff_parser(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = add(
        "diff",
        "compare two checkpoints or sources (quire, safetensors, HF directory, Orbax...): "
        "structure, shapes, dtypes, metadata, and with --values (or a tolerance) every "
        "value, read chunk by chunk (exit 1 when they differ)",
    )
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("--values", action="store_true", help="also compare values exactly")
    p.add_argument("--atol", type=float, help="compare values with this absolute tolerance")
    p.add_argument("--rtol", type=float, help="compare values with this relative tolerance")
    p.add_argument(
        "--metadata",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compare user metadata (default: only when A and B are in the same format)",
    )
    p.add_argument("--a-options", metavar="JSON", help="storage options for A only")
    p.add_argument("--b-options", metavar="JSON", help="storage options for B only")
    p.set_defaults(fn=cmd_diff)
