"""quire.LocalTier: a per-process local tier under the persistent one (one process).

What is proved here: saves go to the local tier every N steps; steps due for the persistent
tier are copied there from the local tier's stored bytes (same record, same txid, same pack
bytes: no second encode); the persistent tier counts a step only after its commit; load reads
the local tier first and falls back to the persistent one; retention runs per tier; a wiped
local directory restores from the persistent tier; peers>0 and several processes refuse
(incremental promotion: tests/test_incremental_tiers.py).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import quire
from quire._format import root as _root
from quire._store.local import LocalBackend
from quire._tiers import two_tiers
from quire.policies import EveryNSteps, LatestN


def tree(i: int) -> dict[str, Any]:
    return {"w": np.full((64, 8), i, np.float32), "b": np.arange(5, dtype=np.int64) + i, "i": i}


def name(step: int) -> str:
    return _root.DEFAULT_STEP_FORMAT.format(step)


def files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def ckpt(tmp: Path, **kw: Any) -> quire.Checkpointer:
    return quire.Checkpointer(
        tmp / "persistent",
        save_policy=EveryNSteps(4),
        local=quire.LocalTier(tmp / "local", save_policy=EveryNSteps(2), **kw),
    )


def test_local_every_n_persistent_from_local_bytes(tmp_path: Path) -> None:
    with ckpt(tmp_path) as c:
        saved = [s for s in range(1, 10) if c.save(s, tree(s))]
        c.wait()
        assert saved == [2, 4, 6, 8]
        assert c.steps() == [2, 4, 6, 8] and c.latest_step() == 8
        assert [c.tiers_of(s) for s in (2, 4, 5, 8)] == [
            ("local",), ("local", "persistent"), (), ("local", "persistent"),
        ]  # fmt: skip
    local = tmp_path / "local" / "process_00000"
    persistent = tmp_path / "persistent"
    assert sorted(p.name for p in persistent.glob("step_*")) == [name(4), name(8)]
    for s in (4, 8):
        # Promotion copies stored bytes: the same record (same txid) and the same data objects.
        assert files(persistent / name(s)) == files(local / name(s))
    assert json.loads((persistent / "checkpointer.json").read_bytes())["format"]


def test_load_local_first_then_persistent(tmp_path: Path) -> None:
    with ckpt(tmp_path) as c:
        for s in range(1, 9):
            c.save(s, tree(s))
        c.wait()
        # The persistent copy of step 8 is damaged; the local tier serves the load anyway.
        shutil.rmtree(tmp_path / "persistent" / name(8) / "d")
        got = c.load(None, tree(0))
        np.testing.assert_array_equal(got["w"], tree(8)["w"])
        assert got["i"] == 8
    # The local directory is wiped (a host replaced): a new Checkpointer finds the newest
    # step in any tier, here step 4, which only the persistent tier still holds.
    shutil.rmtree(tmp_path / "local")
    shutil.rmtree(tmp_path / "persistent" / name(8))
    with ckpt(tmp_path) as c:
        assert c.latest_step() == 4 and c.tiers_of(4) == ("persistent",)
        got = c.load(None, tree(0))
        np.testing.assert_array_equal(got["b"], tree(4)["b"])
        assert got["i"] == 4


def test_local_damage_falls_back_to_persistent_copy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with ckpt(tmp_path) as c:
        for s in range(1, 5):
            c.save(s, tree(s))
        c.wait()
        local = tmp_path / "local" / "process_00000" / name(4)
        for p in local.rglob("*"):
            if p.is_file() and "/d/" in str(p) and p.stat().st_size > 100:
                p.write_bytes(p.read_bytes()[:-7])  # truncated pack
        got = c.load(4, tree(0))
        np.testing.assert_array_equal(got["w"], tree(4)["w"])
    assert "step 4 is damaged in the local tier" in caplog.text


def test_retention_per_tier(tmp_path: Path) -> None:
    with quire.Checkpointer(
        tmp_path / "p",
        save_policy=EveryNSteps(4),
        keep=LatestN(1),
        local=quire.LocalTier(tmp_path / "l", save_policy=EveryNSteps(1), keep=LatestN(2)),
    ) as c:
        for s in range(1, 13):
            c.save(s, tree(s))
        c.wait()
        assert c.tiers_of(12) == ("local", "persistent")
        assert c.steps() == [11, 12]
    assert sorted(p.name for p in (tmp_path / "p").glob("step_*")) == [name(12)]
    assert sorted(p.name for p in (tmp_path / "l/process_00000").glob("step_*")) == [
        name(11), name(12),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("persistent_every", "local_every", "persistent_keep", "local_keep"),
    [(2, 1, 2, 2), (3, 1, 1, 2), (1, 2, 2, 1), (2, 2, 1, 1)],
)
def test_steps_are_both_tiers_each_kept_by_its_own_policy(
    tmp_path: Path, persistent_every: int, local_every: int, persistent_keep: int, local_keep: int
) -> None:
    """``steps()`` is the union of what each tier's keep policy keeps of the steps that tier
    saved (the local tier saves every step either policy saves), as documented: with
    ``LatestN(2)`` for both it may list 3 steps, and that is no retention defect."""
    with quire.Checkpointer(
        tmp_path / "p",
        save_policy=EveryNSteps(persistent_every),
        keep=LatestN(persistent_keep),
        local=quire.LocalTier(
            tmp_path / "l", save_policy=EveryNSteps(local_every), keep=LatestN(local_keep)
        ),
    ) as c:
        saved = [s for s in range(1, 8) if c.save(s, tree(s))]
        c.wait()
        persistent = [s for s in saved if s % persistent_every == 0][-persistent_keep:]
        local = saved[-local_keep:]
        assert c.steps() == sorted({*persistent, *local})
        for s in c.steps():
            want = ("local",) * (s in local) + ("persistent",) * (s in persistent)
            assert c.tiers_of(s) == want, s
    assert sorted(p.name for p in (tmp_path / "p").glob("step_*")) == [name(s) for s in persistent]
    assert sorted(p.name for p in (tmp_path / "l/process_00000").glob("step_*")) == [
        name(s) for s in local
    ]


def test_failed_promotion_never_moves_persistent_latest(tmp_path: Path) -> None:
    c = ckpt(tmp_path)
    c.save(4, tree(4))
    c.wait()
    # A file where step 8's directory must go: the promotion's writes fail (a real OSError).
    (tmp_path / "persistent" / name(8)).write_bytes(b"in the way")
    c.save(8, tree(8))
    with pytest.raises(OSError) as err:
        c.wait()
    assert "promotion of step 8" in "".join(getattr(err.value, "__notes__", []))
    assert c.tiers_of(8) == ("local",) and c.tiers_of(4) == ("local", "persistent")
    assert not (tmp_path / "persistent" / name(8)).is_dir()
    # The loop goes on: the next persistent step promotes.
    (tmp_path / "persistent" / name(8)).unlink()
    c.save(12, tree(12))
    c.close()
    assert (tmp_path / "persistent" / name(12) / "quire.json").exists()


def test_a_failed_local_save_does_not_count_as_saved(tmp_path: Path) -> None:
    # hunt3 finding 5, with a local tier: after step 8's local save failed (and so its
    # promotion), should_save(8) stayed False and save(8) did nothing.
    c = ckpt(tmp_path)
    c.save(4, tree(4))
    c.wait()
    blocker = tmp_path / "local" / "process_00000" / name(8)
    blocker.write_bytes(b"in the way")  # a real OSError for the local save
    assert c.save(8, tree(8))
    with pytest.raises(quire.QuireError, match="File exists"):
        c.wait()
    blocker.unlink()
    assert c.latest_step() == 4 and c.should_save(8)
    assert c.save(8, tree(8))
    c.close()
    assert c.tiers_of(8) == ("local", "persistent")


def test_wait_waits_for_a_local_deletion_a_promotion_held_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local step being promoted is pinned, so the local keep policy defers its deletion
    until the promotion ends.  ``wait()`` waits for that deletion too, and raises its error
    (it used to return as soon as the promotion ended, with the deletion still to run)."""
    go = threading.Event()
    copy = two_tiers.copy_checkpoint

    async def held(*args: Any, **kw: Any) -> Any:  # the promotion waits for the test
        while not go.is_set():
            await asyncio.sleep(0.01)
        return await copy(*args, **kw)

    delete = LocalBackend.delete

    async def refused(self: LocalBackend, keys: Sequence[str]) -> None:
        if any(k.endswith(f"{name(2)}/quire.json") for k in keys):
            raise PermissionError("deletion of the local step 2 refused (test)")
        await delete(self, keys)

    monkeypatch.setattr(two_tiers, "copy_checkpoint", held)
    monkeypatch.setattr(LocalBackend, "delete", refused)
    c = quire.Checkpointer(
        tmp_path / "p",
        save_policy=EveryNSteps(2),
        local=quire.LocalTier(tmp_path / "l", save_policy=EveryNSteps(1), keep=LatestN(1)),
    )
    try:
        for s in (1, 2, 3):  # step 2 is promoted (held), step 3 saved locally meanwhile
            c.save(s, tree(s))
        while not (tmp_path / "l/process_00000" / name(3) / "quire.json").exists():
            time.sleep(0.01)
        time.sleep(0.5)  # the local keep policy ran after step 3: step 2 pinned, deferred
        go.set()
        with pytest.raises(PermissionError, match="local step 2 refused"):
            c.wait()
        assert c.tiers_of(2) == ("local", "persistent")  # the deletion failed: still held
    finally:
        go.set()
        c.close()


