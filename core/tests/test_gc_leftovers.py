"""Issue 35: a save killed as its folder appears leaves directories with no object in them
(``step_N/d/<txid>/%packs/``); ``quire ls`` shows them as incomplete and ``quire gc`` must
remove them once older than the grace period, in a Checkpointer root, under any prefix and
inside a committed checkpoint, never a live save's (young folders, partial saves, folders
holding data)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import quire
from quire._cli.main import main as cli

TXID = "0123456789abcdef"


def _tree() -> dict[str, np.ndarray]:
    return {"w": np.arange(12.0).reshape(3, 4)}


def leftover(at: Path, age: float = 7200.0) -> Path:
    """The folders a save killed between ``mkdir`` and its first file leaves at ``at``,
    ``age`` seconds old (0: now)."""
    packs = at / "d" / TXID / "%packs"
    packs.mkdir(parents=True)
    if age:
        old = time.time() - age
        for d in (packs, packs.parent, packs.parent.parent, at):
            os.utime(d, (old, old))
    return at


def rows(out: str) -> dict[str, str]:
    """``quire ls`` table rows by their first column."""
    return {ln.split()[0]: ln for ln in out.splitlines()[2:-1] if ln.strip()}


def test_gc_removes_an_empty_step_folder_of_a_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    with quire.Checkpointer(root) as c:
        c.save(1, _tree())
    step = leftover(root / "step_00000002")
    assert cli(["ls", str(root)]) == 0
    assert "incomplete" in rows(capsys.readouterr().out)["2"]
    assert cli(["gc", str(root), "--grace", "60"]) == 0  # dry run
    assert "would remove step_00000002/  (uncommitted step, 0 B, 2h old)" in capsys.readouterr().out
    assert step.exists()
    assert cli(["gc", str(root), "--grace", "60", "--yes"]) == 0
    assert "removed step_00000002/" in capsys.readouterr().out
    assert not step.exists() and (root / "step_00000001" / "quire.json").exists()
    assert cli(["ls", str(root)]) == 0
    assert set(rows(capsys.readouterr().out)) == {"1"}
    np.testing.assert_array_equal(quire.load(root / "step_00000001")["w"], _tree()["w"])


def test_gc_of_a_parent_prefix_removes_every_leftover(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parent = tmp_path / "P"
    with quire.Checkpointer(parent / "run") as c:
        c.save(1, _tree())
    quire.save(parent / "kept", _tree())
    leftover(parent / "run" / "step_00000002")  # a root's step, killed at once
    leftover(parent / "fresh")  # a plain first save, killed at once
    leftover(parent / "kept")  # an overwrite of a committed checkpoint, killed at once
    assert cli(["ls", str(parent)]) == 0
    listed = rows(capsys.readouterr().out)
    assert "incomplete" in listed["run/step_00000002"] and "incomplete" in listed["fresh"]
    assert cli(["gc", str(parent), "--grace", "60", "--yes"]) == 0
    out = capsys.readouterr().out
    assert "removed run/step_00000002/" in out
    assert f"removed fresh/d/{TXID}/" in out and f"removed kept/d/{TXID}/" in out
    assert not (parent / "run" / "step_00000002").exists() and not (parent / "fresh").exists()
    assert not (parent / "kept" / "d" / TXID).exists()
    assert cli(["ls", str(parent)]) == 0
    assert set(rows(capsys.readouterr().out)) == {"kept", "run/step_00000001"}
    np.testing.assert_array_equal(quire.load(parent / "kept")["w"], _tree()["w"])
    assert cli(["gc", str(parent), "--grace", "0", "--yes"]) == 0
    assert "no garbage to remove" in capsys.readouterr().out


def test_a_superseded_empty_txid_of_a_root_step_goes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    with quire.Checkpointer(root) as c:
        c.save(1, _tree())
    leftover(root / "step_00000001")  # an overwrite of step 1, killed at once
    assert cli(["gc", str(root), "--grace", "60", "--yes"]) == 0
    assert f"removed step_00000001/d/{TXID}/" in capsys.readouterr().out
    assert not (root / "step_00000001" / "d" / TXID).exists()
    np.testing.assert_array_equal(quire.load(root / "step_00000001")["w"], _tree()["w"])


def test_young_leftovers_and_live_saves_are_never_touched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    with quire.Checkpointer(root) as c:
        c.save(1, _tree())
    young = leftover(root / "step_00000002", age=0)  # a save that is starting now
    assert cli(["gc", str(root), "--yes"]) == 0  # the default grace period: an hour
    out = capsys.readouterr().out
    assert "kept step_00000002/" in out and "no garbage to remove" in out and young.exists()
    # A partial save (a journal) is never touched, whatever the grace period.
    quire.partial.save(tmp_path / "partial", _tree())
    leftover(tmp_path / "partial")
    # A folder that holds data is judged by its data's age, not the folders'.
    writing = leftover(tmp_path / "writing")
    (writing / "d" / TXID / "%packs" / "p00000-00000").write_bytes(b"young data")
    assert cli(["gc", str(tmp_path), "--grace", "60", "--yes"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "partial" / "d" / TXID / "%packs").is_dir()
    assert (writing / "d" / TXID / "%packs" / "p00000-00000").exists()
    assert f"kept writing/d/{TXID}/" in out and young.exists()
    np.testing.assert_array_equal(quire.partial.load(tmp_path / "partial")["w"], _tree()["w"])


KILLED = r"""
import sys, numpy as np, quire
with quire.Checkpointer(sys.argv[1]) as c:
    c.save(1, {"w": np.arange(12.0)})
    print("saved", flush=True)
    for step in range(2, 10_000):
        c.save(step, {"w": np.arange(12.0) + step})
"""


def test_a_save_killed_as_its_step_folder_appears_leaves_nothing_after_gc(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real SIGKILL the moment a new step's folder appears (what is left depends on the
    instant: empty folders or part of the data); gc with no grace period leaves only
    committed steps."""
    root = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-c", KILLED, str(root)], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"saved"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = [
                e
                for e in os.scandir(root)
                if e.name.startswith("step_") and e.name != "step_00000001"
            ]
            if new:
                p.kill()
                break
        else:
            pytest.fail("no second step appeared")
    finally:
        p.kill()
        p.wait(timeout=60)
    assert cli(["gc", str(root), "--grace", "0", "--yes"]) == 0
    capsys.readouterr()
    left = sorted(d.name for d in root.iterdir() if d.name.startswith("step_"))
    assert all((root / n / "quire.json").exists() for n in left), left
    assert cli(["ls", str(root)]) == 0
    assert "incomplete" not in capsys.readouterr().out
