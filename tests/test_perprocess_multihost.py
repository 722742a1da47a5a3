"""A Grain iterator per JAX process: 2 real processes (``tests/multihost/perproc_worker.py``),
each with its own pipeline at its own position, save it as one per-process unit through
``quire.save_checkpointables`` (blocking and async), a persistent ``Checkpointer``, and a
``Checkpointer`` with a local tier (peer copies over TCP; an incremental persistent root);
fresh processes restore it and each resumes at its own position, process 1's part of the
local step coming from process 0's copy after its own local root is lost.  A load by another
number of processes fails naming the unit, both ways (1 -> 2 in the workers, 2 -> 1 here).

Two launches of 2 processes in all (save, then restore), every case inside each.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from multihost import harness

import quire

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="127.0.0.1 processes")
grain = pytest.importorskip("grain", reason="quire-grain's tests need grain (requirements-dev)")

WORKER = Path(__file__).parent / "multihost" / "perproc_worker.py"
N = 2
CASES = ("blocking", "async", "ckpt", "tier", "tier-inc")


def launch(tmp: Path, cfg: dict[str, Any], timeout: float = 240) -> list[dict[str, Any]]:
    run = harness.launch(
        WORKER, N, [json.dumps(cfg)], tmp / "logs", name=cfg["phase"], devices=2, timeout=timeout
    )
    failed = [r["error"][-3000:] for r in run.results if r["check"] == "failed"]
    errs = [e[-3000:] for e in run.stderr]
    assert not failed, failed[0]
    assert run.returncodes == [0] * N, errs
    assert sorted(r["pid"] for r in run.of("done")) == list(range(N)), errs
    return run.results


def of(results: list[dict[str, Any]], check: str) -> list[dict[str, Any]]:
    return sorted((r for r in results if r["check"] == check), key=lambda r: r["pid"])


def position(case: str, pid: int, step: int = 0) -> int:
    """perproc_worker.position, for process ``pid``."""
    base = {"blocking": 3, "async": 5, "ckpt": 7, "tier": 11, "tier-inc": 13}[case]
    return base + 4 * pid + (1 + pid) * step


def states(ckpt: Path) -> dict[str, Any]:
    """Each process's stored Grain state of unit ``data`` (its object, less the crc32c)."""
    unit = quire.metadata(str(ckpt)).record["units"]["data"]
    base = ckpt / unit["location"]
    files = sorted(p for p in base.rglob("*") if p.is_file())
    return {str(p.relative_to(base)): json.loads(p.read_bytes()[:-4]) for p in files}


def test_two_processes_each_resume_their_own_iterator(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    cfg = {"root": str(root), "timeout": 30}
    results = launch(tmp_path, {**cfg, "phase": "save"})
    saved = {r["case"]: r["tiers"] for r in of(results, "saved")}  # the primary's view
    assert saved["tier"] == {"1": ["local"], "2": ["local", "persistent"], "3": ["local"]}
    assert saved["tier-inc"] == {"1": ["local"], "2": ["local", "persistent"]}

    # The record names the unit with its process count, one record per process; each
    # process's own position under its own folder (the async one: at the call).
    for name, step in (("blocking", 0), ("async", 0), ("ckpt/step_00000003", 3),
                       ("tier/step_00000002", 2), ("tier-inc/step_00000002", 2)):  # fmt: skip
        url = root / name
        case = name.split("/")[0]
        unit = quire.metadata(str(url)).record["units"]["data"]
        assert unit["handler"] == "grain" and unit["processes"] == N, unit
        assert unit["records"] == [{"kind": "dataset", "version": 1}] * N
        assert states(url) == {
            f"p{p:05d}/state.json": {"next_index": position(case, p, step)} for p in range(N)
        }, name
        assert quire.verify(str(url)).ok
    # Each process's local root holds its own folder and its peer's copy, both marked.
    for p in range(N):
        (txdir,) = (root / "tier-local" / f"process_{p:05d}" / "step_00000003" / "d").iterdir()
        assert sorted(f.name for f in (txdir / "data").iterdir()) == ["p00000", "p00001"]
        assert sorted(f.name for f in (txdir / "%tier").iterdir()) == ["p00000.json",
                                                                      "p00001.json"]  # fmt: skip
        marked = json.loads((txdir / "%tier" / "p00001.json").read_text())["objects"]
        assert [k.split("/", 2)[2] for k in marked] == ["data/p00001/state.json"], marked

    # A load by one process of what two saved: refused, naming the unit and the fix.
    with pytest.raises(quire.TreeMismatchError, match=r"unit 'data'.*saved by 2 process"):
        quire.load_checkpointables(str(root / "blocking"), {"data": None})
    with (
        quire.Checkpointer(str(root / "ckpt")) as ck,
        pytest.raises(quire.TreeMismatchError, match=r"unit 'data'.*this run has 1"),
    ):
        ck.load_checkpointables(3, {"data": None})
    one = iter(grain.MapDataset.range(10).to_iter_dataset())
    next(one)
    quire.save_checkpointables(str(root / "one"), {"data": one})

    # Fresh processes; process 1's local root is gone: its part of step 3 is process 0's copy.
    shutil.rmtree(root / "tier-local" / "process_00001")
    results = launch(tmp_path, {**cfg, "phase": "restore"})
    restored = of(results, "restored")
    want = {(c, s) for c in CASES for s in {"blocking": [0], "async": [0], "ckpt": [3, 2],
                                            "tier": [3, 2], "tier-inc": [2]}[c]}  # fmt: skip
    for p in range(N):
        mine = [r for r in restored if r["pid"] == p]
        assert {(r["case"], r["step"]) for r in mine} == want, mine
        bad = [r for r in mine if not r["ok"]]
        assert not bad, bad
    read = {r["pid"]: r["read"] for r in of(results, "tier-read")}
    assert read[0] == {} and list(read[1]) == ["process 0"], read
    for r in of(results, "one"):
        assert r["error"] and "unit 'data'" in r["error"], r
        assert "saved by 1 process" in r["error"] and "this run has 2" in r["error"], r
