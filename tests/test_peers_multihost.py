"""Peer transport between three real JAX processes (jax.distributed on 127.0.0.1, 2 CPU
devices each): ``ring_shift`` by several shifts with payloads of uneven sizes (one empty)
in several rounds; ``run_credentials`` (certificates through the key-value store) +
``publish_address`` / ``lookup_address`` + ``fetch`` over TLS from the next process's
``PeerServer``; a server that is not the process meant, and a client of no run, refused;
processes passing different
``round_bytes`` all refused; a process that does not join a ring shift named by the others
within the timeout.  One launch, see
``tests/multihost/peer_worker.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from multihost import harness

sys.path.insert(0, str(Path(__file__).parent / "multihost"))

from peer_worker import payload

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="127.0.0.1 processes")

WORKER = Path(__file__).parent / "multihost" / "peer_worker.py"
NPROC = 3
ARGS = {
    # process 1's payload is 3+ rounds of 64 KiB, process 2's is empty
    "sizes": [70_001, 200_000, 0],
    "shifts": [1, 2, -1, 4, 3],
    "round_bytes": 1 << 16,
    "pack_bytes": 3 << 20,
}


def launch(tmp_path: Path, timeout: float = 120) -> tuple[list[dict[str, Any]], list[str]]:
    run = harness.launch(
        WORKER,
        NPROC,
        [str(tmp_path), json.dumps(ARGS)],
        tmp_path,
        name="peer",
        devices=2,
        timeout=timeout,
    )
    errors = [e[-3000:] for e, rc in zip(run.stderr, run.returncodes) if rc]
    return run.results, errors


def test_ring_shift_and_tcp_fetch_between_three_processes(tmp_path: Path) -> None:
    import hashlib

    results, errors = launch(tmp_path)
    crashed = [r for r in results if r["check"] == "crashed"]
    assert not crashed and not errors, (crashed, errors)
    assert len([r for r in results if r["check"] == "done"]) == NPROC, results

    sha = {
        i: hashlib.sha256(payload(i, ARGS["sizes"][i])).hexdigest()  # type: ignore[index]
        for i in range(NPROC)
    }
    rings = [r for r in results if r["check"] == "ring"]
    assert len(rings) == NPROC * len(ARGS["shifts"])  # type: ignore[arg-type]
    for r in rings:
        source = (r["pid"] - r["shift"]) % NPROC
        assert r["length"] == ARGS["sizes"][source], r  # type: ignore[index]
        assert r["sha"] == sha[source], r

    floats = [r for r in results if r["check"] == "floats"]
    assert len(floats) == NPROC and all(r["ok"] for r in floats), floats

    peers = {r["pid"]: r for r in results if r["check"] == "peer"}
    assert sorted(peers) == list(range(NPROC))
    assert len({r["pins"] for r in peers.values()}) == 1  # every process pins the same
    assert len({r["mine"] for r in peers.values()}) == NPROC  # a key of its own each
    for pid, r in peers.items():
        nxt = (pid + 1) % NPROC
        body = payload(100 + nxt, ARGS["pack_bytes"])  # type: ignore[arg-type]
        assert r["fetched"] == hashlib.sha256(body).hexdigest(), r
        assert r["address"][0] == "127.0.0.1"
        other = (pid + 2) % NPROC
        assert f"not the one process {other} published" in (r["other_process"] or ""), r
        assert "did not accept this process's certificate" in (r["stranger"] or ""), r
        assert f"p{nxt:05d}" in r["stranger"], r

    mismatch = [r for r in results if r["check"] == "mismatch"]
    assert len(mismatch) == NPROC, mismatch
    for r in mismatch:
        assert r["error"] and "every process must pass the same" in r["error"], r
        assert "round_bytes=65536" in r["error"] and "round_bytes=131072" in r["error"], r

    late = {r["pid"]: r for r in results if r["check"] == "late"}
    assert late[NPROC - 1] == {"pid": NPROC - 1, "check": "late", "skipped": True}
    for pid in range(NPROC - 1):
        err = late[pid]["error"]
        assert err is not None and f"for process {NPROC - 1} to join" in err, late[pid]
        assert late[pid]["seconds"] < 10, late[pid]
