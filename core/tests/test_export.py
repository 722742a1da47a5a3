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


def _hf_two_shards(d: Path) -> None:
    d.mkdir()
    save_file({"a": np.arange(300, dtype=np.float32)}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"b": np.arange(300, dtype=np.float32)}, str(d / "model-00002-of-00002.safetensors"))
    wm = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))


def test_export_onto_its_own_source_is_refused_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "model.safetensors"
    save_file({"x": np.arange(4, dtype=np.float32)}, str(f))
    before = f.read_bytes()
    hf = tmp_path / "hf"
    _hf_two_shards(hf)
    shards = {p.name: p.read_bytes() for p in hf.iterdir()}
    (tmp_path / "link").symlink_to(hf)
    # The file onto itself, its directory (which would write model.safetensors there), an HF
    # directory into itself (by another spelling, and through a symlink), even overwrite=True.
    cases = [(f, f), (f, tmp_path), (hf, hf), (hf, f"{hf}/"), (hf, tmp_path / "link")]
    for src, dst in cases:
        for overwrite in (False, True):
            with pytest.raises(quire.CheckpointExistsError, match="is the source") as e:
                quire.export(src, dst, max_shard_bytes=1000, overwrite=overwrite)
            assert "another destination" in str(e.value)
    assert main(["export", str(hf), str(hf), "--max-shard-bytes", "1000", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("quire export: CheckpointExistsError:") and err.count("\n") == 1, err
    assert f.read_bytes() == before
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == shards
    assert quire.load(hf)["b"].sum() == 44850


def test_export_onto_an_existing_destination_needs_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src.safetensors"
    save_file({"x": np.arange(4, dtype=np.float32)}, str(src))
    other = tmp_path / "other.safetensors"
    save_file({"keep": np.ones(3, np.float32)}, str(other))
    with pytest.raises(quire.CheckpointExistsError, match="overwrite=True"):
        quire.export(src, other)
    assert main(["export", str(src), str(other), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("quire export: CheckpointExistsError:") and "--overwrite" in err
    assert set(load_file(str(other))) == {"keep"}
    assert main(["export", str(src), str(other), "-q", "--overwrite"]) == 0
    assert set(load_file(str(other))) == {"x"}
    # A directory holding an export: refused, then replaced whole (no stale index or shard
    # of the old export is left for a reader to find).
    hf = tmp_path / "hf"
    _hf_two_shards(hf)
    (hf / "config.json").write_text("{}")
    with pytest.raises(quire.CheckpointExistsError, match="overwrite=True"):
        quire.export(src, hf)
    assert quire.export(src, hf, overwrite=True) == [str(hf / "model.safetensors")]
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors"]
    assert quire.load(hf)["x"].tolist() == [0, 1, 2, 3]


@pytest.mark.filterwarnings("ignore:.*encountered in cast:RuntimeWarning")  # unsafe
def test_export_dtype_follows_the_cast_rule_of_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x = np.array([0.5, 1.7, 300.0, -1e9, np.nan], np.float32)
    src = tmp_path / "f.safetensors"
    save_file({"m.x": x, "n": np.array([1, 2], np.int32)}, str(src))
    for want in ("int8", np.uint8, "bool"):
        with pytest.raises(quire.errors.LossyCastError) as e:
            quire.export(src, tmp_path / "i.safetensors", dtype=want)
        msg = str(e.value)
        assert "'m.x'" in msg and "float32" in msg and str(np.dtype(want)) in msg, msg
        assert "casting='unsafe'" in msg and "a float dtype" in msg, msg
        assert e.value.mismatched and not (tmp_path / "i.safetensors").exists()
    assert main(["export", str(src), str(tmp_path / "u.safetensors"), "--dtype", "uint8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("quire export: LossyCastError:") and err.count("\n") == 1, err
    assert "--casting unsafe" in err
    # The cast asked for is made; floats narrow within their kind; ints stay as they are.
    quire.export(src, tmp_path / "u.safetensors", dtype="int8", casting="unsafe")
    assert load_file(str(tmp_path / "u.safetensors"))["m.x"].dtype == np.int8
    assert main(["export", str(src), str(tmp_path / "h.safetensors"), "--dtype", "float16"]) == 0
    got = load_file(str(tmp_path / "h.safetensors"))
    assert got["m.x"].dtype == np.float16 and got["n"].dtype == np.int32


def test_cli_export_bad_arguments_are_one_line_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "f.safetensors"
    save_file({"x": np.ones(2, np.float32)}, str(src))
    (tmp_path / "plain.txt").write_text("x")
    out = str(tmp_path / "o.safetensors")
    cases = [
        ([out, "--dtype", "nonsense"], "--dtype"),
        ([out, "--select", "("], "--select"),
        ([str(tmp_path / "plain.txt" / "x.safetensors")], "plain.txt"),
    ]
    for args, named in cases:
        assert main(["export", str(src), *args, "-q"]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("quire export: ") and err.count("\n") == 1, err
        assert named in err and "Traceback" not in err, err
    assert not Path(out).exists()
    with pytest.raises(ValueError, match="nonsense"):
        quire.export(src, out, dtype="nonsense")
    with pytest.raises(ValueError, match="regular expression"):
        quire.export(src, out, select="(")


def test_export_keys_joining_to_one_name_is_a_typed_error_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    q = tmp_path / "q"
    quire.save(q, {"a.b": np.zeros(2, np.float32), "a": {"b": np.ones(2, np.float32)}})
    out = tmp_path / "o.safetensors"
    with pytest.raises(quire.TreeMismatchError) as e:
        quire.export(q, out)
    msg = str(e.value)
    assert "('a.b',)" in msg and "('a', 'b')" in msg and "'a.b'" in msg, msg
    assert "quire.surgery.rename" in msg and e.value.mismatched, msg
    quire.save(tmp_path / "l", {"l": [np.ones(1)], "m": np.ones(1)})
    with pytest.raises(quire.TreeMismatchError, match=r"\('l', 0\).*\('m',\).*rename="):
        quire.export(tmp_path / "l", out, rename={"m": "l.0"})
    assert main(["export", str(q), str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("quire export: TreeMismatchError:") and err.count("\n") == 1, err
    assert not out.exists()
    # The fix the message gives works.
    quire.save(q, quire.surgery.rename(quire.load(q), {"a.b": "a_b"}), overwrite=True)
    quire.export(q, out)
    assert sorted(load_file(str(out))) == ["a.b", "a_b"]


def test_export_of_safetensors_names_round_trips_them(tmp_path: Path) -> None:
    # docs/surgery.md: names are split on "." only, so they round-trip exactly, "/" included.
    t = {"e/f": np.ones(2, np.float32), "g.h": np.zeros(3, np.int8), "i/j.k": np.ones(1)}
    src = tmp_path / "m.safetensors"
    save_file(t, str(src))
    quire.export(src, tmp_path / "o.safetensors")
    assert sorted(load_file(str(tmp_path / "o.safetensors"))) == sorted(t)
    hf = tmp_path / "hf"
    quire.export(src, hf, max_shard_bytes=8)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(t)
    with quire.open(hf) as back, quire.open(src) as orig:
        assert back.tree.keys() == orig.tree.keys() == {"e/f", "g", "i/j"}
