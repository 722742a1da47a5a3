"""What the processes of a multi-process Checkpointer agree on, with 2 real JAX processes:
the save decision of a policy whose answer differs between processes (every process follows
process 0's), and the step to restore.  Every agreement has a deadline: a process that never
takes part makes the others raise ``quire.errors.MultiProcessError`` naming it within
``quire.configure(timeout=...)``, never hang.  See ``tests/multihost/agreement_worker.py``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from multihost import harness

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="127.0.0.1 processes")

WORKER = Path(__file__).parent / "multihost" / "agreement_worker.py"
TIMEOUT = 4  # quire's deadline in the workers, seconds


def launch(tmp: Path, cfg: dict[str, Any], n: int = 2, timeout: float = 60) -> list[dict[str, Any]]:
    """Run ``n`` workers until all but ``cfg["absent"]`` (stuck: killed) end, or ``timeout``;
    the lines they reported."""
    run = harness.launch(
        WORKER, n, [json.dumps(cfg)], tmp, name=cfg["what"], timeout=timeout,
        stuck=cfg.get("absent"),
    )  # fmt: skip
    return run.results


def of(results: list[dict[str, Any]], check: str) -> list[dict[str, Any]]:
    return sorted((r for r in results if r["check"] == check), key=lambda r: r["pid"])


@pytest.mark.parametrize("absent", [2, 0])
def test_a_process_missing_from_the_save_decision_is_named_within_the_deadline(
    tmp_path: Path, absent: int
) -> None:
    """A time- or signal-based policy's answer is process 0's, on every process: with all
    three present they all save where only process 0's policy says so.  Then one process
    never asks: each other one raises ``MultiProcessError`` naming it within the deadline
    (they used to wait in a JAX broadcast forever)."""
    cfg = {"root": str(tmp_path / "root"), "timeout": TIMEOUT, "absent": absent, "what": "decide"}
    results = launch(tmp_path, cfg, n=3)
    assert not of(results, "failed"), of(results, "failed")[0]["error"][-3000:]
    assert [(r["what"], r["got"]) for r in of(results, "ok")] == [("first", True)] * 3
    errors = of(results, "error")
    assert [r["pid"] for r in errors] == [p for p in range(3) if p != absent], results
    for got in errors:
        assert got["type"] == "MultiProcessError", got
        assert f"process {absent} did not" in got["error"], got
        assert "save decision" in got["error"], got
        assert "timeout" in got["error"], got  # the fix: quire.configure(timeout=...)
        assert got["seconds"] < 2 * TIMEOUT + 3, got


def test_the_step_to_restore_is_agreed_within_the_deadline(tmp_path: Path) -> None:
    """``Checkpointer.load`` without a local tier: processes that ask for different steps
    all raise ``QuireError``; the newest step is the same everywhere; then process 1 never
    loads: process 0 raises ``MultiProcessError`` naming it within the deadline (it used to
    wait in a JAX all-gather forever)."""
    cfg = {"root": str(tmp_path / "root"), "timeout": TIMEOUT, "absent": 1, "what": "restore"}
    results = launch(tmp_path, cfg)
    assert not of(results, "failed"), of(results, "failed")[0]["error"][-3000:]
    errors = of(results, "error")
    different = [r for r in errors if r["what"] == "different steps"]
    assert [r["pid"] for r in different] == [0, 1], results
    for r in different:
        assert r["type"] == "QuireError" and "disagree on the step" in r["error"], r
    newest = [r["got"] for r in of(results, "ok") if r["what"] == "newest"]
    assert newest == [sum(range(4)) + 4 * 2] * 2, results
    (got,) = [r for r in errors if r["what"] == "restore"]
    assert got["pid"] == 0 and got["type"] == "MultiProcessError", got
    assert re.search(r"for process 1\b.*did not take part", got["error"]), got
    assert "timeout" in got["error"], got
    assert got["seconds"] < 2 * TIMEOUT + 3, got
