"""quire through ``s3://`` (moto's server) and ``gs://`` (fake-gcs-server) URLs.

Every test talks HTTP to a real server, most of them through :class:`FaultProxy`, which
injects faults on the wire: save / load / overwrite, two processes committing at once, a
process killed at each step of the commit protocol, retried transient faults, permanent
faults that fail at once, configuration the fsspec way, and ``quire cp`` between backends.

Both servers enforce the commit's preconditions (moto ``If-None-Match`` / ``If-Match``,
fake-gcs-server ``ifGenerationMatch`` on the multipart uploads quire-gcs commits with):
racing writers commit exactly one checkpoint on either.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from object_store_servers import (
    S3_KEY,
    S3_SECRET,
    SCHEMES,
    STORES,
    FakeGcs,
    FaultProxy,
    MotoS3,
    StoreUnderTest,
    env,
)
from object_store_worker import assert_tree, build_tree

import quire
from quire._runtime import ioloop as _io
from quire._store.url import open_backend
from quire.backends import ObjectStoreBackend

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="subprocess + SIGKILL")

WORKER = str(Path(__file__).with_name("object_store_worker.py"))
# Retries paced for a server on this machine.  A request answered by nothing for 15 s is
# tried again within the deadline, as it would be against S3: once in five full runs, a pack's
# PutObject through the FaultProxy to moto got no reply at all, and the default 60 s
# request_timeout outlasted the 20 s deadline, so no second attempt was made.
FAST_RETRY = {
    "retry_backoff": 0.01, "retry_max_backoff": 0.2, "retry_deadline": 20, "request_timeout": 15,
}  # fmt: skip


@dataclass
class Store:
    """One object store under test (a row of ``object_store_servers.STORES``): its server and
    a fault proxy in front."""

    kind: StoreUnderTest
    server: Any
    proxy: FaultProxy

    @property
    def name(self) -> str:
        return self.kind.scheme

    def url(self) -> str:
        return str(self.server.fresh_url())

    def options(self, *, direct: bool = False, **extra: Any) -> dict[str, Any]:
        endpoint = None if direct else self.proxy.endpoint
        return dict(self.server.options(endpoint, **{**FAST_RETRY, **extra}))

    def backend(self, url: str, **extra: Any) -> Any:
        return open_backend(url, self.options(direct=True, **extra))


def run(coro: Any) -> Any:
    return _io.submit(coro).result(timeout=120)


@pytest.fixture(scope="module")
def proxied() -> Iterator[dict[str, Store]]:
    """The module's stores, by scheme, each with its proxy (made on first use)."""
    made: dict[str, Store] = {}
    yield made
    for s in made.values():
        s.proxy.stop()


def _store(request: pytest.FixtureRequest, made: dict[str, Store], scheme: str) -> Store:
    if scheme not in made:
        kind = STORES[scheme]
        server = request.getfixturevalue(kind.fixture)
        made[scheme] = Store(kind, server, FaultProxy((server.host, server.port), kind.flavor))
    made[scheme].proxy.clear()
    return made[scheme]


@pytest.fixture(params=SCHEMES)
def store(request: pytest.FixtureRequest, proxied: dict[str, Store]) -> Iterator[Store]:
    s = _store(request, proxied, request.param)
    yield s
    s.proxy.clear()


@pytest.fixture
def s3_store(request: pytest.FixtureRequest, proxied: dict[str, Store]) -> Store:
    return _store(request, proxied, "s3")


@pytest.fixture
def gcs_store(request: pytest.FixtureRequest, proxied: dict[str, Store]) -> Store:
    return _store(request, proxied, "gs")


class Child:
    """A saving process forked by the zygote."""

    def __init__(self, pid: int, out: Path) -> None:
        self.pid = pid
        self.out = out

    def _lines(self) -> list[str]:
        return self.out.read_text().splitlines() if self.out.exists() else []

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def result(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = [line for line in self._lines() if line.startswith("{")]
            if done:
                got = json.loads(done[-1])
                assert got["result"] != "error", self.log()
                return str(got["result"])
            if not self.alive():
                pytest.fail(f"saving process {self.pid} died:\n{self.log()}")
            time.sleep(0.02)
        pytest.fail(f"saving process {self.pid} timed out:\n{self.log()}")

    def log(self) -> str:
        log = Path(f"{self.out}.log")
        return log.read_text() if log.exists() else ""

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.01)


