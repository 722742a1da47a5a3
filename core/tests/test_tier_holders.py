"""A multi-process local tier's restore reader with several peer holders, in one process: a
real saved step (packs, chunk index, commit record), real ``PeerServer``s on 127.0.0.1
serving copies of it, ``quire.load`` through the reader.

* A holder whose copy was altered on its disk (it still answers over TLS with the run's
  certificate) is passed over for the next holder, range by range, and the load is
  bit-identical; with this root and every peer holder altered, the persistent tier (holding
  the agreed record) serves those ranges; with every holder altered and no persistent
  copy, the load fails with ``CorruptCheckpointError`` naming them (never silently wrong).
* Ranges go to the holder with the fewest bytes in flight: reads issued together spread
  over both holders.
* Each holder's connections are kept open for the load (at most ``PEER_STREAMS``), and a
  pooled connection the server dropped while idle is replaced without failing the read.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from peer_helpers import run_of

import quire
from quire._engine import commit as _commit
from quire._peers import link
from quire._store.url import mounted, normalize, open_backend
from quire._tiers import ownership, restore_reader
from quire.errors import CorruptCheckpointError

(CREDS,), _ = run_of(1)  # every server here is this one process


class Link:
    """What a peer source uses of ``PeerCopies``: addresses, pinned certificates, the
    deadline."""

    def __init__(self, addresses: dict[int, tuple[str, int]]) -> None:
        self.addresses, self.timeout = addresses, 10.0

    def peer(self, j: int) -> link.Pinned:
        return CREDS.peer(0)

    def _address(self, j: int) -> tuple[str, int]:
        return self.addresses[j]


def state() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((64, 4096), dtype=np.float32),
        "b": np.arange(1000, dtype=np.int64),
    }


@pytest.fixture
def step(tmp_path: Path) -> dict[str, Any]:
    """One saved step, marked as process 0's objects, copied to two holders' roots."""
    src = tmp_path / "saved"
    quire.save(str(src), state())
    backend = open_backend(str(src))
    rec = asyncio.run(_commit.read(backend, str(src)))
    asyncio.run(ownership.mark_own(backend, str(src), rec.doc, 0, 0))
    holders = []
    for name in ("h1", "h2"):
        shutil.copytree(src, tmp_path / name / "s")
        holders.append(tmp_path / name)
    (pack,) = (src / "d").glob("*/%packs/p00000-*")
    return {
        "raw": rec.raw,
        "doc": rec.doc,
        "holders": holders,
        "pack": pack.relative_to(src).as_posix(),
        "mine": tmp_path / "mine",
    }


def damage(root: Path, pack: str) -> None:
    """Flip bytes in the middle of the pack on that holder's disk (same size)."""
    damage_file(root / "s" / pack)


def damage_file(f: Path) -> None:
    data = bytearray(f.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))


def reader(step: dict[str, Any], servers: list[link.PeerServer]) -> restore_reader.RestoreReader:
    copies = Link({i + 1: s.address for i, s in enumerate(servers)})
    holders = {h: restore_reader.Holder(copies, h) for h in copies.addresses}  # type: ignore[arg-type]
    srcs = [
        restore_reader.peer_provider(copies, h, "s", step["doc"], 0, holders[h])  # type: ignore[arg-type]
        for h in sorted(holders)
    ]
    return restore_reader.RestoreReader(str(step["mine"]), step["raw"], step["doc"], 0, {0: srcs})


def load_through(r: restore_reader.RestoreReader, url: str) -> Any:
    with mounted(normalize(url), r):
        return quire.load(url)


def same(got: Any) -> None:
    want = state()
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k])


