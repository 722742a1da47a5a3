"""Hostile safetensors files and Hugging Face directories (issue 21): every one is a typed
quire error naming the URL (the CLI exits 1 with no traceback), nothing outside the directory
is opened (an inotify watch on the outside files: it sees what C code and raw system calls
open too), no read blocks (a FIFO), and a Hugging Face hub cache snapshot, whose files are
links into the cache, loads."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
from outside_watch import OutsideWatch
from safetensors.numpy import load_file, save_file

import quire
from quire._cli.main import main
from quire.errors import CorruptCheckpointError

T = {"a.w": np.arange(6, dtype=np.float32).reshape(2, 3), "a.b": np.ones(4, np.int32)}
INDEX = "model.safetensors.index.json"


def _header(doc: Any, data: bytes = b"", raw: bytes | None = None) -> bytes:
    body = raw if raw is not None else json.dumps(doc).encode()
    return struct.pack("<Q", len(body)) + body + data


def _hf(root: Path, weight_map: dict[str, str] | None = None, index: bytes | None = None) -> Path:
    """An HF directory: one shard written by safetensors, and an index naming it (or
    ``weight_map`` / the raw ``index`` bytes given)."""
    root.mkdir(parents=True, exist_ok=True)
    save_file(T, str(root / "model-00001-of-00001.safetensors"))
    wm = (
        weight_map
        if weight_map is not None
        else dict.fromkeys(T, "model-00001-of-00001.safetensors")
    )
    (root / INDEX).write_bytes(
        index if index is not None else json.dumps({"weight_map": wm}).encode()
    )
    return root


def _refused(url: Path | str, match: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The library raises CorruptCheckpointError naming ``url``; ``quire cp`` exits 1."""
    with pytest.raises(CorruptCheckpointError, match=match) as ei:
        quire.open(str(url))
    assert str(url) in str(ei.value)
    dst = Path(str(url) + "-copy")
    assert main(["cp", str(url), str(dst), "-q"]) == 1
    err = capsys.readouterr().err
    assert "CorruptCheckpointError" in err and "Traceback" not in err
    assert not dst.exists()


# ----------------------------------------------------------------------------- headers
def test_duplicate_tensor_names_are_refused_as_the_reference_library_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = (
        b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
        b' "x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}'
    )
    f = tmp_path / "dup.safetensors"
    f.write_bytes(_header(None, b"\0" * 8, raw))
    with pytest.raises(Exception):  # noqa: B017 - the reference refuses it too
        safetensors.safe_open(str(f), "np")
    _refused(f, "appears twice", capsys)


