"""What every ``quire`` sub-command shares: exit codes, the usage error, and storage options
(``-o key=value`` / ``--storage-options JSON`` for both sides; ``--src-options`` /
``--dst-options`` / ``--a-options`` / ``--b-options`` for one side, and win)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXIT_OK, EXIT_DAMAGED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A bad command line (exit 2)."""


# ----------------------------------------------------------------------------- options
def _value(text: str) -> Any:
    """``-o key=value`` values: JSON when they parse (true, 3, {"a": 1}), else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """fsspec storage options from ``--storage-options JSON`` and ``-o key=value``."""
    opts: dict[str, Any] = {}
    if getattr(args, "storage_options", None):
        try:
            doc = json.loads(args.storage_options)
        except ValueError as e:
            raise UsageError(f"--storage-options takes a JSON object: {e}") from None
        if not isinstance(doc, dict):
            raise UsageError("--storage-options takes a JSON object, e.g. '{\"anon\": true}'")
        opts.update(doc)
    for item in getattr(args, "option", None) or []:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise UsageError(f"-o takes KEY=VALUE (e.g. -o anon=true), got {item!r}")
        opts[key] = _value(val)
    return opts or None


def progress_on(args: argparse.Namespace) -> bool:
    if args.progress is not None:
        return bool(args.progress)
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def one_side_options(so: dict[str, Any], text: str | None, what: str) -> dict[str, Any]:
    """``so`` updated with one side's ``--x-options JSON``."""
    if not text:
        return dict(so)
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise UsageError(f"{what} takes a JSON object, e.g. '{{\"anon\": true}}'")
    return {**so, **value}


def side_options(args: argparse.Namespace) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Storage options for SRC and DST: ``-o`` / ``--storage-options`` for both, updated
    by ``--src-options`` / ``--dst-options`` (JSON objects)."""
    so = storage_options(args) or {}
    out = [
        one_side_options(so, args.src_options, "--src-options") or None,
        one_side_options(so, args.dst_options, "--dst-options") or None,
    ]
    return out[0], out[1]