class Zygote:
    """object_store_worker.py: imports once, forks a saving process per request."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.n = 0
        self.proc = subprocess.Popen(
            [sys.executable, WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "JAX_PLATFORMS": "cpu",
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            },
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "zygote ready", line

    def spawn(self, url: str, options: dict[str, Any], seed: int, overwrite: bool = False) -> Child:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.n += 1
        out = self.tmp / f"child-{self.n}"
        spec = {"url": url, "options": options, "seed": seed, "overwrite": overwrite,
                "out": str(out)}  # fmt: skip
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line.startswith("forked "), line
        return Child(int(line.split()[1]), out)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    yield z
    z.close()


def txids(store: Store, url: str) -> set[str]:
    keys = run(store.backend(url).list("d"))
    return {k.split("/")[1] for k in keys}


# ----------------------------------------------------------------------------- round trips
def test_packs_stream_in_multipart_parts_and_roll_over(store: Store) -> None:
    """Format v2 on an object store: 40 MiB of chunks stream into packs of at most 24 MiB
    (on S3 a multipart upload whose 16 MiB parts go up as they fill; on GCS a resumable
    upload of unknown size whose 16 MiB chunks go up in turn as they fill), with one chunk
    index; a byte budget of 16 MiB does not cut the packs short (nothing holds a whole
    pack); everything loads and verifies."""
    from quire._engine import verify as _verify
    from quire._runtime import ioloop as _io

    rng = np.random.default_rng(7)
    tree = {f"a{i}": rng.standard_normal((1 << 20) // 2).astype(np.float32) for i in range(20)}
    url, opts = store.url(), store.options()
    store.proxy.clear()
    with quire.Context(pack_bytes=24 << 20, byte_budget=16 << 20):
        quire.save(url, tree, storage_options=opts)
    keys = run(store.backend(url).list(""))
    packs = sorted(k for k in keys if "%packs/p00000-" in k)
    assert len(packs) == 2 and sum(k.endswith(".index.json") for k in keys) == 1, keys
    sizes = [run(store.backend(url).size(k)) for k in packs]
    assert all(n <= 24 << 20 for n in sizes) and sum(sizes) == 20 * ((1 << 21) + 4), sizes
    pieces = sum(-(-n // (16 << 20)) for n in sizes)  # 16 MiB parts / chunks per pack
    # Only the packs are large enough to upload in parts.
    sessions = store.proxy.requests(**store.kind.part_session)
    uploads = store.proxy.requests(**store.kind.part_upload)
    assert len(sessions) == 2 and len(uploads) == pieces, (sessions, uploads)
    got = quire.load(url, storage_options=opts)
    assert all(np.array_equal(got[k], v) for k, v in tree.items())
    # every chunk and every array's zarr.json
    assert _io.submit(_verify.verify(url, opts)).result() == (40, [])


def test_small_pack_is_one_request_and_a_load_reads_packs_in_windows(store: Store) -> None:
    """A save whose data fills no multipart part writes its pack with one request (S3:
    the multipart upload is created only when a part is full), and a load of 60 small
    leaves reads the pack in one or two window requests, not one GET per chunk."""
    rng = np.random.default_rng(5)
    tree = {f"p{i:02d}": rng.standard_normal(300 + 50 * i).astype(np.float32) for i in range(60)}
    url, opts = store.url(), store.options()
    store.proxy.clear()
    quire.save(url, tree, storage_options=opts)
    pack = r"packs(/|%2F)p00000-00000"
    writes = [r for r in store.proxy.requests(path=pack) if r[0] in ("PUT", "POST")]
    assert len(writes) == 1, writes
    store.proxy.clear()
    got = quire.load(url, storage_options=opts)
    assert all(np.array_equal(got[k], v) for k, v in tree.items())
    reads = store.proxy.requests(**store.kind.chunk_read)
    assert 1 <= len(reads) <= 2, reads


def test_roundtrip_sharded_jax_and_ranged_shard_reads(store: Store) -> None:
    """jax arrays sharded over the devices, zarr shards with inner chunks read by range."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("x",))
    sharded = NamedSharding(mesh, PartitionSpec("x"))
    n = len(devices)
    x = jax.device_put(np.arange(n * 64 * 32, dtype=np.float32).reshape(n * 64, 32), sharded)
    table = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    tree = {"x": x, "table": table, "step": 7, "key": jax.random.key(3)}
    url, opts = store.url(), store.options()
    # 64 KiB table in 4 KiB inner chunks: one zarr shard object of 16 inner chunks.
    quire.save(
        url, tree, storage_options=opts, layout="chunks",  # ranged reads of v1 objects
        storage=lambda path, leaf: quire.StorageOptions(chunk_bytes=4096)
        if path == ("table",) else None,
    )  # fmt: skip
    got = quire.load(url, storage_options=opts)
    np.testing.assert_array_equal(np.asarray(got["x"]), np.asarray(x))
    np.testing.assert_array_equal(got["table"], table)
    assert got["step"] == 7

    # Load the table onto the devices, row blocks apart: each device's region is read as
    # byte ranges of just its inner chunks (plus the shard index), never the whole object.
    store.proxy.clear()
    target = {"table": jax.ShapeDtypeStruct(table.shape, table.dtype, sharding=sharded)}
    part = quire.load(url, target, partial=True, storage_options=opts)
    np.testing.assert_array_equal(np.asarray(part["table"]), table)
    reads = [
        r for r in store.proxy.requests(**store.kind.data_read)
        if "table" in r[1] and "zarr.json" not in r[1]
    ]  # fmt: skip
    assert reads and all(r[3].startswith("bytes=") for r in reads), reads
    spans = [r[6:].split("-") for r in {r[3] for r in reads}]  # (an HTTP client may repeat one)
    requested = sum(int(b) - int(a) + 1 for a, b in spans)
    shard = table.nbytes + 16 * 4 + 16 * 16 + 4  # data + inner crcs + index + index crc
    assert requested <= shard + n * (16 * 16 + 4), (requested, shard)  # index read per region
    assert not store.proxy.requests(path=r"(/|%2F)x(/|%2F)")  # other leaves: not touched


