"""Interpreter exit (issue 13): a ``save_async`` nobody awaited still commits, and its
error, if any, is logged; one exit hook serves every quire write."""

from __future__ import annotations

import logging
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import forkserver
import numpy as np
import pytest

import quire

SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np, quire, quire.partial
    url, mode = sys.argv[1], sys.argv[2]
    tree = {f"w{i}": np.full(1 << 18, float(i), np.float32) for i in range(24)}
    if mode == "plain":
        quire.save_async(url, tree)
    elif mode == "error":
        quire.save_async(url, tree)  # a checkpoint is there already: CheckpointExistsError
    elif mode == "awaited":
        try:
            quire.save_async(url, tree).result()
        except quire.CheckpointExistsError:
            print("CAUGHT")
    elif mode == "partial":
        quire.partial.save_async(url, tree)
    """
)


def _run(url: str, mode: str) -> subprocess.CompletedProcess[str]:
    return forkserver.run(
        ["-c", SCRIPT, url, mode], timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )


def test_unawaited_save_async_commits_before_exit(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    r = _run(url, "plain")
    assert r.returncode == 0, r.stderr
    assert Path(url, "quire.json").exists(), r.stderr
    got = quire.load(url)
    assert len(got) == 24 and float(got["w23"][0]) == 23.0


def test_unawaited_partial_save_async_commits_before_exit(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    r = _run(url, "partial")
    assert r.returncode == 0, r.stderr
    assert len(quire.partial.load(url)) == 24


def test_unawaited_error_is_logged_and_awaited_one_is_not(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    quire.save(url, {"x": 1})
    r = _run(url, "error")
    assert "nobody awaited" in r.stderr and "CheckpointExistsError" in r.stderr, r.stderr
    assert url in r.stderr
    r = _run(url, "awaited")
    assert "CAUGHT" in r.stdout and "nobody awaited" not in r.stderr, r.stderr


def test_checkpointer_wait_says_what_it_waits_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio

    from quire._engine import save as _saving

    orig = _saving.save_prepared

    async def slow(*a: Any, **k: Any) -> Any:
        await asyncio.sleep(1.5)
        return await orig(*a, **k)

    monkeypatch.setattr(_saving, "save_prepared", slow)
    caplog.set_level(logging.WARNING, logger="quire")
    with quire.Checkpointer(str(tmp_path / "run")) as ckpt:
        ckpt.save(1, {"x": np.ones(3)}, force=True)
    assert any("waiting for 1 background save" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
