"""Fixtures and helpers shared by the conformance suites."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


class UrlFixture:
    """A fresh checkpoint URL on each first-party backend (a local folder, ``memory://``).

    A suite subclass may override ``url`` to run against another backend.
    """

    @pytest.fixture(params=["file", "memory"])
    def url(self, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
        if request.param == "file":
            yield str(tmp_path / "ckpt")
            return
        u = f"memory://quire-suite/{uuid.uuid4().hex}"
        yield u
        from quire._store.memory import forget

        forget(u)


def record_of(url: str) -> dict[str, Any]:
    """The parsed commit record ``quire.json`` of a checkpoint."""
    import quire

    return dict(quire.metadata(url).record)


def local_files(root: str) -> list[Path]:
    """Every file under a local checkpoint, as paths relative to it."""
    base = Path(root)
    return sorted(p.relative_to(base) for p in base.rglob("*") if p.is_file())


def json_roundtrips(value: Any) -> bool:
    """Whether ``value`` is plain JSON (no NaN, no objects that only repr)."""
    return bool(json.loads(json.dumps(value, allow_nan=False)) == value)


def flip_byte(path: Path, offset: int = 0) -> None:
    raw = bytearray(path.read_bytes())
    if not raw:
        raw.append(0x5A)
    else:
        raw[offset % len(raw)] ^= 0x5A
    path.write_bytes(bytes(raw))
