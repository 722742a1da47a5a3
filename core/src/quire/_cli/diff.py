"""``quire diff A B``: any two checkpoints or sources compared (``-o`` / ``--storage-options``
apply to both sides, ``--a-options`` / ``--b-options`` to one, and win).  A Checkpointer
root or a partial save on either side is refused in one line."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import quire
from quire._cli.common import EXIT_DAMAGED, EXIT_OK, one_side_options, progress_on, storage_options
from quire._cli.targets import Target, one_checkpoint, target
from quire._engine import metadata as _metadata
from quire._runtime import ioloop as _io
from quire._sources.opening import opened


def cmd_diff(args: argparse.Namespace) -> int:
    so = storage_options(args) or {}
    sides = [one_side_options(so, args.a_options, "--a-options"),
             one_side_options(so, args.b_options, "--b-options")]  # fmt: skip
    a, b = (target(u, o) for u, o in zip((args.a, args.b), sides))
    one_checkpoint(a, lambda u: f"quire diff {u} {args.b}")
    one_checkpoint(b, lambda u: f"quire diff {args.a} {u}")
    with contextlib.ExitStack() as stack:
        sa, sb = (stack.enter_context(opened(t.url, o)) for t, o in zip((a, b), sides))
        r = quire.diff(
            sa, sb, values=args.values, atol=args.atol, rtol=args.rtol,
            metadata=args.metadata, progress=progress_on(args),
        )  # fmt: skip
    print("\n".join(r.lines()))
    for line in _not_compared(((a, sides[0]), (b, sides[1]))):
        print(line)
    return EXIT_OK if r.same else EXIT_DAMAGED


def _not_compared(sides: tuple[tuple[Target, dict[str, Any]], ...]) -> list[str]:
    """A line per unit of a quire checkpoint that holds no arrays (a data iterator's
    state...): a diff compares trees of arrays, and says what it left out."""
    seen: dict[tuple[str, str], list[str]] = {}
    for label, (t, so) in zip("AB", sides):
        if t.kind != "checkpoint":
            continue
        doc = _io.submit(_metadata.record(t.url, so)).result()
        for name, unit in doc["units"].items():
            if unit.get("kind") != "pytree":
                kind = str(unit.get("handler", unit["kind"]))
                seen.setdefault((name, kind), []).append(label)
    return [
        f"# not compared (not arrays): unit {name} ({kind})"
        + ("" if len(labels) == len(sides) else f" in {labels[0]}")
        for (name, kind), labels in seen.items()
    ]