def test_overwrite_is_a_compare_and_swap(store: Store) -> None:
    url, opts = store.url(), store.options()
    quire.save(url, build_tree(1), storage_options=opts)
    old = run(store.backend(url).version("quire.json"))
    store.proxy.clear()
    quire.save(url, build_tree(2), overwrite=True, storage_options=opts)
    assert_tree(quire.load(url, storage_options=opts), 2)
    writes = store.proxy.requests(**store.kind.commit_write)
    assert len(writes) == 1
    if store.name == "gs":
        assert f"ifGenerationMatch={old}" in writes[0][1]
    assert len(txids(store, url)) == 1  # the old data went after the swap
    # Never a copy + delete "rename": no copy requests at all.
    assert not [r for r in store.proxy.log if "copy" in r[1].lower() or "rewrite" in r[1]]


def test_gcs_server_refuses_stale_commit_preconditions(gcs_store: Store, zygote: Zygote) -> None:
    """fake-gcs-server refuses a commit's precondition as GCS does (a 412 of its own, not
    one the proxy injects).  A save held at its commit while another writer commits gets
    CheckpointExistsError and removes its data; an overwrite held at its compare-and-swap
    while another overwrite lands is refused, reads the new generation and swaps again.
    Each commit is one multipart upload carrying ``ifGenerationMatch``."""
    store = gcs_store
    store.proxy.clear()
    url, opts, direct = store.url(), store.options(), store.options(direct=True)

    gate = store.proxy.add("hold", times=1, **store.kind.commit_write)
    saving = zygote.spawn(url, opts, 1)
    store.proxy.wait_arrivals(gate, 1)
    quire.save(url, build_tree(2), storage_options=direct)  # another writer commits first
    store.proxy.release(gate)
    assert saving.result() == "exists"
    (create,) = store.proxy.requests(**store.kind.commit_write)
    assert "uploadType=multipart" in create[1] and "ifGenerationMatch=0" in create[1], create
    assert create[2] == "hold"  # forwarded to the server, which refused it
    assert_tree(quire.load(url, storage_options=direct), 2)
    assert len(txids(store, url)) == 1  # the loser removed its data

    store.proxy.clear()
    before = run(store.backend(url).version("quire.json"))
    gate = store.proxy.add("hold", times=1, **store.kind.commit_write)
    saving = zygote.spawn(url, opts, 3, overwrite=True)
    store.proxy.wait_arrivals(gate, 1)
    quire.save(url, build_tree(4), overwrite=True, storage_options=direct)
    between = run(store.backend(url).version("quire.json"))
    store.proxy.release(gate)
    assert saving.result() == "committed"
    swaps = [r[1] for r in store.proxy.requests(**store.kind.commit_write)]
    assert len(swaps) == 2 and all("uploadType=multipart" in t for t in swaps), swaps
    assert f"ifGenerationMatch={before}" in swaps[0], swaps  # refused: the record changed
    assert f"ifGenerationMatch={between}" in swaps[1], swaps
    assert_tree(quire.load(url, storage_options=direct), 3)
    assert len(txids(store, url)) == 1  # the record it replaced: its data went after the swap
    store.proxy.clear()


@pytest.mark.parametrize("where", [*SCHEMES, "local"])
def test_two_processes_race_for_one_url(
    where: str,
    request: pytest.FixtureRequest,
    proxied: dict[str, Store],
    zygote: Zygote,
    tmp_path: Path,
) -> None:
    """Both writers reach the commit together; exactly one commits, the other gets
    CheckpointExistsError, and what loads is entirely the winner's."""
    store: Store | None = None
    if where == "local":
        url, opts = str(tmp_path / "ckpt"), {}
    else:
        store = _store(request, proxied, where)
        url, opts = store.url(), store.options()
        gate = store.proxy.add("hold", times=2, **store.kind.commit_write)
    procs = [zygote.spawn(url, opts, seed) for seed in (1, 2)]
    if store is not None:
        store.proxy.wait_arrivals(gate, 2, timeout=120)  # both are at the commit
        store.proxy.release(gate)
    results = [p.result() for p in procs]
    assert sorted(results) == ["committed", "exists"], results
    winner = (1, 2)[results.index("committed")]
    assert_tree(quire.load(url, storage_options=opts), winner)
    if store is not None:
        assert len(txids(store, url)) == 1  # the loser's data is gone
        store.proxy.clear()


