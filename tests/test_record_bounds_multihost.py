"""The record's bounds hold what replica-parallel writes produce, with real processes (issue 29).

4 JAX processes x 2 CPU devices, mesh (4, 2) ("data", "model") with "data" across the
processes, save arrays whose shards every process holds a copy of (``P(None, "model")``):
replica-parallel writes cut each such shard into up to 2 pieces per holder, so a
(2050, 4096) array gets 2 x 5 = 10 chunks on an 8-device mesh.  Before the fix the record
check allowed one chunk per device: the save committed and every load refused it
("... cuts shape (2050, 4096) into 10 chunks, more than the 8 a saved array can have").
Here both layouts load bit-exact on the same 4 processes and on 1 process with 8 devices,
and verify clean.  See ``tests/multihost/bounds_worker.py`` for the tree (odd, prime, 0-d,
size-0 and inner-chunked arrays beside the issue's one).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from multihost import harness

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="127.0.0.1 JAX processes")

WORKER = Path(__file__).parent / "multihost" / "bounds_worker.py"


def _launch(mode: str, nproc: int, ndev: int, workdir: Path, timeout: float = 120) -> list[Any]:
    """Run the worker as ``nproc`` processes; their result lines (every process must end)."""
    run = harness.launch(
        WORKER,
        nproc,
        [mode, str(workdir)],
        workdir / "logs",
        name=f"{mode}-{nproc}x{ndev}",
        devices=ndev,
        timeout=timeout,
    )
    failed = [r for r in run.results if "failed" in r] + [
        err[-3000:] for err, rc in zip(run.stderr, run.returncodes) if rc
    ]
    assert not failed, failed
    assert len(run.of("done")) == nproc, run.results
    return run.results


def test_replicated_shards_cut_finer_than_the_mesh_load_everywhere(tmp_path: Path) -> None:
    saved = _launch("save", 4, 2, tmp_path)
    grids = next(r["grids"] for r in saved if r["check"] == "saved")
    # the case the issue reported: 10 chunks of an array on an 8-device mesh
    assert grids["params/proj"] == [[410, 2048], 10]
    assert grids["small/five"][1] == 10
    assert grids["small/everywhere"][1] == 7
    assert max(n for _, n in grids.values()) > 8  # the run does exercise the bound
    loads = [r for r in saved if r["check"] == "load"]
    assert len(loads) == 4 * 2
    assert all(r["bad"] == [] for r in loads), loads

    other = _launch("load", 1, 8, tmp_path)
    loads = [r for r in other if r["check"] == "load"]
    assert {r["layout"] for r in loads} == {"packed", "chunks"}
    assert all(r["bad"] == [] for r in loads), loads
    verified = [r for r in other if r["check"] == "verify"]
    assert len(verified) == 2 and all(r["problems"] == [] for r in verified), verified
