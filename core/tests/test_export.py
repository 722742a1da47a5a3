"""quire.export to safetensors (read back by safetensors itself), quire cp / export CLI."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import quire
from quire._cli.main import main


def _read_all(path: Path) -> dict[str, np.ndarray]:
    out = {}
    with safe_open(str(path), framework="numpy") as f:
        for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            out[k] = f.get_tensor(k)
    return out


def _tree(seed: int = 0) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "dense": {"kernel": rng.standard_normal((8, 4)).astype(np.float32)},
            "norm": rng.standard_normal(4).astype(ml_dtypes.bfloat16),
        },
        "layers": [rng.standard_normal((3, 3)).astype(np.float16) for _ in range(3)],
        "step": 5,
        "name": "run-1",
    }


def test_export_quire_checkpoint_single_file(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    tree = _tree()
    quire.save(ck, tree)
    out = tmp_path / "m.safetensors"
    written = quire.export(ck, out)
    assert written == [str(out)]
    got = _read_all(out)
    assert set(got) == {
        "params.dense.kernel",
        "params.norm",
        "layers.0",
        "layers.1",
        "layers.2",
        "step",
    }
    np.testing.assert_array_equal(got["params.dense.kernel"], tree["params"]["dense"]["kernel"])
    np.testing.assert_array_equal(
        got["params.norm"].view(np.uint16), tree["params"]["norm"].view(np.uint16)
    )
    np.testing.assert_array_equal(got["layers.1"], tree["layers"][1])
    assert got["step"] == 5


def test_export_sharded_with_select_rename_dtype(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    t = {f"model.layers.{i}.w": rng.standard_normal((16, 16)).astype(np.float32) for i in range(6)}
    t["model.embed"] = rng.standard_normal((4, 16)).astype(np.float32)
    src_file = tmp_path / "src.safetensors"
    save_file(t, str(src_file), metadata={"format": "pt"})
    dst = tmp_path / "hf"
    progress: list[quire.progress.ProgressEvent] = []
    written = quire.export(
        src_file,
        dst,
        select=r"layers",
        rename=[(r"model\.layers\.(\d+)\.w", r"blocks.\1.kernel")],
        dtype="bfloat16",
        max_shard_bytes=3 * 16 * 16 * 2,
        progress=progress.append,
    )
    assert len(written) == 3 and written[-1].endswith("model.safetensors.index.json")
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(f"blocks.{i}.kernel" for i in range(6))
    assert index["metadata"]["total_size"] == 6 * 16 * 16 * 2
    last = progress[-1]  # the public progress events: one object per tensor written
    assert last.finished and last.operation == "export"
    assert (last.bytes_done, last.objects_done) == (6 * 16 * 16 * 2, 6)
    got: dict[str, np.ndarray] = {}
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as h:
            assert h.metadata() == {"format": "pt"}
        got.update(load_file(str(f)))
    for i in range(6):
        want = t[f"model.layers.{i}.w"].astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(
            got[f"blocks.{i}.kernel"].view(np.uint16), want.view(np.uint16)
        )
    # And back through quire: the exported directory is a source too.
    back = quire.load(dst, transform=lambda tr: tr["blocks"]["4"]["kernel"])
    assert back.dtype == ml_dtypes.bfloat16


def test_export_streams_within_the_byte_budget(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    t = {f"w{i}": rng.standard_normal((64, 64)).astype(np.float32) for i in range(10)}
    f = tmp_path / "s.safetensors"
    save_file(t, str(f))
    src = quire.open(f)
    with quire.Context(byte_budget=2 * 64 * 64 * 4):
        quire.export(src, tmp_path / "o.safetensors")
    got = load_file(str(tmp_path / "o.safetensors"))
    assert all(np.array_equal(got[k], v) for k, v in t.items())
    assert src.bytes_read == sum(v.nbytes for v in t.values())  # each tensor read once


def test_cli_cp_from_safetensors_and_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t = {"a.b": np.arange(6, dtype=np.float32).reshape(2, 3), "c": np.ones(4, np.int32)}
    f = tmp_path / "x.safetensors"
    save_file(t, str(f))
    ck = tmp_path / "ck"
    assert main(["cp", str(f), str(ck)]) == 0
    assert "verified" in capsys.readouterr().out
    got = quire.load(ck)
    np.testing.assert_array_equal(got["a"]["b"], t["a.b"])
    assert quire.metadata(ck).custom["source_format"] == "safetensors"
    # A quire SRC still goes through the byte-level copier.
    assert main(["cp", str(ck), str(tmp_path / "ck2"), "-q"]) == 0
    np.testing.assert_array_equal(quire.load(tmp_path / "ck2")["c"], t["c"])
    assert main(["export", str(ck), str(tmp_path / "e.safetensors"), "-q"]) == 0
    assert set(load_file(str(tmp_path / "e.safetensors"))) == {"a.b", "c"}