def test_non_string_metadata_values_are_refused_as_the_reference_library_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "meta.safetensors"
    doc = {"__metadata__": {"n": 3}, "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    f.write_bytes(_header(doc, b"\0" * 4))
    with pytest.raises(Exception):  # noqa: B017
        safetensors.safe_open(str(f), "np")
    _refused(f, "__metadata__", capsys)


@pytest.mark.timeout(60)
def test_json_nested_100k_deep_is_refused_typed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    f = tmp_path / "deep.safetensors"
    f.write_bytes(_header(None, b"", b'{"x": ' + deep + b"}"))
    _refused(f, "nested too deeply", capsys)
    d = _hf(tmp_path / "deepindex", index=b'{"weight_map": ' + deep + b"}")
    _refused(d, "nested too deeply", capsys)


def test_duplicate_names_in_an_hf_index_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = b'{"weight_map": {"a.w": "model-00001-of-00001.safetensors", "a.w": "x.safetensors"}}'
    d = _hf(tmp_path / "hf", index=raw)
    _refused(d, "appears twice", capsys)


def _two_shards(root: Path, weight_map: dict[str, str]) -> Path:
    """An HF directory of two shards that both hold ``a.w`` (s1 also ``c``, s2 also ``b``)."""
    root.mkdir(parents=True)
    save_file({"a.w": np.zeros(2, np.float32), "c": np.full(2, 7, np.float32)}, str(root / "s1"))
    save_file({"a.w": np.ones(2, np.float32), "b": np.ones(1, np.float32)}, str(root / "s2"))
    (root / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def test_a_tensor_two_shards_hold_is_refused_though_the_index_picks_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Which copy is the weight is not knowable (a loader reading every shard would keep the
    last): the directory is refused, naming both files."""
    d = _two_shards(tmp_path / "hf", {"a.w": "s1", "b": "s2", "c": "s1"})
    _refused(d, r"tensor 'a\.w' appears in two files, s1 and s2", capsys)


def test_a_tensor_a_shard_holds_but_the_index_omits_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Following the index alone would drop ``c`` without a word."""
    d = _two_shards(tmp_path / "hf", {"a.w": "s1", "b": "s2"})
    (d / "s2").unlink()
    save_file({"b": np.ones(1, np.float32)}, str(d / "s2"))
    _refused(d, rf"shard s1 holds tensor 'c', which {INDEX} does not list", capsys)


def test_an_index_that_names_no_tensor_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It would convert to an empty checkpoint, whatever the shards hold."""
    d = _hf(tmp_path / "hf", {})
    _refused(d, "weight_map names no tensor", capsys)


# ----------------------------------------------------------------------------- shard names
@pytest.mark.parametrize(
    "name",
    ["bad\x00name.safetensors", ".", "", "./", "sub/./x.safetensors", "a\\..\\x.safetensors"],
)
def test_shard_names_that_name_no_file_are_refused(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _hf(tmp_path / "hf", {"a.w": name, "a.b": "model-00001-of-00001.safetensors"})
    _refused(d, "shard name", capsys)


# ----------------------------------------------------------------------------- FIFOs
@pytest.mark.timeout(30)
def test_a_fifo_as_safetensors_file_or_hf_shard_is_refused_without_blocking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    _refused(fifo, "not a regular file", capsys)
    d = _hf(tmp_path / "hf")
    shard = d / "model-00001-of-00001.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    _refused(d, "not a regular file", capsys)
    single = tmp_path / "single"
    single.mkdir()
    os.mkfifo(single / "model.safetensors")
    _refused(single, "not a regular file", capsys)
    fifo_index = _hf(tmp_path / "hf2")
    (fifo_index / INDEX).unlink()
    os.mkfifo(fifo_index / INDEX)
    _refused(fifo_index, "not a regular file", capsys)


# ----------------------------------------------------------------------------- symlinks
def test_a_shard_linked_outside_the_directory_is_refused_and_never_opened(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file(T, str(outside / "secret.safetensors"))
    d = _hf(tmp_path / "hf")
    shard = d / "model-00001-of-00001.safetensors"
    shard.unlink()
    shard.symlink_to(outside / "secret.safetensors")
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "linked.safetensors").symlink_to(outside / "secret.safetensors")
    loop = tmp_path / "loop.safetensors"
    loop.symlink_to(loop)
    linked_index = _hf(tmp_path / "hf2")
    (outside / INDEX).write_bytes((linked_index / INDEX).read_bytes())
    (linked_index / INDEX).unlink()
    (linked_index / INDEX).symlink_to(outside / INDEX)
    with OutsideWatch(outside, outside / "secret.safetensors", outside / INDEX) as w:
        _refused(d, "outside", capsys)
        _refused(linked_index, "outside", capsys)
        _refused(tmp_path / "files" / "linked.safetensors", "outside", capsys)
        _refused(loop, "cannot be resolved", capsys)
    assert w.opened == []


def test_a_link_that_stays_inside_the_directory_is_followed(tmp_path: Path) -> None:
    d = _hf(tmp_path / "hf")
    (d / "real").mkdir()
    shard = d / "model-00001-of-00001.safetensors"
    shard.rename(d / "real" / "blob")
    shard.symlink_to("real/blob")
    got = quire.load(str(d))
    np.testing.assert_array_equal(got["a"]["w"], T["a.w"])


# ----------------------------------------------------------------------------- the hub cache
@pytest.mark.parametrize("shared_store", [False, True])
def test_a_hugging_face_hub_cache_snapshot_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_store: bool
) -> None:
    """The cache built by huggingface_hub's own code (no network): blobs under the
    repository folder (``models--org--name/blobs/<etag>``), snapshot files linking to them
    (``../../blobs/<etag>``), and, with ``shared_store``, repository blobs that link on into
    the cache-wide Xet store (``<cache>/blobs/<xx>/<hash>``), as huggingface_hub 1.x+ does."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import file_download, snapshot_download

    cache = tmp_path / "hub"
    repo_id, commit = "org/tiny", "0123456789abcdef0123456789abcdef01234567"
    storage = cache / file_download.repo_folder_name(repo_id=repo_id, repo_type="model")
    src = tmp_path / "made"
    _hf(src)
    for i, name in enumerate(sorted(p.name for p in src.iterdir())):
        blob = storage / "blobs" / f"{i:040x}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes((src / name).read_bytes())
        if shared_store:
            xet = f"{i:064x}"
            assert file_download.publish_blob_to_shared_store(
                blob_path=str(blob), xet_hash=xet, cache_dir=str(cache),
                expected_size=blob.stat().st_size,
            )  # fmt: skip
            assert blob.is_symlink()
        pointer = file_download._get_pointer_path(str(storage), commit, name)
        os.makedirs(os.path.dirname(pointer), exist_ok=True)
        file_download._create_symlink(str(blob), pointer, new_blob=False)
        assert os.path.islink(pointer) and not os.readlink(pointer).startswith("/")
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    snap = snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True)
    assert Path(snap) == storage / "snapshots" / commit
    want = load_file(str(src / "model-00001-of-00001.safetensors"))
    for url in (snap, f"{snap}/model-00001-of-00001.safetensors"):
        got = quire.load(url)
        np.testing.assert_array_equal(got["a"]["w"], want["a.w"])
        np.testing.assert_array_equal(got["a"]["b"], want["a.b"])


def test_a_snapshot_link_out_of_the_cache_repository_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file(T, str(outside / "secret.safetensors"))
    snap = tmp_path / "hub" / "models--org--x" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to("../../../../outside/secret.safetensors")
    with (
        OutsideWatch(outside / "secret.safetensors") as w,
        pytest.raises(CorruptCheckpointError, match="outside"),
    ):
        quire.open(str(snap))
    assert w.opened == []
