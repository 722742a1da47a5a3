"""Several real JAX processes on 127.0.0.1: per-process shard writes and reads.

Each test launches ``tests/multihost/worker.py`` as N processes (``jax.distributed.initialize``
on a free port, ``--xla_force_host_platform_device_count`` devices each, CPU only) and asserts
on the JSON result lines they print.  Several checks share one launch per topology (a jax
import and the distributed start-up cost a few seconds per process):

* 2 x 4 and 4 x 2 processes x devices each save the same global tree (6 jax arrays with even,
  partially replicated and fully replicated shardings, a numpy array, a PRNG key, scalars)
  with ``quire.save``, ``quire.save_async``, ``quire.partial`` and ``quire.Checkpointer``;
  every chunk is written by exactly one process — the one holding the shard with
  ``replica_id == 0`` — and only the primary writes metadata and commit records;
* both checkpoints load bit-exact on 1 x 8, 1 x 1, 2 x 4 and 4 x 2, onto the saved shardings,
  onto other grids of the same mesh and onto another mesh shape; each process reads each
  stored chunk overlapping its shards exactly once, nothing else but ``quire.json``, and
  lists nothing;
* a scalar that differs between processes, or an I/O error in one process (the primary or
  another), aborts the save in every process with quire's error, naming the key or the error;
* a process SIGKILLed in the middle of an overwrite: nothing is committed, the others fail
  clearly (quire's ``MultiProcessError`` within the timeout, or JAX terminating them — see
  each test), and a fresh process loads the previous checkpoint;
* the same save / load through ``s3://`` against a moto server, when quire-s3 is installed.
"""

from __future__ import annotations

import json
import signal
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from multihost import harness
from multihost.harness import Run

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SIGKILL, 127.0.0.1 processes")
# The tests that share a module's launches run on one xdist worker (CONTRIBUTING.md).
SAVES = pytest.mark.xdist_group("multihost-saves")
REPLICAS = pytest.mark.xdist_group("multihost-replicas")

WORKER = Path(__file__).parent / "multihost" / "worker.py"
FATAL = "Terminating process because the JAX distributed service detected fatal errors"


def launch(
    scenario: str,
    nproc: int,
    ndev: int,
    workdir: Path,
    args: dict[str, Any],
    *,
    timeout: float = 150,
    env: dict[str, str] | None = None,
) -> Run:
    """Run the worker as ``nproc`` processes of ``ndev`` CPU devices each; wait for all."""
    name = f"{scenario}-{args.get('tag', '')}-{nproc}x{ndev}"
    argv = [scenario, str(workdir), json.dumps(args)]
    return harness.launch(
        WORKER, nproc, argv, workdir / "logs", name=name, devices=ndev, timeout=timeout, env=env
    )


# ====================================================================== assertions
def is_chunk(key: str) -> bool:
    return "/c/" in key or key.endswith("/c")


def check_single_writers(wrote: dict[int, list[str]], primary: int = 0) -> None:
    """Each chunk is written once, by one process; everything else only by the primary."""
    counts = Counter(k for keys in wrote.values() for k in keys if is_chunk(k))
    twice = sorted(k for k, n in counts.items() if n > 1)
    assert not twice, f"chunks written more than once: {twice[:10]}"
    for pid, keys in wrote.items():
        if pid != primary:
            meta = sorted(k for k in keys if not is_chunk(k))
            assert not meta, f"process {pid} wrote metadata / records: {meta}"