def test_checkpointables_in_the_local_tier(tmp_path: Path) -> None:
    with ckpt(tmp_path) as c:
        c.save_checkpointables(2, {"state": tree(2), "data": {"epoch": 3, "pos": 17}})
        c.wait()
        assert c.tiers_of(2) == ("local",)
        got = c.load_checkpointables(2)
        assert got["data"] == {"epoch": 3, "pos": 17}
        np.testing.assert_array_equal(got["state"]["w"], tree(2)["w"])


def test_should_save_is_either_policy(tmp_path: Path) -> None:
    with quire.Checkpointer(
        tmp_path / "p",
        save_policy=EveryNSteps(3),
        local=quire.LocalTier(tmp_path / "l", save_policy=EveryNSteps(2)),
    ) as c:
        assert [s for s in range(1, 10) if c.should_save(s)] == [2, 3, 4, 6, 8, 9]
        for s in range(1, 10):
            c.save(s, tree(s))
        c.wait()
        assert [c.tiers_of(s) for s in (2, 3, 6)] == [
            ("local",), ("local", "persistent"), ("local", "persistent"),
        ]  # fmt: skip


def test_refusals(tmp_path: Path) -> None:
    assert quire.LocalTier(tmp_path, peers=1).peers == 1  # copies need several processes
    with pytest.raises(TypeError, match="peer_host"):
        quire.LocalTier(tmp_path, peer_host="")
    with pytest.raises(ValueError, match="peers"):
        quire.LocalTier(tmp_path, peers=-1)
    with pytest.raises(TypeError, match="LocalTier"):
        quire.Checkpointer(tmp_path, local=str(tmp_path))  # type: ignore[arg-type]


