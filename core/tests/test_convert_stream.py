"""``quire cp`` from a non-quire source streams: bounded host memory, one atomic commit,
verified, and reports through ``quire.progress``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import quire
from quire._cli.main import main
from quire._sources.convert import convert
from quire.errors import CheckpointNotFoundError

KIB = 1024


def _source(path: Path, n: int = 32, big: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    t = {f"layers.{i}.w": rng.standard_normal((256, 256)).astype(np.float32) for i in range(n)}
    if big:  # one tensor larger than the whole byte budget
        t["embed"] = rng.standard_normal((1024, 512)).astype(np.float32)
    save_file(t, str(path))
    return t


def _check(ck: Path, t: dict[str, np.ndarray]) -> None:
    got = quire.load(ck)
    for name, v in t.items():
        node = got
        for part in name.split("."):
            node = node[part]
        np.testing.assert_array_equal(node, v)


def test_cp_from_source_memory_is_bounded_by_the_budget_plus_one_tensor(tmp_path: Path) -> None:
    f = tmp_path / "big.safetensors"
    t = _source(f)
    total = sum(v.nbytes for v in t.values())  # 8 MiB + 2 MiB
    budget = 1024 * KIB
    biggest = max(v.nbytes for v in t.values())
    src = quire.open(f)
    # Warm up first: JAX's backend and lazy imports allocate once per process, not per byte.
    save_file({"w": np.zeros(4, np.float32)}, str(tmp_path / "warm.safetensors"))
    convert(quire.open(tmp_path / "warm.safetensors"), tmp_path / "warm")
    tracemalloc.start()
    try:
        with quire.Context(byte_budget=budget):
            nbytes, _ = convert(src, tmp_path / "ck", verify=False)  # the writing part
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert nbytes == total
    # The old conversion held the whole tree (10 MiB); this one a batch plus one tensor.
    assert total > 4 * (budget + biggest) // 2
    assert peak < budget + biggest + 512 * KIB, (peak, budget, biggest)
    assert src.bytes_read == total  # every tensor read exactly once
    _check(tmp_path / "ck", t)
    assert main(["verify", str(tmp_path / "ck")]) == 0
    md = quire.metadata(tmp_path / "ck")
    assert md.custom["source_format"] == "safetensors"


def test_interrupted_cp_leaves_no_checkpoint_and_keeps_the_old_one(tmp_path: Path) -> None:
    f = tmp_path / "s.safetensors"
    t = _source(f, n=12, big=False)
    src = quire.open(f)
    victim = src.tree["layers"]["7"]["w"]  # numeric components stay str keys
    reads = []

    async def failing(region: object) -> np.ndarray:
        reads.append(region)
        raise OSError("the source disk went away")

    victim.read_region = failing  # type: ignore[method-assign]
    ck = tmp_path / "ck"
    with quire.Context(byte_budget=4 * 256 * 256 * 4), pytest.raises(OSError, match="went away"):
        convert(src, ck)
    assert reads
    with pytest.raises(CheckpointNotFoundError):
        quire.load(ck)
    # Nothing of the aborted save is left behind (its txid's data was removed).
    assert not ck.exists() or not [p for p in ck.rglob("*") if p.is_file()]

    old = {"w": np.arange(10, dtype=np.int32)}
    quire.save(ck, old)
    with quire.Context(byte_budget=4 * 256 * 256 * 4), pytest.raises(OSError, match="went away"):
        convert(src, ck, overwrite=True)
    np.testing.assert_array_equal(quire.load(ck)["w"], old["w"])  # the old one, whole

    del victim.read_region  # the source reads again: the retry replaces it atomically
    convert(src, ck, overwrite=True)
    _check(ck, t)


# Converts argv[1] to argv[2] (overwrite) and stalls in the 6th tensor read, saying "ready".
KILLED_SCRIPT = """
import asyncio, sys
import quire
from quire._sources.convert import convert
from quire.sources import LazyArray

orig, n = LazyArray.read_region, [0]

async def stalling(self, region):
    n[0] += 1
    if n[0] == 6:
        print("ready", flush=True)
        await asyncio.sleep(120)
    return await orig(self, region)

LazyArray.read_region = stalling
with quire.Context(byte_budget=2 * 256 * 256 * 4):
    convert(sys.argv[1], sys.argv[2], overwrite=True)
"""


def test_killed_cp_leaves_no_checkpoint_or_the_old_one_whole(tmp_path: Path) -> None:
    f = tmp_path / "s.safetensors"
    _source(f, n=12, big=False)
    old = {"w": np.arange(10, dtype=np.int32)}
    quire.save(tmp_path / "old", old)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", KILLED_SCRIPT, str(f), str(tmp_path / dst)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for dst in ("fresh", "old")
    ]
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.strip() == "ready", p.stderr.read() if p.stderr else line
    for p in procs:  # mid-conversion: some tensors written, no commit yet
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=30)
        assert p.returncode == -signal.SIGKILL
    written = [p for p in (tmp_path / "fresh").rglob("*") if p.is_file()]
    assert written  # it was killed mid-write (data of the first batches is on disk) ...
    with pytest.raises(CheckpointNotFoundError):  # ... yet there is no checkpoint
        quire.load(tmp_path / "fresh")
    np.testing.assert_array_equal(quire.load(tmp_path / "old")["w"], old["w"])
    assert main(["verify", str(tmp_path / "old")]) == 0


def test_cp_from_source_reports_progress_events(tmp_path: Path) -> None:
    f = tmp_path / "s.safetensors"
    t = _source(f, n=6, big=False)
    events: list[quire.progress.ProgressEvent] = []
    nbytes, _ = convert(quire.open(f), tmp_path / "ck", progress=events.append)
    ops = [e.operation for e in events if e.finished]
    assert ops == ["cp", "verify"]
    cp = next(e for e in events if e.finished and e.operation == "cp")
    assert cp.bytes_done >= nbytes == sum(v.nbytes for v in t.values())
    assert cp.objects_done >= len(t)


def test_cli_cp_and_export_show_the_progress_bar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "s.safetensors"
    t = _source(f, n=4, big=False)
    ck = tmp_path / "ck"
    assert main(["cp", str(f), str(ck), "--progress"]) == 0
    out = capsys.readouterr()
    assert "cp:" in out.err and "objects" in out.err and "verified" in out.out
    _check(ck, t)
    # export takes the common options too (-o, --progress)
    assert (
        main(["export", str(ck), str(tmp_path / "e"), "--progress", "-o", "auto_mkdir=true"]) == 0
    )
    out = capsys.readouterr()
    assert "export:" in out.err and "4/4 objects" in out.err
    assert os.path.exists(tmp_path / "e" / "model.safetensors")
    assert main(["cp", str(f), str(tmp_path / "ck2"), "-q"]) == 0
    out = capsys.readouterr()
    assert out.err == "" and out.out == ""
