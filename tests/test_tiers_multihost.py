"""quire.LocalTier with 4 real JAX processes x 2 CPU devices, the persistent tier on S3 (moto).

One run of ``tests/multihost/tier_worker.py`` per phase, every process training the same
deterministic state (an array sharded over the 8 devices, a replicated one written by pieces
over every process, a host array, a scalar), the local tier every step with ``peers=1`` and
``LatestN(3)``, the persistent tier every 10 steps; GETs counted at a proxy in front of moto:

A. steps 1..12 (step 10 promoted): every process's local step holds its own objects and its
   ring predecessor's, checked and marked;
B. the local directories of processes 1 and 2 wiped: both holders of process 1's objects are
   gone.  Steps 12 and 11 are not restorable (the persistent tier lacks them), so every
   process agrees on step 10, which the persistent tier holds: the restore reads only (ranges
   of) process 1's objects of step 10 there (and the record), and is bit-identical.  Training
   goes on (11..13 saved again); process 2 is SIGKILLed in the middle of its local save of
   step 14, and the others are killed as a job would be;
C. process 2's local directory wiped too; all four restart: they agree on step 13 (step 14
   was never completed on every process), restore it bit-identical with 0 GETs of the
   persistent tier's steps (process 2's objects come from its peer, process 3).  Then one
   process hangs instead of taking part in ``latest_step()``: the others fail with
   ``MultiProcessError`` naming the lost peer within the deadline.
"""

from __future__ import annotations

import collections
import json
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from multihost import harness
from object_store_servers import FaultProxy, MotoS3

import quire

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SIGKILL, 127.0.0.1 processes")

WORKER = Path(__file__).parent / "multihost" / "tier_worker.py"
N = 4


@pytest.fixture(scope="module")
def proxy(moto: MotoS3) -> Iterator[FaultProxy]:
    p = FaultProxy((moto.host, moto.port), "s3")
    yield p
    p.stop()


def launch(
    tmp: Path,
    cfg: dict[str, Any],
    victim: int | None = None,
    timeout: float = 90,
    n: int = N,
    domains: list[str] | None = None,
) -> tuple[list[dict[str, Any]], list[int]]:
    """Run ``n`` processes; when ``victim`` dies (SIGKILL), kill the others as a job would.
    ``domains``: each process's ``$QUIRE_FAILURE_DOMAIN`` (fake hosts)."""
    run = harness.launch(
        WORKER,
        n,
        [json.dumps(cfg)],
        tmp / "logs",
        name=f"{cfg['first']}-{cfg['last']}",
        devices=2,
        timeout=timeout,
        # a fake host each, or none of the test's own
        env_of=lambda i: {"QUIRE_FAILURE_DOMAIN": domains[i]} if domains else {},
        drop=("QUIRE_FAILURE_DOMAIN",),
        stop_on=victim,
    )
    return run.results, run.returncodes


def of(results: list[dict[str, Any]], check: str) -> list[dict[str, Any]]:
    return sorted((r for r in results if r["check"] == check), key=lambda r: r["pid"])


def ok(results: list[dict[str, Any]], codes: list[int | None], n: int = N) -> None:
    failed = of(results, "failed")
    assert not failed, failed[0]["error"][-3000:]
    assert codes == [0] * n, codes
    assert len(of(results, "done")) == n


def step_gets(proxy: FaultProxy, prefix: str) -> list[str]:
    """GET requests for objects inside the persistent tier's step directories."""
    return [
        e[1] for e in proxy.requests("GET", rf"/{prefix}/step_\d+/") if "?list-type" not in e[1]
    ]


def markers(local: Path, proc: int, step: int) -> list[str]:
    (txdir,) = (local / f"process_{proc:05d}" / f"step_{step:08d}" / "d").iterdir()
    return sorted(p.name for p in (txdir / "%tier").iterdir())