def check_ownership(run: Run, nproc: int, replica_writes: bool = True) -> None:
    """Each chunk is written once, by a process holding a copy of it (its replica-0 holder
    when ``replica_writes`` is off), and together all; process-local values by the primary."""
    by_url: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for r in run.of("ownership"):
        by_url[r["url"]][r["pid"]] = r
    assert by_url, run.failures()
    for url, per in by_url.items():
        assert sorted(per) == list(range(nproc)), url
        wrote = {pid: r["wrote"] for pid, r in per.items()}
        check_single_writers(wrote)
        for pid, r in per.items():
            mine = sorted(k for k in r["wrote"] if is_chunk(k))
            if replica_writes:
                assert set(mine) <= set(r["holds"]), (url, pid, set(mine) - set(r["holds"]))
            else:
                assert mine == r["expected"], (url, pid, set(mine) ^ set(r["expected"]))
        chunks = per[0]["chunks"]
        everything = {k for keys in wrote.values() for k in keys if is_chunk(k)}
        for loc, n in chunks.items():
            have = {k for k in everything if k.startswith(loc + "/")}
            assert len(have) == n, (url, loc, n, sorted(have))
        assert len(everything) == sum(chunks.values())
        # format v2: each process wrote only its own packs and index, and the primary's
        # record names the index of every process that owns chunks
        writers = sorted(pid for pid, keys in wrote.items() if any(map(is_chunk, keys)))
        for pid, r in per.items():
            assert all(f"/%packs/p{pid:05d}" in k for k in r["packs"]), (pid, r["packs"])
            assert bool(r["packs"]) == (pid in writers), (pid, r["packs"])
        assert per[0]["indexes"] == writers, (per[0]["indexes"], writers)
        meta = [k for k in per[0]["wrote"] if not is_chunk(k)]
        assert "quire.json" in meta
        assert sum(k.endswith("zarr.json") for k in meta) == len(chunks)
        if nproc > 1 and replica_writes:
            # replicated arrays spread: more than one process writes
            assert len(writers) > 1, writers


def check_loads(run: Run, nproc: int, expect: dict[str, list[str]]) -> None:
    """Bit-exact loads; each process read each chunk it needed once and nothing else."""
    for ckpt, layouts in expect.items():
        for layout in layouts:
            for pid in range(nproc):
                found = [
                    x
                    for x in run.of("load", pid)
                    if x.get("layout") == layout and x.get("url", "").endswith(ckpt)
                ]
                assert len(found) == 1, (ckpt, layout, pid, run.failures())
                r = found[0]
                assert r["bad"] == [], (ckpt, layout, pid, r["bad"])
                assert r["other_reads"] == ["quire.json"], r["other_reads"]
                assert r["lists"] == 0, "a load listed the checkpoint"
                for name, leaf in r["leaves"].items():
                    assert leaf["read"] == leaf["needed"], (ckpt, layout, pid, name, leaf)
                    if layout != "numpy":
                        assert leaf["read"] >= leaf["share"], (ckpt, layout, pid, name, leaf)
                w = r["leaves"]["params/w"]
                if layout in LAYOUTS and nproc > 1:
                    assert w["read"] < w["total"], (ckpt, layout, pid, w)
                if layout in ("save", "swapped") and nproc > 1:
                    # the 2-D grid: its share (+ at most a chunk), never the whole array
                    assert w["read"] <= w["share"] + w["chunk"], (ckpt, layout, pid, w)


