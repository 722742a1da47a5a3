"""The ``quire`` command line: its parser and dispatch (info, verify, ls, gc, cp, diff, export,
plugins).

Each sub-command lives in its own module (``info``, ``verify``, ``listing`` for ls, ``gc``,
``cp``, ``diff``, ``export``, ``plugins``), named here as ``"module:function"`` and imported
only when it runs: ``quire --help`` imports no command, ``quire ls`` and ``quire info``
import neither JAX nor zarr.

Exit status (every command): 0 success (checkpoint good, command done); 1 damage found
(a chunk or a record fails its checks: ``CorruptCheckpointError``; ``diff`` found differences);
2 usage error, nothing found at the URL, or a URL the command does not work on (a
Checkpointer root where it needs one checkpoint...: one line says what to run instead);
141 when the reader of the output went away (``quire info --json | head``), like other Unix
tools.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from quire._cli.common import EXIT_DAMAGED, EXIT_USAGE, UsageError
from quire._runtime.version import __version__
from quire.errors import CorruptCheckpointError, QuireError
from quire.options import CASTINGS


def _common() -> argparse.ArgumentParser:
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
    return common


def parser() -> argparse.ArgumentParser:
    """The ``quire`` command's parser; each sub-command's ``fn`` is ``"module:function"``."""
    common = _common()
    p0 = argparse.ArgumentParser(
        prog="quire",
        description="Inspect, check, copy and clean up quire checkpoints.",
        epilog="exit status: 0 ok; 1 damaged (verify, cp) or different (diff); "
        "2 usage error, nothing found at the URL, or a URL the command does not work on "
        "(one line says what to run instead)",
    )
    p0.add_argument("--version", action="version", version=f"quire {__version__}")
    sub = p0.add_subparsers(dest="command", required=True)

    def add(name: str, fn: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, parents=[common])
        p.set_defaults(fn=f"quire._cli.{fn}")
        return p

    p = add(
        "info",
        "info:cmd_info",
        "show what a checkpoint holds: a quire checkpoint's units and trees (shapes, dtypes, "
        "sizes, chunk grid, codecs, layout), a partial save's current state, another "
        "format's arrays and metadata (safetensors, HF directory, Orbax step...)",
    )
    p.add_argument("url")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the raw commit record (a partial save: its journal records; another "
        "format: its leaves and metadata)",
    )
    p = add(
        "verify",
        "verify:cmd_verify",
        "read every chunk of every unit (of a checkpoint or a partial save) and check its "
        "checksum (exit 1 on any failure)",
    )
    p.add_argument("url")
    p = add(
        "plugins",
        "plugins:cmd_plugins",
        "list installed plugins per entry-point group, with their status",
    )
    p = add(
        "ls",
        "listing:cmd_ls",
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
    p = add(
        "gc",
        "gc:cmd_gc",
        "remove data no commit record references, under a checkpoint, a Checkpointer root "
        "or any prefix holding them: killed saves (empty folders included), superseded "
        "data (dry run unless --yes)",
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
    p = add(
        "cp",
        "cp:cmd_cp",
        "copy a committed checkpoint between any two URLs (local, s3://, gs://, ...): "
        "data first, checksums verified, commit record last; another format's "
        "(safetensors, HF directory, Orbax...) is converted",
    )
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST")
    p.add_argument("--src-options", metavar="JSON", help="storage options for SRC only")
    p.add_argument("--dst-options", metavar="JSON", help="storage options for DST only")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary")
    p = add(
        "diff",
        "diff:cmd_diff",
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
    p = add(
        "export",
        "export:cmd_export",
        "write any checkpoint (quire, safetensors, Orbax with quire-orbax) as safetensors: "
        "one file, or HF-style shards + model.safetensors.index.json",
    )
    p.add_argument("src")
    p.add_argument("dst", help="a .safetensors URL, or a directory / prefix")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an export at DST (a .safetensors file, or a directory's "
        "model.safetensors, shards and index)",
    )
    p.add_argument("--select", metavar="REGEX", help="only tensors whose dotted name matches")
    p.add_argument(
        "--dtype",
        help="cast floating-point tensors, e.g. bfloat16 (other tensors stay as they are)",
    )
    p.add_argument(
        "--casting",
        choices=CASTINGS,
        default="same_kind",
        help="which casts --dtype may make (default same_kind: a float to an int or a bool "
        "is refused, as on load; unsafe makes it)",
    )
    p.add_argument(
        "--max-shard-bytes", type=int, default=None, help="largest shard (default 5 GiB)"
    )
    p.add_argument("--src-options", metavar="JSON", help="storage options for SRC only")
    p.add_argument("--dst-options", metavar="JSON", help="storage options for DST only")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary")
    return p0


def main(argv: list[str] | None = None) -> int:
    """Run the ``quire`` command with ``argv`` (default: ``sys.argv[1:]``); its exit status."""
    args = parser().parse_args(argv)
    module, _, name = args.fn.partition(":")
    try:
        code = int(getattr(importlib.import_module(module), name)(args))
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
