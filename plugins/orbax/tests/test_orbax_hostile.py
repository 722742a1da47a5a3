"""Hostile Orbax layouts (issue 21), written by orbax-checkpoint and then edited: item names
and tree keys that climb out of the checkpoint, and JSON nested too deeply for the parser.
Each is a typed quire error (``quire cp`` exits 1, no traceback) and nothing outside the
checkpoint is opened: an inotify watch on the outside files sees what tensorstore (C++)
opens too, which Python's audit hook would not."""

from __future__ import annotations

import ctypes
import json
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import quire
from quire._cli.main import main
from quire.errors import CorruptCheckpointError

pytestmark = [pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning")]

TREE = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.int32)}


@contextmanager
def opened_under(*paths: Path) -> Iterator[list[str]]:
    """inotify: the paths under ``paths`` opened or read while the block runs."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0
    wds = {libc.inotify_add_watch(fd, os.fsencode(p), 0x001 | 0x020): p for p in paths}
    assert all(w >= 0 for w in wds)
    out: list[str] = []
    try:
        yield out
    finally:
        try:
            while True:
                buf = os.read(fd, 1 << 16)
                at = 0
                while at < len(buf):
                    wd, _, _, n = struct.unpack_from("iIII", buf, at)
                    name = buf[at + 16 : at + 16 + n].rstrip(b"\0").decode()
                    out.append(f"{wds[wd]}/{name}")
                    at += 16 + n
        except BlockingIOError:
            pass
        finally:
            os.close(fd)


def _composite(root: Path) -> Path:
    """A CheckpointManager step with a pytree item and a JSON item, written by orbax."""
    with ocp.CheckpointManager(root, item_names=("state", "extra")) as mngr:
        mngr.save(
            1,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(TREE), extra=ocp.args.JsonSave({"epoch": 2})
            ),
        )
        mngr.wait_until_finished()
    return root / "1"


def _refused(path: Path, match: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(CorruptCheckpointError, match=match) as ei:
        quire.open(str(path))
    assert str(path) in str(ei.value)
    dst = path.parent / f"{path.name}-copy"
    assert main(["cp", str(path), str(dst), "-q"]) == 1
    err = capsys.readouterr().err
    assert "CorruptCheckpointError" in err and "Traceback" not in err
    assert not (dst / "quire.json").exists()


def _outside(tmp_path: Path) -> Path:
    """Outside the checkpoint: a pytree item and a JSON item an attacker points at."""
    out = tmp_path / "outside"
    _composite(tmp_path / "other")
    os.rename(tmp_path / "other" / "1", out)
    return out


@pytest.mark.parametrize("item", ["state", "extra"])
def test_item_names_that_leave_the_checkpoint_are_refused_and_never_read(
    tmp_path: Path, item: str, capsys: pytest.CaptureFixture[str]
) -> None:
    step = _composite(tmp_path / "run")
    outside = _outside(tmp_path)
    meta_path = step / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_path.read_text())
    handler = meta["item_handlers"].pop(item)
    meta["item_handlers"][f"../../outside/{item}"] = handler
    meta_path.write_text(json.dumps(meta))
    watched = [outside / item, *(p for p in (outside / item).iterdir() if p.is_file())]
    with opened_under(*watched) as seen:
        _refused(step, "names item", capsys)
    assert seen == []


@pytest.mark.parametrize("name", ["..", ".", "", "a/b", "/abs", "x\x00y"])
def test_every_bad_item_name_is_refused(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    step = _composite(tmp_path / "run")
    meta_path = step / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_path.read_text())
    meta["item_handlers"][name] = meta["item_handlers"].pop("state")
    meta_path.write_text(json.dumps(meta))
    _refused(step, "names item", capsys)


@pytest.mark.parametrize("key", ["..", "../../outside/state/w", "."])
def test_tree_keys_that_leave_the_item_are_typed(
    tmp_path: Path, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key of ``..`` reached tensorstore, which refused it with an untyped ValueError."""
    step = _composite(tmp_path / "run")
    _outside(tmp_path)
    meta_path = step / "state" / "_METADATA"
    meta = json.loads(meta_path.read_text())
    tm = meta["tree_metadata"]
    entry = tm.pop(next(k for k in tm if "'w'" in k))
    entry["key_metadata"] = [{"key": key, "key_type": 2}]
    tm[f"('{key}',)"] = entry
    meta_path.write_text(json.dumps(meta))
    _refused(step, "leaves the item directory", capsys)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["_CHECKPOINT_METADATA", "state/_METADATA", "extra/metadata"])
