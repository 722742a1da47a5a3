"""``quire.verify`` and ``quire.copy``: the library calls behind ``quire verify`` / ``quire cp``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import quire


def _tree() -> dict[str, Any]:
    return {
        "w": np.arange(4096, dtype=np.float32).reshape(64, 64),
        "b": np.ones(7, np.int16),
        "step": 3,
    }


def _largest_data_file(root: Path) -> Path:
    files = [p for p in (root / "d").rglob("*") if p.is_file() and not p.name.endswith(".json")]
    return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("layout", ["packed", "chunks"])
def test_verify_reports_whole_then_damaged(tmp_path: Path, layout: str) -> None:
    url = tmp_path / "ck"
    quire.save(url, _tree(), layout=layout)
    events: list[quire.progress.ProgressEvent] = []
    r = quire.verify(url, progress=events.append)
    assert r.ok and r.problems == () and (r.arrays, r.nbytes) == (2, 4096 * 4 + 14)
    assert r.chunks >= 2
    assert events[-1].finished and events[-1].operation == "verify"
    r.raise_if_damaged()  # whole: no error

    victim = _largest_data_file(url)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    bad = quire.verify(str(url))
    assert not bad.ok and [p.path for p in bad.problems] == ["w"]
    with pytest.raises(quire.CorruptCheckpointError, match=r"ck: 1 object\(s\) failed"):
        bad.raise_if_damaged()


def test_verify_of_nothing_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(quire.CheckpointNotFoundError):
        quire.verify(tmp_path / "missing")


def test_copy_quire_checkpoint_between_backends(tmp_path: Path) -> None:
    src = "memory://quire-ops-test/src"
    quire.save(src, _tree())
    try:
        events: list[quire.progress.ProgressEvent] = []
        res = quire.copy(src, tmp_path / "dst", progress=events.append)
        assert res.dst.endswith("dst") and res.verified > 0 and res.chunks >= 2
        assert res.format == "quire" and (res.arrays, res.nbytes) == (2, 4096 * 4 + 14)
        got = quire.load(tmp_path / "dst")
        assert np.array_equal(got["w"], _tree()["w"]) and got["step"] == 3
        assert events and events[-1].operation == "cp" and events[-1].finished
        with pytest.raises(quire.CheckpointExistsError):
            quire.copy(src, tmp_path / "dst")
        quire.save(src, {**_tree(), "step": 4}, overwrite=True)
        quire.copy(src, tmp_path / "dst", overwrite=True)
        assert quire.load(tmp_path / "dst")["step"] == 4
    finally:
        import fsspec

        fsspec.filesystem("memory").rm("/quire-ops-test", recursive=True)


def test_copy_converts_a_safetensors_file(tmp_path: Path) -> None:
    import safetensors.numpy as st

    tensors = {"model.w": np.arange(12, dtype=np.float32).reshape(3, 4), "model.b": np.ones(4)}
    st.save_file(tensors, str(tmp_path / "m.safetensors"))
    res = quire.copy(tmp_path / "m.safetensors", tmp_path / "q")
    assert res.verified > 0 and res.chunks == 2 and res.bytes == 12 * 4 + 4 * 8
    assert res.format == "safetensors" and (res.arrays, res.nbytes) == (2, 12 * 4 + 4 * 8)
    got = quire.load(tmp_path / "q")
    assert np.array_equal(got["model"]["w"], tensors["model.w"])
    assert np.array_equal(got["model"]["b"], tensors["model.b"])
    assert quire.verify(tmp_path / "q").ok