RACE_WRITERS, RACE_ROUNDS = 6, 4


def test_racing_writers_on_gcs_commit_exactly_one_each_round(
    gcs_store: Store, zygote: Zygote
) -> None:
    """Issue 39: round after round, six processes save different trees to one fresh gs://
    URL, held at the commit until all six are there and then let go together, so that
    their six conditional uploads reach fake-gcs-server at once (it decides each under one
    lock, as GCS does atomically).  In every round exactly one commits, the five others
    get CheckpointExistsError and leave no data behind, and what loads is entirely the
    winner's.  (Before quire-gcs sent its conditional uploads as multipart, all six
    committed: the server ignored the precondition of a media upload.  S3's race is the
    two-process test above: moto must be handed conditional PUTs one at a time.)"""
    store = gcs_store
    for round_ in range(RACE_ROUNDS):
        store.proxy.clear()
        url, opts = store.url(), store.options()
        gate = store.proxy.add("hold", times=RACE_WRITERS, serial=False, **store.kind.commit_write)
        seeds = [10 * round_ + i for i in range(1, RACE_WRITERS + 1)]
        procs = [zygote.spawn(url, opts, seed) for seed in seeds]
        store.proxy.wait_arrivals(gate, RACE_WRITERS, timeout=120)
        store.proxy.release(gate)
        results = [p.result() for p in procs]
        want = ["committed"] + ["exists"] * (RACE_WRITERS - 1)
        assert sorted(results) == want, f"round {round_}: {results}"
        assert_tree(quire.load(url, storage_options=opts), seeds[results.index("committed")])
        assert len(txids(store, url)) == 1  # the losers' data is gone
    store.proxy.clear()


def test_uploads_are_concurrent_within_the_byte_budget_and_large_ones_split(store: Store) -> None:
    MiB = 1 << 20
    big = store.kind.parts(max(store.kind.min_part, 4 * MiB), threshold=6 * MiB)
    url = store.url()
    b = open_backend(url, store.options(upload_budget=3 * MiB, **big))
    blob = np.random.default_rng(0).integers(0, 255, 16 * MiB, dtype=np.uint8)

    async def put_small() -> int:
        await asyncio.gather(*(b.put(f"o{i}", [blob[:MiB].data]) for i in range(8)))
        return int(b.budget.peak)  # type: ignore[attr-defined]

    assert MiB < run(put_small()) <= 3 * MiB  # several uploads at once, never past the budget
    run(b.put("large", [blob.data]))
    assert run(b.get("large")) == blob.tobytes()
    parts = store.proxy.requests(**store.kind.part_upload)  # only "large" is uploaded in parts
    assert len(parts) == 4, parts  # 16 MiB in parts of 4 MiB (S3: 5 MiB, its least)


def test_a_reply_left_unread_shows_as_a_checked_out_connection(store: Store) -> None:
    """The isolation guard's question, asked through the public hook: a reply nobody reads
    to its end holds its pooled connection, ``ObjectStoreBackend.checked_out_connections``
    names that backend's client, and once the reply is released it names nothing."""
    url = store.url()
    b = store.backend(url)
    run(b.put("big", [bytes(8 << 20)]))  # more than a socket buffer: the reply cannot end

    async def release(reply: Any) -> None:
        reply.close()

    reply = run(store.kind.unread_reply(b, "big"))
    try:
        found = ObjectStoreBackend.checked_out_connections()
        mine = [x for x in found if x.startswith(f"{type(b).__name__} client ")]
        assert len(mine) == 1 and mine[0].endswith(": 1 connection(s) checked out"), found
    finally:
        run(release(reply))
    assert ObjectStoreBackend.checked_out_connections() == []


# ----------------------------------------------------------------------------- crashes
def kill_at(
    zygote: Zygote, store: Store, url: str, rule: dict[str, str], seed: int, overwrite: bool,
    skip: int = 0,
) -> None:  # fmt: skip
    """Run a saving process and SIGKILL it while its request matching ``rule`` is held;
    the held request is then dropped (it never reaches the server)."""
    gate = store.proxy.add("hold", drop=True, skip=skip, **rule)
    proc = zygote.spawn(url, store.options(), seed, overwrite)
    try:
        store.proxy.wait_arrivals(gate, 1, timeout=120)
    finally:
        proc.kill()
        store.proxy.release(gate)
    assert not [line for line in proc._lines() if line.startswith("{")]  # it never finished
    store.proxy.clear()