def test_four_processes_peer_copies_lost_holders_kill_and_hang(
    tmp_path: Path, moto: MotoS3, proxy: FaultProxy
) -> None:
    url = moto.fresh_url()
    prefix = url.split("/", 3)[3]
    local = tmp_path / "local"
    base = {
        "persistent": url,
        "options": moto.options(proxy.endpoint),
        "local": str(local),
        "timeout": 20,
    }
    # A. steps 1..12; step 10 promoted by every process's own objects.
    results, codes = launch(tmp_path, {**base, "first": 1, "last": 12})
    ok(results, codes)
    assert [r["step"] for r in of(results, "agreed")] == [None] * N
    for r in of(results, "saved"):
        assert r["tiers"] == {"10": ["local", "persistent"], "11": ["local"], "12": ["local"]}
    for p in range(N):  # own objects and the ring predecessor's, each checked and marked
        assert markers(local, p, 12) == [f"p{q:05d}.json" for q in sorted({p, (p - 1) % N})]
    # The primary's part includes the data-iterator unit's own objects, copied to its peer.
    (txdir,) = (local / "process_00001" / "step_00000012" / "d").iterdir()
    listed = json.loads((txdir / "%tier" / "p00000.json").read_text())["objects"]
    assert any("/loader/" in k for k in listed), listed
    assert any((txdir / "loader").iterdir())
    # The promoted step is one whole checkpoint on S3: any reader loads it.
    got = quire.load_checkpointables(
        f"{url}/step_00000010", {"state": None}, storage_options=base["options"], partial=True
    )["state"]
    rng = np.random.default_rng(10)  # tier_worker.state(10), in the same order
    want = [rng.standard_normal((96, 48), dtype=np.float32),
            rng.standard_normal((4096,), dtype=np.float32),
            rng.integers(0, 1 << 30, 777, dtype=np.int64)]  # fmt: skip
    for k, w in zip(("w", "b", "opt"), want):
        assert np.asarray(got[k]).tobytes() == w.tobytes(), k
    assert got["step"] == 10

    # B. both holders of process 1's objects lost: step 10, its missing part from S3.
    shutil.rmtree(local / "process_00001")
    shutil.rmtree(local / "process_00002")
    proxy.clear()
    results, codes = launch(tmp_path, {**base, "first": 11, "last": 14, "kill": [2, 14]}, 2)
    assert codes[2] == -signal.SIGKILL, (codes, of(results, "failed"))
    assert [r["step"] for r in of(results, "agreed")] == [10] * N
    assert [r["same"] for r in of(results, "restored")] == [True] * N
    gets = step_gets(proxy, prefix)
    objects = [g for g in gets if not g.split("?")[0].endswith("quire.json")]
    assert objects and all("step_00000010/" in g and "p00001" in g for g in objects), gets
    # each process reads the ranges of them its shards need, straight from S3 (the chunk
    # index at most once per process)
    index = [g for g in objects if g.split("?")[0].endswith(".index.json")]
    assert index and max(collections.Counter(index).values()) <= N, objects
    assert not of(results, "saved")  # step 14 never completed on every process

    # C. process 2's directory wiped after its kill: step 13 from the local tier and peers.
    shutil.rmtree(local / "process_00002")
    proxy.clear()
    results, codes = launch(tmp_path, {**base, "timeout": 6, "first": 14, "last": 14, "hang": 3})
    ok(results, codes)
    assert [r["step"] for r in of(results, "agreed")] == [13] * N
    assert [r["same"] for r in of(results, "restored")] == [True] * N
    assert step_gets(proxy, prefix) == []
    restored = of(results, "restored")  # byte ranges from peers only, all of them served
    assert all(k.startswith("process ") for r in restored for k in r["read"]), restored
    peer_bytes = sum(b for r in restored for b, _ in r["read"].values())
    assert restored[2]["read"] and peer_bytes <= sum(r["served"] for r in restored)
    hung = of(results, "hang")
    assert [r["pid"] for r in hung] == [0, 1, 2]
    for r in hung:
        assert "agreeing on the local tier step" in r["error"], r
        assert "process 3" in r["error"] and "treated as lost" in r["error"], r
        assert r["seconds"] < 6 + 4, r