def test_quire_ls_shows_tiers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from quire._cli.main import main as cli

    with ckpt(tmp_path) as c:
        for s in range(1, 7):
            c.save(s, tree(s))
    assert cli(["ls", str(tmp_path / "persistent"), "--local", str(tmp_path / "local")]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln.split()[2:4] for ln in out.splitlines()[2:]}
    assert lines["2"] == ["local:0", "-"]
    assert lines["4"][:2] == ["local:0", "persistent"]
    assert (
        cli(["ls", str(tmp_path / "persistent"), "--local", str(tmp_path / "local"), "--json"]) == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["tiers"]) for r in rows] == [
        (2, ["local:0"]), (4, ["local:0", "persistent"]), (6, ["local:0"]),
    ]  # fmt: skip


def test_preemption_notice_on_the_local_policy(tmp_path: Path) -> None:
    import os
    import signal

    from quire.policies import OnPreemption

    with quire.Checkpointer(
        tmp_path / "p",
        save_policy=EveryNSteps(100),
        local=quire.LocalTier(tmp_path / "l", save_policy=EveryNSteps(10) | OnPreemption()),
    ) as c:
        assert not c.should_save(3) and not c.preempted
        os.kill(os.getpid(), signal.SIGTERM)
        assert c.should_save(3)
        assert c.save(3, tree(3)) and c.preempted
        c.wait()
        assert c.tiers_of(3) == ("local",)


def test_exit_without_close_finishes_local_save_and_promotion(tmp_path: Path) -> None:
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import numpy as np, quire
        from quire.policies import EveryNSteps
        c = quire.Checkpointer({str(tmp_path / "p")!r}, save_policy=EveryNSteps(2),
                               local=quire.LocalTier({str(tmp_path / "l")!r}))
        c.save(2, {{"w": np.arange(1 << 20, dtype=np.float32)}})
    """)  # the interpreter exits with the save and its promotion in flight
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for root in (tmp_path / "p", tmp_path / "l" / "process_00000"):
        assert (root / name(2) / "quire.json").exists(), root
    np.testing.assert_array_equal(
        quire.load(tmp_path / "p" / name(2))["w"], np.arange(1 << 20, dtype=np.float32)
    )
