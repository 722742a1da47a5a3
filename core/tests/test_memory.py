"""Host memory during saves stays bounded (measured with tracemalloc, which numpy reports to)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np

import quire
from quire._runtime import config as _config

MiB = 1 << 20


def test_sync_save_streams_within_the_byte_budget(tmp_path: Path) -> None:
    tree = {f"a{i}": np.full(4 * MiB, i, np.float32) for i in range(24)}  # 24 x 16 MiB
    old = _config.current().byte_budget
    quire.configure(byte_budget=48 * MiB)
    try:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        # A cast and a compressor: every chunk needs new host memory.
        quire.save(
            str(tmp_path / "c"),
            tree,
            storage=quire.StorageOptions(dtype=ml_dtypes.bfloat16, codecs=["zstd"]),
        )
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        quire.configure(byte_budget=old)
    # Budget + one chunk (plus its encoded copy), far below the 384 MiB tree.
    assert peak < 48 * MiB + 3 * 16 * MiB, peak / MiB
    out = quire.load(str(tmp_path / "c"))
    assert out["a7"].dtype == ml_dtypes.bfloat16 and float(out["a7"][0]) == 7.0


def test_async_save_holds_one_host_copy(tmp_path: Path) -> None:
    tree = {f"a{i}": np.full(2 * MiB, i, np.float32) for i in range(16)}  # 128 MiB
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    r = quire.save_async(str(tmp_path / "c"), tree)
    r.result(timeout=120)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    assert 128 * MiB <= peak < 128 * MiB + 32 * MiB, peak / MiB


def test_sync_save_of_plain_arrays_copies_nothing(tmp_path: Path) -> None:
    tree = {f"a{i}": np.full(4 * MiB, i, np.float32) for i in range(16)}  # 256 MiB
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    quire.save(str(tmp_path / "c"), tree)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    assert peak < 16 * MiB, peak / MiB