def test_two_processes_without_peers_restore_through_collectives(
    tmp_path: Path, moto: MotoS3, proxy: FaultProxy
) -> None:
    """``peers=0`` (no TCP server): a restore gets what each process lacks through the
    collective exchange; a wiped directory's objects come from the persistent tier; with
    every directory wiped, the persistent step is loaded as any checkpoint."""
    url = moto.fresh_url()
    prefix = url.split("/", 3)[3]
    local = tmp_path / "local"
    base = {"persistent": url, "options": moto.options(proxy.endpoint), "local": str(local),
            "timeout": 20, "peers": 0, "every": 2}  # fmt: skip
    results, codes = launch(tmp_path, {**base, "first": 1, "last": 4}, n=2)
    ok(results, codes, n=2)
    for p in range(2):
        assert markers(local, p, 4) == [f"p{p:05d}.json"]  # no peer copies
    proxy.clear()
    results, codes = launch(tmp_path, {**base, "first": 5, "last": 6}, n=2)
    ok(results, codes, n=2)
    assert [(r["step"], r["same"]) for r in of(results, "restored")] == [(4, True)] * 2
    # (step 6's promotion then reads step records for its garbage collection: no data)
    assert [g for g in step_gets(proxy, prefix) if "quire.json" not in g] == []
    for p in range(2):  # the restore gave each process the other's objects of step 4
        assert markers(local, p, 4) == ["p00000.json", "p00001.json"]
    # Process 1's directory lost, no peer copies of steps 5 and 6: step 6, which the
    # persistent tier holds, its process-1 part read from S3 once, process 0's from process 0.
    shutil.rmtree(local / "process_00001")
    proxy.clear()
    results, codes = launch(tmp_path, {**base, "first": 7, "last": 6}, n=2)
    ok(results, codes, n=2)
    assert [(r["step"], r["same"]) for r in of(results, "restored")] == [(6, True)] * 2
    objects = [g for g in step_gets(proxy, prefix) if not g.split("?")[0].endswith("quire.json")]
    assert objects and all("step_00000006/" in g and "p00001" in g for g in objects), objects
    assert len(objects) == len(set(objects))
    # Every local directory lost: the newest persistent step, by a plain multi-process load.
    shutil.rmtree(local)
    proxy.clear()
    results, codes = launch(tmp_path, {**base, "first": 7, "last": 6}, n=2)
    ok(results, codes, n=2)
    assert [(r["step"], r["same"]) for r in of(results, "restored")] == [(6, True)] * 2
    assert any("p00000" in g for g in step_gets(proxy, prefix))


def step_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def test_incremental_promotions_with_two_processes(tmp_path: Path) -> None:
    """``incremental=True`` with a multi-process local tier: every process re-packs its own
    part of each promoted step against its part of the previous persistent step, so steps 4
    and 6 store little beyond what changed (a large frozen leaf is borrowed, by both
    processes' indexes), and every step verifies.  With every local directory wiped, the
    newest persistent step (which borrows) restores bit-identically, and the next run's
    promotion borrows again (from the indexes of the step it restored)."""
    persistent, local = tmp_path / "persistent", tmp_path / "local"
    base = {"persistent": str(persistent), "options": None, "local": str(local),
            "timeout": 20, "every": 2, "incremental": True, "frozen": True}  # fmt: skip
    ok(*launch(tmp_path, {**base, "first": 1, "last": 6}, n=2), n=2)
    first = step_bytes(persistent / "step_00000002")
    for step in (4, 6):
        rec = json.loads((persistent / f"step_{step:08d}" / "quire.json").read_text())
        assert sorted(e["process"] for e in rec["indexes"]) == [0, 1]
        assert all(e.get("borrowed") for e in rec["indexes"]), rec["indexes"]
        assert step_bytes(persistent / f"step_{step:08d}") < first / 4
    for step in (2, 4, 6):
        report = quire.verify(str(persistent / f"step_{step:08d}"))
        assert report.ok, report
    shutil.rmtree(local)
    results, codes = launch(tmp_path, {**base, "first": 7, "last": 8}, n=2)
    ok(results, codes, n=2)
    assert [(r["step"], r["same"]) for r in of(results, "restored")] == [(6, True)] * 2
    # the new run resumed from step 6's indexes: step 8 borrows too
    rec = json.loads((persistent / "step_00000008" / "quire.json").read_text())
    assert all("step_00000002/" in next(iter(e["borrowed"])) for e in rec["indexes"])
    assert step_bytes(persistent / "step_00000008") < first / 4