# ====================================================================== the runs
LAYOUTS = ["save", "swapped", "mesh42"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("multihost")


@pytest.fixture(scope="module")
def run_2x4(workdir: Path) -> Run:
    loads = [{"ckpt": "a/ck", "layouts": LAYOUTS}]
    return launch("save", 2, 4, workdir, {"tag": "a", "loads": loads})


@pytest.fixture(scope="module")
def run_4x2(workdir: Path, run_2x4: Run) -> Run:
    loads = [{"ckpt": "a/ck", "layouts": LAYOUTS}, {"ckpt": "b/ck", "layouts": LAYOUTS}]
    return launch("save", 4, 2, workdir, {"tag": "b", "loads": loads})


@pytest.fixture(scope="module")
def reloads(workdir: Path, run_2x4: Run, run_4x2: Run) -> dict[str, Run]:
    """The two checkpoints loaded by other topologies (saved ones must exist first)."""
    for run in (run_2x4, run_4x2):
        run.one("saved", 0)
    both = ["a/ck", "b/ck"]
    return {
        "2x4": launch("load", 2, 4, workdir, {"loads": [{"ckpt": "b/ck", "layouts": LAYOUTS}]}),
        "1x8": launch(
            "load",
            1,
            8,
            workdir,
            {"loads": [{"ckpt": c, "layouts": ["none", *LAYOUTS, "numpy"]} for c in both]},
        ),
        "1x1": launch(
            "load",
            1,
            1,
            workdir,
            {"loads": [{"ckpt": c, "layouts": ["none", "single", "numpy"]} for c in both]},
        ),
    }


# ====================================================================== saving
@SAVES
@pytest.mark.parametrize("topology", ["2x4", "4x2"])
def test_each_process_writes_only_its_shards(topology: str, run_2x4: Run, run_4x2: Run) -> None:
    run, n = (run_2x4, 2) if topology == "2x4" else (run_4x2, 4)
    run.assert_ok()
    check_ownership(run, n)  # quire.save, quire.save_async (and s3 below)
    assert len({r["url"] for r in run.of("ownership")}) == 2


@SAVES
@pytest.mark.parametrize("topology", ["2x4", "4x2"])
def test_commit_reads_each_chunk_index_once(topology: str, run_2x4: Run, run_4x2: Run) -> None:
    """The primary reads every process's chunk index once for the commit, when it checks
    that every chunk of the record is in one: each other process shares its index's size and
    crc32c through the key-value store (the primary used to read the others' indexes twice,
    once to describe them); no other process reads any."""
    run, n = (run_2x4, 2) if topology == "2x4" else (run_4x2, 4)
    primary = run.one("saved", 0)
    sizes = primary["index_sizes"]
    assert len(sizes) == n, sizes  # one index per process: each owns chunks
    assert primary["index_reads"] == sizes
    for pid in range(1, n):
        assert run.one("saved", pid)["index_reads"] == {}


@SAVES
@pytest.mark.parametrize("topology", ["2x4", "4x2"])
def test_save_async_and_partial_across_processes(topology: str, run_2x4: Run, run_4x2: Run) -> None:
    run, n = (run_2x4, 2) if topology == "2x4" else (run_4x2, 4)
    for pid in range(n):
        assert run.one("async", pid)["bad"] == []
        assert run.one("async-pinned", pid)["bad"] == []
        p = run.one("partial", pid)
        assert p["versions"] == [1, 2, 3]
        assert p["bad_mid"] == [] and p["bad_final"] == []
        assert not p["journal_left"]
    wrote = {r["pid"]: r["wrote"] for r in run.of("partial")}
    check_single_writers(wrote)
    journal = [k for k in wrote[0] if k.startswith("journal/")]
    assert len(journal) == 3, journal  # one conditional create per version, by the primary


@SAVES
@pytest.mark.parametrize("topology", ["2x4", "4x2"])
def test_partial_finalize_rewrites_every_process_packs_on_the_primary(
    topology: str, run_2x4: Run, run_4x2: Run
) -> None:
    """Format v2: version 2 replaces all but one leaf, so each process's version-1 pack is
    mostly dead; the primary rewrites the live chunk (whoever wrote it) into its own pack,
    indexed under the process that owned it, and the others write nothing."""
    run, n = (run_2x4, 2) if topology == "2x4" else (run_4x2, 4)
    per = {pid: run.one("partial_rw", pid) for pid in range(n)}
    for r in per.values():
        assert r["bad_final"] == [], r
    r0 = per[0]
    _, rewrite, v1, *_ = r0["location"].split("/")
    assert r0["txids"] == sorted(r0["txids"]) and rewrite in r0["txids"]
    assert v1 not in r0["txids"] and r0["on_disk"] == sorted(r0["txids"])  # v1 dropped whole
    assert [t for t, _ in r0["indexes"]].count(rewrite) >= 1
    assert r0["rewrote"] and all(k.startswith(f"d/{rewrite}/{v1}/") for k in r0["rewrote"])
    assert all(per[pid]["rewrote"] == [] for pid in range(1, n))


@SAVES
@pytest.mark.parametrize("topology", ["2x4", "4x2"])
def test_checkpointer_across_processes(topology: str, run_2x4: Run, run_4x2: Run) -> None:
    run, n = (run_2x4, 2) if topology == "2x4" else (run_4x2, 4)
    for pid in range(n):
        r = run.one("checkpointer", pid)
        assert "failed" not in r, r["failed"] + r.get("tb", "")
        assert r["saved"] == [1, 2, 3]
        assert r["steps"] == [2, 3] and r["latest"] == 3
        assert r["bad"] == []
        assert r["on_disk"] == ["step_00000002", "step_00000003"]
    per_step: dict[str, dict[int, list[str]]] = defaultdict(dict)
    for r in run.of("checkpointer"):
        for where, keys in r["wrote"].items():
            per_step[where][r["pid"]] = keys
    assert len(per_step) >= 3
    for keys in per_step.values():
        check_single_writers(keys)


@SAVES
@pytest.mark.parametrize("topology", ["2x4", "4x2"])
def test_incremental_checkpointer_across_processes(
    topology: str, run_2x4: Run, run_4x2: Run
) -> None:
    """Incremental steps on several processes: every process borrows only from its own
    earlier packs (its index entry declares only p<pid>-* packs of step 1), writes only
    its index after step 1, and the retained steps load bit-exact."""
    run, n = (run_2x4, 2) if topology == "2x4" else (run_4x2, 4)
    for pid in range(n):
        r = run.one("checkpointer_inc", pid)
        assert "failed" not in r, r["failed"] + r.get("tb", "")
        assert r["steps"] == [2, 3] and r["bad"] == [] and not r["step1_record"]
        for proc, targets in r["borrowed"].items():
            assert targets, (proc, r["borrowed"])
            assert all(
                t.startswith("../step_00000001/d/") and f"/%packs/p{int(proc):05d}-" in t
                for t in targets
            ), (proc, targets)
        for where, keys in r["packs"].items():
            if where.startswith(("step_00000002", "step_00000003")):
                assert all(k.endswith(".index.json") for k in keys), (where, keys)


@SAVES
@pytest.mark.parametrize("topology", ["2x4", "4x2"])
def test_disagreeing_scalar_fails_everywhere(topology: str, run_2x4: Run, run_4x2: Run) -> None:
    run, n = (run_2x4, 2) if topology == "2x4" else (run_4x2, 4)
    for pid in range(n):
        r = run.one("disagree", pid)
        err = r["error"]
        assert err is not None, f"process {pid} saved a tree whose 'step' differs"
        assert err["quire"] and err["type"] == "MultiProcessError", err
        assert "'step'" in err["message"] and "nothing committed" in err["message"], err
        assert not r["committed"] and r["leftover"] == 0
        assert r["seconds"] < 30


@SAVES
@pytest.mark.parametrize("topology", ["2x4", "4x2"])
@pytest.mark.parametrize("who", ["last", "primary"])
def test_failed_write_fails_everywhere(topology: str, who: str, run_2x4: Run, run_4x2: Run) -> None:
    """An I/O error in one process (the last one, or the primary): every process raises,
    nothing is committed, and the primary removes every process's data of that save."""
    run, n = (run_2x4, 2) if topology == "2x4" else (run_4x2, 4)
    failing = n - 1 if who == "last" else 0
    for pid in range(n):
        r = run.one(f"fail-{failing}", pid)
        err = r["error"]
        assert err is not None and err["quire"], (pid, err)
        if pid == failing:
            assert "injected" in err["message"], err
        else:
            assert err["type"] == "MultiProcessError", err
            assert f"process {failing} failed" in err["message"], err
            assert "injected" in err["message"] and "nothing committed" in err["message"]
        assert not r["committed"], r
        # The primary removed the save's data once every process had reported; a write the
        # failing process had in flight may land after that (garbage for `quire gc`).
        assert r["leftover"] < 10, r
        assert r["seconds"] < 30


# ====================================================================== loading
@SAVES
def test_loads_where_saved(run_2x4: Run, run_4x2: Run) -> None:
    check_loads(run_2x4, 2, {"a/ck": LAYOUTS})
    check_loads(run_4x2, 4, {"a/ck": LAYOUTS, "b/ck": LAYOUTS})


@SAVES
def test_loads_on_other_topologies(reloads: dict[str, Run]) -> None:
    for run in reloads.values():
        run.assert_ok()
    check_loads(reloads["2x4"], 2, {"b/ck": LAYOUTS})
    full = ["none", *LAYOUTS, "numpy"]
    check_loads(reloads["1x8"], 1, {"a/ck": full, "b/ck": full})
    one = ["none", "single", "numpy"]
    check_loads(reloads["1x1"], 1, {"a/ck": one, "b/ck": one})


@SAVES
def test_resharded_load_reads_a_share(run_2x4: Run, run_4x2: Run) -> None:
    """The headline figure: the 2-D array (64 x 32 float32, saved as 8 chunks of 32 x 8)
    loaded onto the transposed grid (16 x 16 shards): each process reads its share.

    (Onto a mesh whose shards cut the stored chunks, e.g. ``mesh42`` on 4 processes, a
    process reads the whole chunks it overlaps — checked by ``read == needed`` above.)"""
    for run, n in ((run_2x4, 2), (run_4x2, 4)):
        for pid in range(n):
            r = next(x for x in run.of("load", pid) if x["layout"] == "swapped")
            w = r["leaves"]["params/w"]
            assert w["share"] == w["total"] // n
            # the share of a process, plus the 4-byte checksums of its chunks
            assert 0 <= w["read"] - w["share"] <= 4 * 8 // n, w


# ====================================================================== failures
def _kill(workdir: Path, tag: str, nproc: int, ndev: int, victim: int, **extra: Any) -> Run:
    args = {"tag": tag, "victim": victim, "after": 2, "timeout": 8, **extra}
    run = launch("kill", nproc, ndev, workdir, args, timeout=90)
    assert run.of("dying", victim), run.failures()
    assert run.returncodes[victim] == -signal.SIGKILL
    return run


def _verify(workdir: Path, tag: str) -> None:
    """A fresh process: the previous checkpoint loads whole; a new save goes through."""
    run = launch("verify", 1, 8, workdir, {"tag": tag})
    run.assert_ok()
    v = run.one("verify", 0)
    assert v["bad"] == [], v
    assert len(v["txids"]) == 1 and v["txids"][0] in v["present"]
    assert run.one("resave", 0)["bad"] == []


def test_killed_process_aborts_the_save(workdir: Path) -> None:
    """A non-primary dies mid-save: the primary's wait for its status times out, it aborts,
    and every survivor raises quire's MultiProcessError naming the dead process."""
    run = _kill(workdir, "kill-worker", 4, 2, victim=2)
    for pid in (0, 1, 3):
        r = run.one("survivor", pid)
        err = r["error"]
        assert err is not None, f"process {pid} returned from a save whose peer died"
        assert err["quire"] and err["type"] == "MultiProcessError", err
        assert "nothing committed" in err["message"], err
        assert "process(es) 2 did not report" in err["message"], err
        assert r["seconds"] < 8 * 2 + 15, r
        assert run.returncodes[pid] == 0
    _verify(workdir, "kill-worker")


def test_killed_primary_aborts_the_save(workdir: Path) -> None:
    """Process 0 (the primary, and the host of JAX's coordination service) dies mid-save:
    JAX terminates the other processes at once (SIGABRT, its fatal-error message); the
    primary never committed."""
    run = _kill(workdir, "kill-primary", 2, 4, victim=0)
    assert not [r for r in run.of("survivor") if r["error"] is None]
    raised = run.of("survivor", 1)
    if raised:  # quire noticed first
        assert raised[0]["error"]["type"] == "MultiProcessError", raised
    else:
        assert run.returncodes[1] == -signal.SIGABRT, (run.returncodes, run.stderr[1][-2000:])
        assert FATAL in run.stderr[1]
    _verify(workdir, "kill-primary")


def test_jax_heartbeat_terminates_survivors(workdir: Path) -> None:
    """With JAX's heartbeat timeout shorter than quire's, JAX ends the survivors of a dead
    process first (what happens with the defaults: 100 s heartbeat vs 600 s quire timeout);
    nothing is committed either way."""
    run = _kill(workdir, "kill-heartbeat", 2, 4, victim=1, timeout=60, heartbeat_timeout=5)
    assert not [r for r in run.of("survivor") if r["error"] is None]
    assert run.returncodes[0] == -signal.SIGABRT, (run.returncodes, run.stderr[0][-2000:])
    assert FATAL in run.stderr[0]
    assert run.seconds < 45
    _verify(workdir, "kill-heartbeat")


# ====================================================================== S3
def test_s3_save_and_load(workdir: Path) -> None:
    pytest.importorskip("quire_s3")
    boto3 = pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **creds).create_bucket(
            Bucket="quire-multihost"
        )
        args = {
            "tag": "s3",
            "url": "s3://quire-multihost/run/ck",
            "storage_options": {"endpoint_url": endpoint, "key": "testing", "secret": "testing"},
            "layouts": ["save", "swapped"],
        }
        env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        run = launch("s3", 2, 4, workdir, args, env=env)
    finally:
        server.stop()
    run.assert_ok()
    check_ownership(run, 2)
    check_loads(run, 2, {"run/ck": ["save", "swapped"]})
    for pid in (0, 1):
        assert run.one("async", pid)["bad"] == []
        assert run.one("partial", pid)["bad_final"] == []