def test_crash_during_data_upload_leaves_no_checkpoint(store: Store, zygote: Zygote) -> None:
    url = store.url()
    # format v2: the pack is uploaded, the process dies writing its chunk index
    kill_at(zygote, store, url, store.kind.data_write, seed=1, overwrite=False, skip=1)
    with pytest.raises(quire.CheckpointNotFoundError):
        quire.load(url, storage_options=store.options())
    quire.save(url, build_tree(3), storage_options=store.options())  # over the debris
    assert_tree(quire.load(url, storage_options=store.options()), 3)


def test_crash_before_commit_keeps_the_old_checkpoint(store: Store, zygote: Zygote) -> None:
    url, opts = store.url(), store.options()
    quire.save(url, build_tree(1), storage_options=opts)
    kill_at(zygote, store, url, store.kind.commit_write, seed=2, overwrite=True)
    assert_tree(quire.load(url, storage_options=opts), 1)
    assert len(txids(store, url)) == 2  # the new data was written, never committed
    quire.save(url, build_tree(3), overwrite=True, storage_options=opts)
    assert_tree(quire.load(url, storage_options=opts), 3)


def test_crash_after_commit_has_the_new_checkpoint(store: Store, zygote: Zygote) -> None:
    url, opts = store.url(), store.options()
    quire.save(url, build_tree(1), storage_options=opts)
    kill_at(zygote, store, url, store.kind.deletes, seed=2, overwrite=True)
    assert_tree(quire.load(url, storage_options=opts), 2)
    assert len(txids(store, url)) == 2  # the old data is garbage now, for quire gc


# ----------------------------------------------------------------------------- faults
def test_transient_faults_are_retried(store: Store) -> None:
    p = store.proxy
    p.add("503", times=2, **store.kind.data_write)
    p.add("500", times=1, **store.kind.data_write)
    p.add("reset", times=1, **store.kind.data_write)
    p.add("reset-after", times=1, **store.kind.data_write)
    p.add("reset-after", times=1, **store.kind.commit_write)  # committed, reply lost
    p.add("503", times=2, **store.kind.chunk_read)
    p.add("reset", times=1, **store.kind.chunk_read)
    url, opts = store.url(), store.options()
    quire.save(url, build_tree(4), storage_options=opts)
    assert_tree(quire.load(url, storage_options=opts), 4)
    injected = [r for r in p.log if r[2] != "forward"]
    assert {r[2] for r in injected} == {"503", "500", "reset", "reset-after"}
    for method, target, _, rng in injected:  # each was followed by a successful retry
        assert (method, target, "forward", rng) in p.log, target
    # The lost commit reply was recognised as this writer's commit: one record, whole.
    assert len(p.requests(**store.kind.commit_write)) == 2


def test_streamed_packs_survive_transient_faults(store: Store) -> None:
    """A 503, a reset before the server saw it and a lost reply, each on a streamed pack's
    parts (S3) / resumable chunks (GCS), and a lost reply of S3's CompleteMultipartUpload:
    each is retried or resumed from the offset the server confirms; the save commits and
    loads exactly.  (GCS: the proxy keeps fake-gcs-server's sessions to GCS's protocol,
    :class:`object_store_servers.GcsSessions`; the first fault is on the first chunk, so
    a status check finds an empty session.)"""
    MiB = 1 << 20
    rng = np.random.default_rng(11)
    tree = {f"a{i}": rng.standard_normal(1 << 19).astype(np.float32) for i in range(6)}
    p = store.proxy
    extra = store.kind.parts(max(store.kind.min_part, MiB))  # S3: 5 MiB parts, GCS: 1 MiB
    part = store.kind.part_upload
    if store.kind.part_complete:  # S3's CompleteMultipartUpload
        p.add("reset-after", times=1, **store.kind.part_complete)
    p.add("503", times=1, **part)
    p.add("reset", times=1, skip=1, **part)
    p.add("reset-after", times=1, skip=2, **part)
    url, opts = store.url(), store.options(**extra)
    quire.save(url, tree, storage_options=opts)  # one pack of 12 MiB
    assert {r[2] for r in p.log if r[2] != "forward"} == {"503", "reset", "reset-after"}
    got = quire.load(url, storage_options=opts)
    assert all(np.array_equal(got[k], v) for k, v in tree.items())


def test_read_timeout_is_retried(store: Store) -> None:
    url = store.url()
    opts = store.options(**store.kind.client_timeouts)
    quire.save(url, build_tree(5), storage_options=opts)
    store.proxy.add("stall", delay=3, times=1, **store.kind.chunk_read)
    t0 = time.monotonic()
    assert_tree(quire.load(url, storage_options=opts), 5)
    assert time.monotonic() - t0 >= 1  # it waited out the stalled request, then retried
    assert [r for r in store.proxy.log if r[2] == "stall"]


