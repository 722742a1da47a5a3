"""Small text helpers shared by the command-line tools."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``n`` bytes as a short human-readable size (``"512 B"``, ``"1.5 MiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover - the loop always returns
