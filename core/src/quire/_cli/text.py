"""Small text helpers shared by the command-line tools."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def human_bytes(n: float) -> str:
    """``n`` bytes as a short human-readable size (``"512 B"``, ``"1.5 MiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover - the loop always returns


def age(seconds: float | None) -> str:
    """A duration as ``quire ls`` and ``quire gc`` show ages (``"40s"``, ``"2h"``, ``"3.5d"``)."""
    if seconds is None:
        return "?"
    s = max(0.0, seconds)
    for limit, div, unit in ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h")):
        if s < limit:
            return f"{s / div:.0f}{unit}"
    return f"{s / 86400:.1f}d"


def metrics_text(m: dict[str, Any]) -> str:
    """A step's metrics as ``quire ls`` shows them (``loss=0.25 acc=0.9``)."""
    if not m:
        return "-"
    out = []
    for k, v in sorted(m.items()):
        out.append(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(out)


def summary(c: Any) -> str:
    """Arrays, chunks and bytes, as ``quire info``, ``verify`` and ``cp`` count them."""
    return f"{c.arrays} arrays, {c.chunks} chunks, {human_bytes(c.nbytes)}"


def table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows padded into columns; the last column is not padded."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