def test_json_nested_100k_deep_is_typed(
    tmp_path: Path, which: str, capsys: pytest.CaptureFixture[str]
) -> None:
    step = _composite(tmp_path / "run")
    doc: Any = "[" * 100_000 + "]" * 100_000
    (step / which).write_text('{"x": ' + doc + "}")
    _refused(step, "nested too deeply", capsys)


def test_a_dotdot_key_without_ocdbt_is_typed_and_reads_nothing_outside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without OCDBT a leaf is the directory ``<item>/<param>``: ``..`` named the parent."""
    ckpt = tmp_path / "ck"
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)) as ck:
        ck.save(ckpt, TREE)
    meta_path = ckpt / "_METADATA"
    meta = json.loads(meta_path.read_text())
    tm = meta["tree_metadata"]
    entry = tm.pop(next(k for k in tm if "'w'" in k))
    entry["key_metadata"] = [{"key": "..", "key_type": 2}]
    tm["('..',)"] = entry
    meta_path.write_text(json.dumps(meta))
    with opened_under(tmp_path) as seen:
        _refused(ckpt, "leaves the item directory", capsys)
    assert not [p for p in seen if not p.startswith(f"{tmp_path}/ck")]


@pytest.mark.timeout(60)
def test_a_fifo_as_orbax_metadata_is_refused_without_blocking(tmp_path: Path) -> None:
    """Detection passes over a FIFO (not a file: no source recognises the directory); named
    as Orbax, reading it would block in open(2) until a writer came."""
    step = _composite(tmp_path / "run")
    (step / "_CHECKPOINT_METADATA").unlink()
    os.mkfifo(step / "_CHECKPOINT_METADATA")
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        quire.open(str(step), format="orbax")
    with pytest.raises(quire.CheckpointNotFoundError, match="no installed quire source"):
        quire.open(str(step))


@pytest.mark.parametrize(
    ("impl", "match"),
    [
        ("no_such_prng", "which this JAX does not know"),
        (["threefry2x32"], "which this JAX does not know"),
        ("rbg", r"uint32 ending in shape \(4,\)"),  # threefry's (2,) key data
    ],
)
def test_a_forged_prng_key_record_is_typed(
    tmp_path: Path, impl: Any, match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """array_metadatas names the PRNG implementation a uint32 leaf is wrapped with: an
    unknown name, or key data of another shape, is damage (not a crash in jax)."""
    ckpt = tmp_path / "ck"
    with ocp.PyTreeCheckpointer() as ck:
        ck.save(ckpt, {**TREE, "rng": jax.random.key(3)})
    meta_path = ckpt / "array_metadatas" / "process_0"
    meta = json.loads(meta_path.read_text())
    (entry,) = [e for e in meta["array_metadatas"] if e["array_metadata"]["param_name"] == "rng"]
    entry["array_metadata"]["ext_metadata"]["random_key_impl"] = impl
    meta_path.write_text(json.dumps(meta))
    _refused(ckpt, rf"leaf rng .*{match}", capsys)


@pytest.mark.parametrize("forged", [123, 1.5, {"x": [1, 2]}, [1, 2], None, True])
def test_a_string_leaf_that_is_not_a_string_is_typed(
    tmp_path: Path, forged: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """_METADATA types the leaf a string: any other JSON value in _strings.json (a dict would
    become a subtree of the loaded tree) is damage, never returned as is."""
    ckpt = tmp_path / "ck"
    with ocp.PyTreeCheckpointer() as ck:
        ck.save(ckpt, {**TREE, "name": "run-7"})
    (ckpt / "_strings.json").write_text(json.dumps({"name": forged}))
    _refused(ckpt, r"string leaf name .*_strings\.json holds a .*, not a string", capsys)