# ====================================================================== replica-parallel writes
@pytest.fixture(scope="module")
def run_replicas(workdir: Path) -> Run:
    return launch("replicas", 4, 2, workdir / "replicas", {"stall": 4}, timeout=240)


@REPLICAS
def test_replica_parallel_writes_write_each_byte_once_and_balance(run_replicas: Run) -> None:
    """4 processes x 2 devices, a ~100 MiB tree, mostly replicated (shapes 4 does not
    divide), some arrays replicated over one mesh axis, some sharded, a numpy leaf: with
    replica-parallel writes (the default) each stored chunk is written by exactly one
    process, the packs hold exactly the stored bytes (each byte once), and the most loaded
    process writes <= 1.1x the mean; with them off (replica 0 writes) it is far above.
    Both load bit-exact."""
    run = run_replicas
    assert not [r for r in run.results if "failed" in r], run.failures()
    assert sorted(r["pid"] for r in run.of("done")) == [0, 1, 2], run.failures()  # 3 stalls
    per = {
        mode: {pid: run.one("replicas", pid, mode=mode) for pid in range(4)}
        for mode in ("on", "off")
    }
    for mode, results in per.items():
        wrote = {pid: r["chunks"] for pid, r in results.items()}
        check_single_writers(wrote)
        stored = results[0]["stored"]
        everything = [k for keys in wrote.values() for k in keys]
        assert len(everything) == sum(n for n, _ in stored.values()), mode
        # bytes counted on the storage: the processes' packs hold each stored chunk once
        packed = [r["pack_bytes"] for r in results.values()]
        assert sum(packed) == sum(n * b for n, b in stored.values()), (mode, packed)
    on = [per["on"][pid]["pack_bytes"] for pid in range(4)]
    off = [per["off"][pid]["pack_bytes"] for pid in range(4)]
    mean = sum(on) / 4
    assert max(on) <= 1.1 * mean, on
    assert max(off) > 1.5 * sum(off) / 4, off  # replica 0 concentrates the writes
    # splitting adds at most the padding of short edge pieces
    assert sum(on) <= 1.01 * sum(off), (sum(on), sum(off))


