"""Readers during an overwrite (issue 13): a load whose data is deleted under it by an
overwrite re-reads the record and loads the new version, or raises
CheckpointChangedError — never "the checkpoint is damaged"."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import quire
from quire._store import local
from quire.errors import CheckpointChangedError, CheckpointNotFoundError, CorruptCheckpointError


@pytest.fixture(autouse=True)
def _v1_layout() -> Any:
    """These tests damage and inspect format-v1 chunk objects (one object per chunk);
    format v2's equivalents are in test_packed.py."""
    with quire.Context(layout="chunks"):
        yield


WRITER = textwrap.dedent(
    """
    import os, sys, time
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np, quire
    url, start, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    # The clock starts once imported (a loaded machine may take seconds to import jax), and
    # a looping writer overwrites at least twice whatever the machine's speed.
    until, at_least = time.time() + seconds, 2 if seconds else 1
    i = start
    while i - start < at_least or time.time() < until:
        quire.save(url, {f"w{k}": np.full(256, float(i), np.float32) for k in range(16)},
                   overwrite=True)
        i += 1
    print("SAVES", i - start)
    """
)


def _tree(v: float) -> dict[str, Any]:
    return {f"w{k}": np.full(256, v, np.float32) for k in range(16)}


def _overwrite(url: str, value: float) -> None:
    subprocess.run(
        [sys.executable, "-c", WRITER, url, str(int(value)), "0"],
        check=True,
        capture_output=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=120,
    )


def test_load_whose_data_is_deleted_by_an_overwrite_loads_the_new_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "ckpt")
    quire.save(url, _tree(1.0))
    orig = local.LocalBackend._get_into
    fired = threading.Event()

    def get_into(self: Any, key: str, *a: Any) -> Any:
        if "/c/" in key and not fired.is_set():
            fired.set()  # the reader has read the old record: overwrite it now
            _overwrite(url, 2.0)
        return orig(self, key, *a)

    monkeypatch.setattr(local.LocalBackend, "_get_into", get_into)
    got = quire.load(url)
    assert fired.is_set()
    assert all(float(v[0]) == 2.0 for v in got.values()), {k: v[0] for k, v in got.items()}


def test_real_damage_is_still_corrupt(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    quire.save(url, _tree(1.0))
    md = quire.metadata(url)
    os.remove(Path(url, md.tree["w3"].location, "c", "0"))
    with pytest.raises(CorruptCheckpointError) as ei:
        quire.load(url)
    assert not isinstance(ei.value, CheckpointChangedError)


def test_reader_looping_against_an_overwriting_writer(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    quire.save(url, _tree(0.0))
    seconds = 8.0
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, url, "1", str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    counts = {"ok": 0, "changed": 0, "not_found": 0, "corrupt": 0, "torn": 0}
    errors: list[str] = []
    try:
        while writer.poll() is None:
            try:
                got = quire.load(url)
            except CheckpointChangedError:
                counts["changed"] += 1
                continue
            except CheckpointNotFoundError:
                counts["not_found"] += 1
                continue
            except CorruptCheckpointError as e:
                counts["corrupt"] += 1
                errors.append(str(e))
                continue
            values = {float(v[0]) for v in got.values()}
            counts["ok" if len(values) == 1 else "torn"] += 1
    finally:
        out, err = writer.communicate(timeout=120)
    saves = int(out.split("SAVES")[1]) if "SAVES" in out else 0
    print(f"reader-during-overwrite: {saves} overwrites, loads {counts}")
    assert writer.returncode == 0, err
    assert counts["corrupt"] == 0 and counts["torn"] == 0, (counts, errors[:3])
    assert counts["not_found"] == 0, counts
    assert counts["ok"] > 0 and saves > 1, (counts, saves)