def test_altered_bytes_at_one_holder_are_read_again_from_the_next(
    step: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    damage(step["holders"][0], step["pack"])
    with (
        link.PeerServer(step["holders"][0], CREDS) as bad,
        link.PeerServer(step["holders"][1], CREDS) as good,
    ):
        r = reader(step, [bad, good])
        with caplog.at_level(logging.WARNING, logger="quire"):
            same(load_through(r, str(step["mine"])))
        r.close_peers()
        assert r.retried >= 1
        assert good.served > 0
        assert any("fail their check" in m and "process 1" in m for m in caplog.messages)


def test_altered_bytes_here_and_at_the_peers_are_read_from_the_persistent_tier(
    step: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """This process's own root and both peer holders altered: the damaged ranges come from
    the persistent tier, which holds the step with the agreed record."""
    mine = step["mine"]
    shutil.copytree(step["holders"][0] / "s", mine)
    damage_file(mine / step["pack"])
    for h in step["holders"]:
        damage(h, step["pack"])
    persistent = tmp_path / "persistent"
    shutil.copytree(tmp_path / "saved", persistent)

    async def record() -> bytes:
        return bytes(step["raw"])

    with (
        link.PeerServer(step["holders"][0], CREDS) as a,
        link.PeerServer(step["holders"][1], CREDS) as b,
    ):
        peers = reader(step, [a, b]).sources[0]
        here = restore_reader.local_provider(open_backend(str(mine)), step["doc"], 0)
        there = restore_reader.persistent_provider(
            open_backend(str(persistent)), str(persistent), step["doc"], 0, 0
        )
        r = restore_reader.RestoreReader(
            str(mine), step["raw"], step["doc"], 0, {0: [here, *peers, there]}, record
        )
        with caplog.at_level(logging.WARNING, logger="quire"):
            same(load_through(r, str(step["mine"])))
        r.close_peers()
        stats = r.stats()
        assert stats[f"the persistent tier {persistent}"][0] > 0
        assert r.retried >= 3  # here, then each peer, then the persistent tier
        for who in ("this process's local tier", "process 1", "process 2"):
            assert any("fail their check" in m and who in m for m in caplog.messages), who


def test_altered_bytes_at_every_holder_fail_the_load(step: dict[str, Any]) -> None:
    for h in step["holders"]:
        damage(h, step["pack"])
    with (
        link.PeerServer(step["holders"][0], CREDS) as a,
        link.PeerServer(step["holders"][1], CREDS) as b,
    ):
        r = reader(step, [a, b])
        with pytest.raises(CorruptCheckpointError, match=r"process 1: .*process 2: "):
            load_through(r, str(step["mine"]))
        r.close_peers()


def test_ranges_spread_over_the_least_loaded_holders_on_kept_connections(
    step: dict[str, Any],
) -> None:
    with (
        link.PeerServer(step["holders"][0], CREDS) as a,
        link.PeerServer(step["holders"][1], CREDS) as b,
    ):
        r = reader(step, [a, b])
        size = (Path(step["holders"][0]) / "s" / step["pack"]).stat().st_size
        piece = size // 16

        async def go() -> list[bytes]:
            bufs = [bytearray(piece) for _ in range(16)]
            await asyncio.gather(
                *(
                    r.get_into(step["pack"], [memoryview(buf)], i * piece)
                    for i, buf in enumerate(bufs)
                )
            )
            await asyncio.gather(  # a second round reuses the connections
                *(
                    r.get_into(step["pack"], [memoryview(buf)], i * piece)
                    for i, buf in enumerate(bufs)
                )
            )
            return [bytes(b) for b in bufs]

        got = asyncio.run(go())
        data = (Path(step["holders"][0]) / "s" / step["pack"]).read_bytes()
        assert b"".join(got) == data[: 16 * piece]
        # both holders served ranges; neither was asked for all of them
        assert a.requests >= 4 and b.requests >= 4, (a.requests, b.requests)
        holders = {s.holder.index: s.holder for s in r.sources[0]}  # type: ignore[attr-defined]
        for h in holders.values():
            assert 1 <= h.connections <= restore_reader.PEER_STREAMS
        r.close_peers()


def test_a_pooled_connection_dropped_while_idle_is_replaced(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"0123456789" * 1000)
    server = link.PeerServer(tmp_path, CREDS, idle_timeout=0.2)
    me = CREDS.peer(0)
    with server, link.Pool(server.address, me, 2) as pool:
        a = link.fetch(server.address, "f", me, 5, 1 << 20, 0, 10, pool=pool)
        b = link.fetch(server.address, "f", me, 5, 1 << 20, 10, 20, pool=pool)
        assert (a, b) == (b"0123456789", b"0123456789")
        assert pool.connections == 1  # the second request on the first connection
        time.sleep(0.6)  # the server drops the idle connection
        buf = bytearray(5)
        n = link.fetch_into(server.address, "f", me, 5, [memoryview(buf)], 3, pool=pool)
        assert (n, bytes(buf)) == (5, b"34567")
        assert pool.connections == 2


def test_opening_ahead_counts_the_connections_already_open(step: dict[str, Any]) -> None:
    """A lost process fetches the step's record from a holder while its connections open
    ahead (``Holder.warm``): the record's connection is one of the ``PEER_STREAMS``, not a
    handshake more for both ends."""
    with link.PeerServer(step["holders"][0], CREDS) as server:
        holder = restore_reader.Holder(Link({1: server.address}), 1)  # type: ignore[arg-type]

        async def go() -> bytes:
            raw = await holder.record("s")  # opens a connection, left idle in the pool
            holder.warm()
            assert holder._warming is not None
            await holder._warming
            return raw  # type: ignore[no-any-return]

        try:
            assert asyncio.run(go()) == step["raw"]
            assert holder.connections == restore_reader.PEER_STREAMS
        finally:
            holder.close()