@REPLICAS
def test_shared_reads_read_each_needed_byte_about_once(run_replicas: Run) -> None:
    """The same 4 processes load the replica-parallel checkpoint onto the saved shardings
    (every process needs every replicated chunk): with shared reads (the default) storage
    sees <= 1.05x the unique bytes needed — here every stored byte — and each process reads
    a share; without them, each replicated byte is read by every process.  Every load is
    bit-exact, the checkpoint saved with replica-0 writes included."""
    run = run_replicas
    stored = run.one("replicas", 0, mode="on")["stored"]
    unique = sum(n * b for n, b in stored.values())
    loads = {
        (ckpt, reads): {
            pid: run.one("replica_load", pid, ckpt=ckpt, reads=reads) for pid in range(4)
        }
        for ckpt, reads in (("rw-on", True), ("rw-on", False), ("rw-off", True))
    }
    for key, per in loads.items():
        for r in per.values():
            assert r["bad"] == [], (key, r["bad"][:5])
    shared = [loads["rw-on", True][pid]["read"] for pid in range(4)]
    direct = [loads["rw-on", False][pid]["read"] for pid in range(4)]
    assert sum(shared) <= 1.05 * unique, (sum(shared), unique)
    assert sum(direct) > 2 * unique, (sum(direct), unique)  # each replica reads its copy
    assert max(shared) <= 1.1 * sum(shared) / 4, shared
    # below the threshold a load reads directly, as without shared reads
    below = [run.one("replica_load", pid, ckpt="rw-on", reads="min") for pid in range(4)]
    assert all(r["bad"] == [] for r in below)
    assert [r["read"] for r in below] == direct, ([r["read"] for r in below], direct)


@REPLICAS
def test_stalled_process_fails_shared_load_within_deadline(run_replicas: Run) -> None:
    """Process 3 never joins the load: the others raise quire's MultiProcessError naming
    it within the 4 s deadline (plus start-up), never hang."""
    run = run_replicas
    for pid in range(3):
        r = run.one("stall", pid)
        assert r["error"] and r["quire"], r
        assert "MultiProcessError" in r["error"] and "process 3" in r["error"], r["error"]
        assert r["seconds"] < 4 + 6, r
