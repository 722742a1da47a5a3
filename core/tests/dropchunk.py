"""Faulty writers that lose one chunk, for the tests of "every chunk accounted for before the
commit" (issue 39): ``test_every_chunk.py``, the generated tests in one process and across
processes (``tests/multihost/props_worker.py``).

Each is a context manager that swaps one of quire's writing functions for one that loses a
chunk while saying it wrote it, and yields the list of what it lost - the oracle the tests
compare the outcome with, known without asking the code under test:

* :func:`dropping` - the array writer (``quire._handlers.arrays.write_chunk``) skips chunk
  number ``flat`` (C order in the chunk grid quire chose) of the leaf at a key path, in
  whichever process writes it: a write plan that gives a chunk to nobody.  Both layouts (a
  chunk missing from a process's pack and index, or an object never stored);
* :func:`dropping_borrowed` - an incremental save or promotion (``PackWriter._borrow``) loses
  the reference to an earlier step's bytes of one chunk.

And :func:`unchecked`, which publishes without the completeness check (as a quire before it
did) under one URL prefix: how the tests make the incomplete sources that a copy, a finalize
or a promotion must then refuse.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

from quire._engine import completeness as _completeness
from quire._format import pack as _pack
from quire._format.paths import escape_path
from quire._handlers import arrays as _arrays

Lost = list[tuple[str, tuple[int, ...]]]


def _unravel(flat: int, grid: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for g in reversed(grid):
        flat, i = divmod(flat, g)
        out.append(i)
    return tuple(reversed(out))


@contextlib.contextmanager
def dropping(path: tuple[Any, ...], flat: int = 0) -> Iterator[Lost]:
    """Lose chunk ``flat`` of the leaf at ``path`` (nothing when its grid is smaller);
    yields ``[(location, coords)]`` of the chunks lost."""
    lost: Lost = []
    real = _arrays.write_chunk
    tail = "/" + escape_path(path)

    async def write_chunk(backend: Any, location: str, layout: Any, coords: Any, data: Any) -> int:
        grid = layout.grid
        if (
            location.endswith(tail)
            and flat < math.prod(grid)
            and tuple(coords) == _unravel(flat, grid)
        ):
            lost.append((location, tuple(coords)))
            return 0
        return await real(backend, location, layout, coords, data)

    _arrays.write_chunk = write_chunk  # type: ignore[assignment]
    try:
        yield lost
    finally:
        _arrays.write_chunk = real


@contextlib.contextmanager
def dropping_borrowed(suffix: str) -> Iterator[list[str]]:
    """Lose every borrowed key ending with ``suffix`` (``"/w/c/1/0"``): the index of the
    step being written never references the earlier step's bytes of that chunk."""
    lost: list[str] = []
    real = _pack.PackWriter._borrow

    def borrow(self: Any, key: str, old: str) -> None:
        if key.endswith(suffix):
            lost.append(key)
            return
        real(self, key, old)

    _pack.PackWriter._borrow = borrow  # type: ignore[method-assign]
    try:
        yield lost
    finally:
        _pack.PackWriter._borrow = real  # type: ignore[method-assign]


@contextlib.contextmanager
def unchecked(under: str | None = None) -> Iterator[None]:
    """Publish without the completeness check, only for URLs starting with ``under`` when
    given (a local tier's roots, a copy's source)."""
    real = _completeness.check

    async def check(backend: Any, url: str, *a: Any) -> None:
        if under is not None and not url.startswith(str(under)):
            await real(backend, url, *a)

    _completeness.check = check  # type: ignore[assignment]
    try:
        yield
    finally:
        _completeness.check = real