def test_transient_faults_past_the_deadline_fail_and_commit_nothing(store: Store) -> None:
    store.proxy.add("503", times=-1, **store.kind.data_write)
    url = store.url()
    opts = store.options(retry_deadline=1.0)
    t0 = time.monotonic()
    with pytest.raises(quire.QuireError, match=r"kept failing.*gave up after \d+ attempts"):
        quire.save(url, build_tree(6), storage_options=opts)
    assert time.monotonic() - t0 < 15
    assert not store.proxy.requests(**store.kind.commit_write)  # never reached the commit
    with pytest.raises(quire.CheckpointNotFoundError):
        quire.load(url, storage_options=store.options())


@pytest.mark.parametrize("fault", ["access-denied", "bad-credentials"])
def test_permanent_faults_fail_at_once(
    store: Store, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    if fault == "access-denied":
        store.proxy.add("403", times=-1, **store.kind.data_write)
    else:  # S3 says 403 InvalidAccessKeyId; GCS says 401
        status, code = store.kind.bad_credentials
        store.proxy.add(
            status, **({"code": code} if code else {}), times=-1, **store.kind.data_write
        )
    url, opts = store.url(), store.options()
    caplog.set_level(logging.DEBUG, logger="quire")
    t0 = time.monotonic()
    with pytest.raises(quire.QuireError) as info:
        quire.save(url, build_tree(7), storage_options=opts)
    assert time.monotonic() - t0 < 10
    message = str(info.value)
    assert "denied" in message and "credentials" in message, message
    # Not retried: each object was tried once.
    targets = [r[1] for r in store.proxy.requests(**store.kind.data_write)]
    assert len(targets) == len(set(targets))
    assert not store.proxy.requests(**store.kind.commit_write)
    for text in (message, caplog.text):
        assert S3_SECRET not in text
    with pytest.raises(quire.CheckpointNotFoundError):
        quire.load(url, storage_options=store.options())


def test_missing_bucket_fails_at_once(store: Store) -> None:
    url = f"{store.name}://no-such-bucket-{os.getpid()}/ckpt"
    t0 = time.monotonic()
    with pytest.raises(quire.QuireError, match=r"bucket 'no-such-bucket-.*' does not exist"):
        quire.save(url, build_tree(8), storage_options=store.options())
    assert time.monotonic() - t0 < 10
    with pytest.raises(quire.CheckpointNotFoundError):
        quire.load(url, storage_options=store.options())


def test_credentials_stay_out_of_records_logs_and_errors(
    s3_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    store = s3_store
    store.proxy.clear()
    caplog.set_level(logging.DEBUG, logger="quire")
    url, opts = store.url(), store.options()
    store.proxy.add("503", times=3, **store.kind.data_write)
    quire.save(url, build_tree(9), storage_options=opts)
    record = run(store.backend(url).get("quire.json"))
    assert S3_SECRET.encode() not in record and S3_KEY.encode() not in record
    assert "retry" in caplog.text  # the retries were logged, without credentials
    assert S3_SECRET not in caplog.text and S3_KEY not in caplog.text
    assert S3_SECRET not in repr(open_backend(url, opts))
    store.proxy.clear()


# ----------------------------------------------------------------------------- configuration
def test_configuration_the_fsspec_way(moto: MotoS3, gcs: FakeGcs, tmp_path: Path) -> None:
    import fsspec.config

    tree = build_tree(10)
    # quire.Context / quire.configure: per-protocol storage options.
    url = moto.fresh_url()
    with quire.Context(storage_options={"s3": moto.options()}):
        quire.save(url, tree)
        assert_tree(quire.load(url), 10)
    # fsspec's config files.
    (tmp_path / "s3.json").write_text(json.dumps({"s3": moto.options()}))
    saved = dict(fsspec.config.conf)
    try:
        fsspec.config.set_conf_files(str(tmp_path), fsspec.config.conf)
        opts = {"config_kwargs": {"user_agent_extra": "fsspec-config-test"}}
        url = moto.fresh_url()
        quire.save(url, tree, storage_options=opts)
        assert_tree(quire.load(url, storage_options=opts), 10)
    finally:
        fsspec.config.conf.clear()
        fsspec.config.conf.update(saved)
    # The AWS environment (endpoint included).
    with env(AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET,
             AWS_ENDPOINT_URL_S3=moto.endpoint, AWS_DEFAULT_REGION="us-east-1"):  # fmt: skip
        opts = {"config_kwargs": {"user_agent_extra": "env-test"}}
        url = moto.fresh_url()
        quire.save(url, tree, storage_options=opts)
        assert_tree(quire.load(url, storage_options=opts), 10)
    # STORAGE_EMULATOR_HOST for GCS.
    with env(STORAGE_EMULATOR_HOST=gcs.endpoint):
        opts = {"project": "env-test"}  # anonymous, as for any emulator
        url = gcs.fresh_url().replace("gs://", "gcs://")  # the gcs:// alias too
        quire.save(url, tree, storage_options=opts)
        assert_tree(quire.load(url, storage_options=opts), 10)


def test_s3_url_without_the_plugin_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from quire._runtime import registry as _registry

    real = _registry.installed

    def without_s3(group: str) -> Any:
        return [ep for ep in real(group) if not ep.value.startswith("quire_s3")]

    monkeypatch.setattr(_registry, "installed", without_s3)
    _registry.clear_caches()
    try:
        with pytest.raises(quire.errors.PluginError, match=r"pip install quire-s3"):
            quire.load("s3://bucket/ckpt")
    finally:
        monkeypatch.undo()
        _registry.clear_caches()


# ----------------------------------------------------------------------------- quire cp
class Cursor:
    """A data-iterator position that saves itself as a checkpointable unit."""

    def __init__(self, pos: int) -> None:
        self.pos = pos

    def quire_save(self, io: Any) -> Any:
        io.write("state", json.dumps({"pos": self.pos}).encode())
        return {"version": 1}

    def quire_restore(self, io: Any, record: Any) -> Cursor:
        self.pos = json.loads(io.read("state"))["pos"]
        return self


def cli(*args: str) -> int:
    from quire._cli.main import main

    return main(list(args))


def test_cp_between_local_s3_and_gcs(s3_store: Store, gcs_store: Store, tmp_path: Path) -> None:
    src = str(tmp_path / "src")
    tree = build_tree(11)
    quire.save_checkpointables(
        src, {"pytree": tree, "config": {"lr": 0.1}, "cursor": Cursor(42)},
        storage=lambda path, leaf: quire.StorageOptions(chunk_bytes=4096, codecs=["zstd"])
        if path == ("params", "w") else None,
    )  # fmt: skip
    s3_url, gs_url, back = s3_store.url(), gcs_store.url(), str(tmp_path / "back")
    s3o, gso = json.dumps(s3_store.options()), json.dumps(gcs_store.options())
    s3_store.proxy.clear()
    assert cli("cp", src, s3_url, "--dst-options", s3o) == 0
    # Data first, the commit record last.
    writes = [r for r in s3_store.proxy.log if r[0] in ("PUT", "POST")]
    assert "quire.json" in writes[-1][1] and all("quire.json" not in w[1] for w in writes[:-1])
    assert cli("cp", s3_url, gs_url, "--src-options", s3o, "--dst-options", gso, "-q") == 0
    assert cli("cp", gs_url, back, "--src-options", gso) == 0
    got = quire.load_checkpointables(back, {"pytree": None, "config": None, "cursor": Cursor(0)})
    assert_tree(got["pytree"], 11)
    assert got["config"] == {"lr": 0.1} and got["cursor"].pos == 42
    assert Path(back, "quire.json").read_bytes() == Path(src, "quire.json").read_bytes()
    assert cli("verify", back) == 0


def test_cp_refuses_an_existing_destination_unless_overwrite(
    s3_store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src1, src2 = str(tmp_path / "one"), str(tmp_path / "two")
    quire.save(src1, build_tree(12))
    quire.save(src2, build_tree(13))
    dst, opts = s3_store.url(), json.dumps(s3_store.options(direct=True))
    assert cli("cp", src1, dst, "--dst-options", opts, "-q") == 0
    assert cli("cp", src2, dst, "--dst-options", opts, "-q") == 2
    assert "already exists" in capsys.readouterr().err
    assert_tree(quire.load(dst, storage_options=json.loads(opts)), 12)
    assert cli("cp", src2, dst, "--dst-options", opts, "--overwrite", "-q") == 0
    assert_tree(quire.load(dst, storage_options=json.loads(opts)), 13)
    assert len(txids(s3_store, dst)) == 1  # the replaced checkpoint's data was deleted


@pytest.mark.parametrize("layout", ["chunks", "packed"])
def test_cp_verifies_checksums_and_commits_nothing_on_damage(
    s3_store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str
) -> None:
    src = tmp_path / "src"
    quire.save(str(src), build_tree(14), layout=layout)
    if layout == "chunks":
        chunk = next(p for p in src.rglob("*") if p.is_file() and "/params/w/c/" in str(p))
        at = 100
    else:  # a byte of params/w's first chunk inside its pack
        (entry,) = json.loads((src / "quire.json").read_text())["indexes"]
        refs = json.loads((src / entry["object"]).read_text())["refs"]
        target, at, _ = next(v for k, v in refs.items() if "/params/w/c/" in k)
        chunk, at = src / target, at + 100
    raw = bytearray(chunk.read_bytes())
    raw[at] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    dst, opts = s3_store.url(), json.dumps(s3_store.options(direct=True))
    assert cli("cp", str(src), dst, "--dst-options", opts) == 1  # damaged source (exit 1)
    err = capsys.readouterr().err
    assert "CorruptCheckpointError" in err and "params/w" in err and "checksum" in err
    assert not run(s3_store.backend(dst).exists("quire.json"))


def test_cp_progress_counts_chunks_as_verify_does(tmp_path: Path) -> None:
    """``copy_checkpoint(progress=)`` reports array chunks (a pack holds many, a zarr.json
    none): the unit ``quire verify`` and ``quire info`` count, in both layouts."""
    from quire._engine.copying import copy_checkpoint
    from quire._format.describe import counts

    for layout in ("packed", "chunks"):
        src = str(tmp_path / f"src-{layout}")
        quire.save(src, build_tree(15), layout=layout)
        want = counts(quire.metadata(src).tree).chunks
        calls: list[tuple[int, int, int, int]] = []
        res = run(
            copy_checkpoint(
                src, str(tmp_path / f"dst-{layout}"), progress=lambda *a, c=calls: c.append(a)
            )
        )
        assert len(calls) == res.objects - 1  # one call per object copied (the record last)
        assert calls[-1][:2] == (want, want) and res.chunks == want > 3, (layout, calls[-1])
        assert calls[-1][2] == res.bytes - len(
            (tmp_path / f"src-{layout}" / "quire.json").read_bytes()
        )


def test_every_command_takes_storage_options(s3_store: Store, tmp_path: Path) -> None:
    """Issue 14: every command on S3 with `-o key=value` or JSON, no env."""
    url = s3_store.url()
    quire.save(url, build_tree(3), storage_options=s3_store.options())
    as_o = [a for k, v in s3_store.options().items() for a in ("-o", f"{k}={json.dumps(v)}")]
    as_json = ["--storage-options", json.dumps(s3_store.options())]
    for opts in (as_o, as_json):
        assert cli("info", url, *opts) == 0
        assert cli("verify", url, *opts) == 0
        assert cli("ls", url, *opts) == 0
        assert cli("gc", url, *opts) == 0
        assert cli("diff", url, url, "--values", *opts) == 0
        # cp, export, a conversion and a cross-format diff, all on S3
        copy, st, conv = s3_store.url(), f"{s3_store.url()}/m.safetensors", s3_store.url()
        assert cli("cp", url, copy, "-q", *opts) == 0
        assert cli("export", copy, st, "-q", *opts) == 0
        assert cli("cp", st, conv, "-q", *opts) == 0
        assert cli("diff", conv, st, "--values", *opts) == 0


def test_incremental_checkpointer_borrows_on_object_stores(store: Store, tmp_path: Path) -> None:
    """An incremental root on S3 / GCS: steps after the first upload only the changed leaf,
    retention keeps the borrowed pack, every retained step loads, and ``quire cp`` of a
    step to a local directory is self-contained."""
    import jax.numpy as jnp

    from quire.policies import LatestN

    url, opts = store.url(), store.options()
    frozen = {f"w{i}": jnp.asarray(np.full((64, 64), i, np.float32)) for i in range(9)}
    trees = [{"frozen": frozen, "x": jnp.asarray(np.full((64, 64), 100 + s, np.float32))}
             for s in range(4)]  # fmt: skip
    with quire.Checkpointer(url, incremental=True, keep=LatestN(2), storage_options=opts) as ck:
        for s, t in enumerate(trees):
            ck.save(s, t)
            ck.wait()
        assert ck.steps() == [2, 3]
        for s in (2, 3):
            got = ck.load(s)
            assert np.array_equal(np.asarray(got["x"]), np.asarray(trees[s]["x"]))
            for k, v in frozen.items():
                assert np.array_equal(np.asarray(got["frozen"][k]), np.asarray(v))
    b = store.backend(url)
    keys = run(b.list(""))
    packs = [k for k in keys if "/%packs/p00000-" in k]
    # step 0's pack (frozen, borrowed), steps 2 and 3's own (x); steps 1's is gone
    assert sorted(k.split("/")[0] for k in packs) == ["step_00000000", "step_00000002",
                                                       "step_00000003"], packs  # fmt: skip
    sizes = {k.split("/")[0]: run(b.size(k)) for k in packs}
    assert sizes["step_00000003"] * 8 < sizes["step_00000000"]
    dst = str(tmp_path / "copy")
    quire.copy(f"{url}/step_00000003", dst, storage_options=opts)
    got = quire.load(dst)
    assert np.array_equal(np.asarray(got["frozen"]["w8"]), np.asarray(frozen["w8"]))