def test_a_time_based_local_policy_follows_process_0(tmp_path: Path) -> None:
    """``LocalTier(save_policy=EveryNSeconds(5))`` with 2 processes whose clocks disagree:
    process 0 pauses 6 s before each save, so its policy says save and process 1's does not.
    A local save is collective, so every process follows process 0's answer (as for the
    persistent policy): both save steps 1 and 2 locally, and none waits for the other until
    the timeout."""
    persistent, local = tmp_path / "persistent", tmp_path / "local"
    base = {"persistent": str(persistent), "options": None, "local": str(local),
            "timeout": 15, "peers": 0, "every": 1000, "local_seconds": 5, "pause": [0, 6]}  # fmt: skip
    results, codes = launch(tmp_path, {**base, "first": 1, "last": 2}, n=2, timeout=80)
    ok(results, codes, n=2)
    assert [r["tiers"] for r in of(results, "saved")] == [{"1": ["local"], "2": ["local"]}] * 2
    for p in range(2):
        assert markers(local, p, 2) == [f"p{p:05d}.json"]


def test_a_silent_peer_is_passed_over_for_another_holder(tmp_path: Path) -> None:
    """3 processes, ``peers=2`` (every process holds every object).  Nothing lost: the
    restore reads nothing from peers (0 bytes served), and a second Checkpointer opened on
    the same roots in the same job restores too.  Then process 0's directory wiped and
    process 1's peer server accepts connections and never answers: process 0 reads the byte
    ranges its shards need from process 2 after waiting out process 1 once, whole and
    bit-identical, and fewer bytes than the step holds; its directory is not refilled (the
    next local save writes it)."""
    local = tmp_path / "local"
    base = {"persistent": str(tmp_path / "persistent"), "options": None, "local": str(local),
            "timeout": 4, "peers": 2}  # fmt: skip
    ok(*launch(tmp_path, {**base, "first": 1, "last": 2}, n=3), n=3)
    for p in range(3):
        assert markers(local, p, 2) == ["p00000.json", "p00001.json", "p00002.json"]
    # one host: every copy shares its owner's failure domain, said once (by process 0)
    warned = [f.read_text().count("own failure domain") for f in (tmp_path / "logs").glob("1-2-*")]
    assert sorted(warned) == [0, 0, 0, 0, 0, 1], warned
    results, codes = launch(tmp_path, {**base, "first": 3, "last": 2, "reopen": True}, n=3)
    ok(results, codes, n=3)
    restored = of(results, "restored")
    assert [(r["step"], r["same"], r["served"], r["read"]) for r in restored] == [
        (2, True, 0, {})
    ] * 3
    # a second Checkpointer on the same roots in the same job agrees and restores afresh
    # (its key-value exchanges do not meet the first one's keys)
    assert [(r["step"], r["same"]) for r in of(results, "reopened")] == [(2, True)] * 3
    whole = step_bytes(local / "process_00002" / "step_00000002")
    shutil.rmtree(local / "process_00000")
    results, codes = launch(tmp_path, {**base, "first": 3, "last": 2, "silent": 1}, n=3)
    ok(results, codes, n=3)
    restored = of(results, "restored")
    assert [(r["step"], r["same"]) for r in restored] == [(2, True)] * 3
    assert restored[0]["seconds"] >= 4  # process 0 waited out the silent peer once
    got, requests = restored[0]["read"]["process 2"]
    assert requests > 0 and set(restored[0]["read"]) <= {"process 1", "process 2"}
    assert restored[0]["read"].get("process 1", [0, 0])[0] == 0
    record = (local / "process_00002" / "step_00000002" / "quire.json").stat().st_size
    assert restored[2]["served"] == got + record and 0 < got < whole, (got, record, whole)
    assert [r["read"] for r in restored[1:]] == [{}, {}]  # they hold everything
    assert not (local / "process_00000" / "step_00000002").exists()  # not refilled
    err = (tmp_path / "logs").glob("3-2-*-0.err")
    assert any("from process 1" in f.read_text() for f in err)


