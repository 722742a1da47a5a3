"""The library's progress reports: a callback per call or per ``quire.Context``, totals over
any tree (the CLI's progress bars are in ``test_cli.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import quire
from quire.progress import Progress, ProgressEvent

pytestmark = pytest.mark.quick  # the quick tier (CONTRIBUTING.md)


def test_library_progress_callback_and_context(tmp_path: Path) -> None:
    events: list[ProgressEvent] = []
    x = np.ones((256, 256), np.float32)
    quire.save(tmp_path / "a", {"x": x, "n": 1}, progress=events.append)
    assert events[-1].finished and events[-1].operation == "save"
    assert events[-1].bytes_done == events[-1].bytes_total == x.nbytes
    events.clear()
    with quire.Context(progress=events.append):
        quire.load(tmp_path / "a")
    assert events[-1].operation == "load" and events[-1].bytes_done == x.nbytes
    assert events[-1].objects_done >= 1 and events[-1].eta == 0.0
    events.clear()
    quire.load(tmp_path / "a")  # off by default
    assert events == []
    with Progress("export", "x", callback=events.append, bytes_total=10) as p, \
            quire.progress.reporting(p, "export", "x"):  # fmt: skip
        quire.progress.advance(10)
    assert events[-1].bytes_done == 10 and events[-1].finished
    with pytest.raises(TypeError, match="progress"):
        quire.Context(progress="yes")


def test_save_progress_total_with_mixed_keys_and_pytree_nodes(tmp_path: Path) -> None:
    import collections

    Pair = collections.namedtuple("Pair", "a b")
    events: list[ProgressEvent] = []
    tree = {1: np.ones(3), "x": Pair(np.ones(2, np.float32), 7)}
    quire.save(tmp_path / "m", tree, progress=events.append)
    assert events[-1].bytes_total == events[-1].bytes_done == 24 + 8
