"""Conformance suite for sources (entry-point group ``quire.sources``).

Subclass :class:`SourceSuite`, name the format and write checkpoints in it::

    from quire.testing import SourceSuite

    class TestMySource(SourceSuite):
        source_format = "myformat"

        def write(self, directory, arrays):
            # arrays: {"a/b": np.ndarray, ...} ("/"-joined key paths); write them in your
            # format under `directory` (a pathlib.Path) and return the URL to open.
            ...

Never override a ``test_*`` method to make it pass.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

__all__ = ["SourceSuite"]


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "params/dense/kernel": rng.standard_normal((12, 6)).astype(np.float32),
        "params/dense/bias": rng.standard_normal(6).astype(np.float32),
        "params/embed": rng.standard_normal((5, 4, 3)).astype(np.float32),
        "count": np.arange(10, dtype=np.int32),
    }


def _find(tree: Any, path: str) -> Any:
    for k in path.split("/"):
        tree = tree[int(k)] if isinstance(tree, list | tuple) else tree[k]
    return tree


class SourceSuite:
    """Tests every source plugin passes.

    Attributes
    ----------
    source_format : str
        The ``quire.sources`` entry-point name (the coverage check counts it as covered).
    """

    group: ClassVar[str] = "quire.sources"
    source_format: ClassVar[str]

    def write(self, directory: Path, arrays: dict[str, np.ndarray]) -> str:
        """Write ``arrays`` in the source's format under ``directory``; return its URL.

        Parameters
        ----------
        directory : pathlib.Path
            An empty directory (a test's ``tmp_path``).
        arrays : dict of str to numpy.ndarray
            ``"/"``-joined key path -> array.

        Returns
        -------
        str
            The URL that the source's ``detect`` accepts and ``open`` opens.
        """
        raise NotImplementedError("a SourceSuite subclass writes checkpoints in its format")

    def _cls(self) -> Any:
        from quire._runtime.registry import sources

        return sources.get(self.source_format)

    def test_detect_and_open(self, tmp_path: Path) -> None:
        import quire

        url = self.write(tmp_path / "ck", _arrays())
        cls = self._cls()
        assert cls.format == self.source_format
        assert cls.detect(url, {}) is True
        src = quire.open(url)
        assert isinstance(src, quire.sources.Source) and src.format == self.source_format
        assert isinstance(src.metadata, dict)
        (tmp_path / "empty").mkdir()
        assert cls.detect(str(tmp_path / "empty"), {}) is False

    def test_arrays_are_lazy_and_equal(self, tmp_path: Path) -> None:
        import quire

        arrays = _arrays()
        src = quire.open(self.write(tmp_path / "ck", arrays))
        for path, want in arrays.items():
            leaf = _find(src.tree, path)
            assert isinstance(leaf, quire.sources.LazyArray), path
            assert leaf.shape == want.shape and leaf.dtype == want.dtype, path
            np.testing.assert_array_equal(leaf.read(), want)

    def test_read_region_returns_exactly_the_region(self, tmp_path: Path) -> None:
        import quire

        arrays = _arrays()
        src = quire.open(self.write(tmp_path / "ck", arrays))
        leaf = _find(src.tree, "params/embed")
        want = arrays["params/embed"]
        regions = [
            (slice(1, 4), slice(0, 4), slice(0, 3)),
            (slice(2, 3), slice(1, 3), slice(2, 3)),
            (slice(0, 5), slice(3, 4), slice(0, 1)),
            (slice(0, 0), slice(0, 4), slice(0, 3)),
        ]

        async def read_all() -> list[np.ndarray]:
            return list(await asyncio.gather(*(leaf.reader.read_region(r) for r in regions)))

        from quire._runtime.ioloop import submit

        for r, got in zip(regions, submit(read_all()).result()):
            assert got.shape == want[r].shape, r
            np.testing.assert_array_equal(np.asarray(got).view(want.dtype), want[r])
        np.testing.assert_array_equal(leaf[1:3, :, 2].read(), want[1:3, :, 2])
        np.testing.assert_array_equal(
            leaf.read(sharding=None, dtype=np.float64), want.astype(np.float64)
        )

    def test_loads_through_quire_load(self, tmp_path: Path) -> None:
        import quire

        arrays = _arrays()
        url = self.write(tmp_path / "ck", arrays)
        got = quire.load(url, transform=lambda t: {"k": _find(t, "params/dense/kernel")[2:5]})
        np.testing.assert_array_equal(got["k"], arrays["params/dense/kernel"][2:5])