def test_copies_go_to_another_failure_domain_and_survive_its_loss(tmp_path: Path) -> None:
    """4 processes on 2 fake hosts (``$QUIRE_FAILURE_DOMAIN``: processes 0, 1 on ``a``, 2, 3 on
    ``b``), ``peers=1``: each owner's copy lands on a process of the other host (the plain
    ring would have put process 0's on process 1).  Both of host ``a``'s directories wiped:
    the restore still agrees on the newest local step, which the persistent tier never held,
    and reads every missing byte from host ``b``'s processes; bit-identical."""
    local = tmp_path / "local"
    base = {"persistent": str(tmp_path / "persistent"), "options": None, "local": str(local),
            "timeout": 10, "peers": 1, "every": 100}  # fmt: skip
    hosts = ["a", "a", "b", "b"]
    ok(*launch(tmp_path, {**base, "first": 1, "last": 2}, domains=hosts))
    held = {0: 2, 1: 3, 2: 1, 3: 0}  # owner -> its holder, on the other host
    for p in range(N):
        own = sorted({p} | {j for j, h in held.items() if h == p})
        assert markers(local, p, 2) == [f"p{q:05d}.json" for q in own], p
        assert {hosts[q] for q in own} == {"a", "b"}
    err = "".join(f.read_text() for f in (tmp_path / "logs").glob("1-2-*-0.err"))
    assert "own failure domain" not in err, err  # no warning: the domains separate
    shutil.rmtree(local / "process_00000")
    shutil.rmtree(local / "process_00001")
    results, codes = launch(tmp_path, {**base, "first": 3, "last": 2}, domains=hosts)
    ok(results, codes)
    assert [r["step"] for r in of(results, "agreed")] == [2] * N  # local only: never promoted
    restored = of(results, "restored")
    assert [r["same"] for r in restored] == [True] * N
    for r in restored[:2]:  # host a's processes read from host b's only
        assert r["read"] and set(r["read"]) <= {"process 2", "process 3"}, r
    assert not (tmp_path / "persistent").exists() or not any(
        p.name.startswith("step_") for p in (tmp_path / "persistent").iterdir()
    )


def test_a_memory_local_tier_serves_its_peers_from_process_memory(tmp_path: Path) -> None:
    """``LocalTier("memory://...", peers=1)``: each process's local root lives in its own
    memory store, served to its peers from there.  After 3 steps each root holds its own
    objects and its ring predecessor's (one host: the plain ring); process 1 then empties its
    root, and every process restores the last step again: process 1's objects come over TCP
    from the memory of process 2, which holds their copy; bit-identical."""
    base = {"persistent": str(tmp_path / "persistent"), "options": None,
            "local": "memory://tiers-run", "timeout": 10, "peers": 1, "every": 100}  # fmt: skip
    results, codes = launch(tmp_path, {**base, "first": 1, "last": 3, "wipe": 1})
    ok(results, codes)
    for r in of(results, "markers"):
        p = r["pid"]
        assert r["names"] == [f"p{q:05d}.json" for q in sorted({p, (p - 1) % N})], r
    again = of(results, "rerestored")
    assert [(r["step"], r["same"]) for r in again] == [(3, True)] * N
    assert again[1]["read"] and set(again[1]["read"]) <= {"process 0", "process 2", "process 3"}
    assert again[1]["read"].get("process 2", (0, 0))[0] > 0, again[1]
    assert not (tmp_path / "persistent").exists() or not any(
        p.name.startswith("step_") for p in (tmp_path / "persistent").iterdir()
    )


def test_keeping_one_local_step_with_peers_loses_no_copy(tmp_path: Path) -> None:
    """``LocalTier(keep=LatestN(1), peers=1)``: an owner deletes step S only once its holder
    pulled it (the next collective local save waits for every process's copies of S), so
    every copy lands, every step's root holds its own and its predecessor's objects, and
    the last one restores with a directory wiped, without the persistent tier."""
    local = tmp_path / "local"
    base = {"persistent": str(tmp_path / "persistent"), "options": None, "local": str(local),
            "timeout": 20, "peers": 1, "keep": 1}  # fmt: skip
    ok(*launch(tmp_path, {**base, "first": 1, "last": 6}, n=3), n=3)
    for p in range(3):
        steps = sorted(d.name for d in (local / f"process_{p:05d}").iterdir() if d.is_dir())
        assert steps == ["step_00000006"], steps
        assert markers(local, p, 6) == sorted([f"p{p:05d}.json", f"p{(p - 1) % 3:05d}.json"])
    for f in (tmp_path / "logs").glob("1-6-*.err"):
        assert "no copy of process" not in f.read_text(), f.read_text()[-2000:]
    shutil.rmtree(local / "process_00001")
    results, codes = launch(tmp_path, {**base, "first": 7, "last": 6}, n=3)
    ok(results, codes, n=3)
    assert [(r["step"], r["same"]) for r in of(results, "restored")] == [(6, True)] * 3


@pytest.mark.parametrize("incremental", [False, True])
def test_a_lost_chunk_commits_no_step_with_two_processes(tmp_path: Path, incremental: bool) -> None:
    """Issue 39 across processes: a multi-process local save whose writer loses a chunk (of
    process 1's part: the primary's check sees it in process 1's index) is refused in both
    processes; a local step committed incomplete (by a quire without the check) is not
    promoted - copied whole, or re-packed by each process (``incremental``) - and the
    persistent tier keeps no trace of it; the steps around them are saved and promoted."""
    persistent, local = tmp_path / "persistent", tmp_path / "local"
    cfg = {"persistent": str(persistent), "options": None, "local": str(local), "timeout": 20,
           "peers": 0, "every": 2, "incremental": incremental, "first": 1, "last": 4,
           "drop": {"flat": 3, "steps": {"1": "checked", "2": "unchecked"}}}  # fmt: skip
    results, codes = launch(tmp_path, cfg, n=2)
    ok(results, codes, n=2)
    dropped = sorted(of(results, "dropped"), key=lambda r: (r["step"], r["pid"]))
    assert [(r["step"], r["pid"]) for r in dropped] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert [r["lost"] for r in dropped] == [0, 1, 0, 1]  # process 1 writes chunk (3, 0) of w
    for r in dropped:
        want = "IncompleteCheckpointError" if r["pid"] == 0 else "MultiProcessError"
        assert (r["error"] or "").startswith(want), r
        assert "'state:w'" in r["error"] and "refusing to publish" in r["error"], r
    assert str(persistent / "step_00000002") in dropped[2]["error"]  # the promotion's
    assert [r["tiers"] for r in of(results, "saved")] == [
        {"2": ["local"], "3": ["local"], "4": ["local", "persistent"]}
    ] * 2
    assert not (persistent / "step_00000002" / "quire.json").exists()
    assert quire.verify(str(persistent / "step_00000004")).ok
