"""The restore reader of a multi-process local tier, in one process: real local roots, a real
``PeerServer`` on 127.0.0.1 (the holder), a dead address, and a "persistent" root.

Each key goes to its owner's sources in order: this root, a live holder (byte ranges over
the peer link, a failed holder passed over for the rest of the load), the persistent tier
only when its record is the agreed one; the agreed record is served from memory; sizes and
listings come from markers; nothing is written; ``mounted`` scopes the view to its block.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from peer_helpers import key_value_store, run_of

from quire._peers import link
from quire._store.url import mounted, open_backend
from quire._tiers import peer_copies, restore_reader
from quire._tiers.restore_plan import record_digest
from quire.errors import PeerError

(CREDS,), _ = run_of(1)  # every server here is this one process
TX = "0123456789abcdef"
PACK0 = f"d/{TX}/%packs/p00000-00000"
PACK1 = f"d/{TX}/%packs/p00001-00000"
UNIT = f"d/{TX}/loader/position.bin"
DOC: dict[str, Any] = {"txids": [TX], "units": {}, "indexes": []}
RAW = b'{"the": "agreed record"}'


class Link:
    """What a peer source uses of ``PeerCopies``: addresses, pinned certificates, the
    deadline."""

    def __init__(self, addresses: dict[int, tuple[str, int]]) -> None:
        self.addresses, self.timeout = addresses, 5.0

    def peer(self, j: int) -> link.Pinned:
        return CREDS.peer(0)

    def _address(self, j: int) -> tuple[str, int]:
        return self.addresses[j]


def write(root: Path, files: dict[str, bytes], owner: int) -> None:
    for k, v in files.items():
        (root / k).parent.mkdir(parents=True, exist_ok=True)
        (root / k).write_bytes(v)
    marker = root / f"d/{TX}/%tier/p{owner:05d}.json"
    marker.parent.mkdir(parents=True, exist_ok=True)
    sizes = {k: len(v) for k, v in files.items()}
    marker.write_text(json.dumps({"owner": owner, "objects": sizes}))


def dead_address() -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()  # type: ignore[no-any-return]


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, Any]:
    mine, holder, persistent = (tmp_path / n for n in ("mine", "holder", "persistent"))
    one = {PACK1: os.urandom(300_000), UNIT: b"position" * 10}
    write(mine, {PACK0: os.urandom(1000)}, 0)
    write(holder / "s", one, 1)  # the step's directory under the served root
    for k, v in one.items():
        (persistent / k).parent.mkdir(parents=True, exist_ok=True)
        (persistent / k).write_bytes(v)
    return {"mine": mine, "holder": holder, "persistent": persistent, "one": one}


def reader(
    roots: dict[str, Any], server: link.PeerServer, persistent_raw: bytes | None
) -> restore_reader.RestoreReader:
    copies = Link({1: server.address, 2: dead_address()})
    local = open_backend(str(roots["mine"]))
    pb = open_backend(str(roots["persistent"]))
    slots = {h: asyncio.Semaphore(restore_reader.PEER_STREAMS) for h in (1, 2)}

    async def record() -> bytes:
        assert persistent_raw is not None
        return persistent_raw

    sources = {
        0: [restore_reader.local_provider(local, DOC, 0)],
        1: [
            restore_reader.peer_provider(copies, 2, "s", DOC, 1, slots[2]),  # type: ignore[arg-type]
            restore_reader.peer_provider(copies, 1, "s", DOC, 1, slots[1]),  # type: ignore[arg-type]
            restore_reader.persistent_provider(pb, str(roots["persistent"]), DOC, 1, 0),
        ],
    }
    return restore_reader.RestoreReader(
        str(roots["mine"]), RAW, DOC, 1, sources, record if persistent_raw else None
    )


def test_ranges_from_the_live_holder_after_a_dead_one(roots: dict[str, Any]) -> None:
    holder = link.PeerServer(roots["holder"], CREDS)
    with holder:
        r = reader(roots, holder, None)
        one = roots["one"]

        async def go() -> None:
            assert await r.get("quire.json") == RAW
            assert await r.get(PACK0, 10, 20) == (roots["mine"] / PACK0).read_bytes()[10:20]
            assert await r.get(PACK1, 1000, 1100) == one[PACK1][1000:1100]
            buf = bytearray(5000)
            assert await r.get_into(PACK1, [memoryview(buf)], 200_000) == 5000
            assert bytes(buf) == one[PACK1][200_000:205_000]
            assert await r.get(UNIT) == one[UNIT]  # whole: its size from the marker
            assert await r.size(PACK1) == len(one[PACK1])
            assert await r.exists(UNIT) and not await r.exists(f"d/{TX}/loader/nope")
            assert await r.list(f"d/{TX}/loader") == [UNIT]
            with pytest.raises(FileNotFoundError):
                await r.get("d/othertx/%packs/p00001-00000")
            with pytest.raises(PermissionError):
                await r.put(PACK1, [b"x"])
            with pytest.raises(PermissionError):
                await r.delete([PACK1])

        asyncio.run(go())
        # only the ranges asked for, the unit object and the marker crossed the link
        marker = (roots["holder"] / "s" / f"d/{TX}/%tier/p00001.json").stat().st_size
        assert holder.served == 100 + 5000 + len(one[UNIT]) + marker
        stats = r.stats()
        assert set(stats) == {"process 1"} and stats["process 1"][0] == holder.served


@pytest.mark.parametrize("size", [2**63, 2**64, 2**70])
def test_a_holder_whose_marker_gives_an_impossible_size_is_lost_and_the_next_one_read(
    roots: dict[str, Any], tmp_path: Path, size: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder's marker is untrusted input: a size no object has (at least 2**63, past
    what a request can carry from 2**64) makes the marker malformed and that holder lost
    (``PeerError``) before anything else is asked of it; the next holder is read, not the
    restore aborted."""
    caplog.set_level(logging.WARNING, logger="quire")
    one = roots["one"]
    bad = tmp_path / "bad"
    write(bad / "s", one, 1)
    marker = bad / "s" / f"d/{TX}/%tier/p00001.json"
    marker.write_text(json.dumps({"owner": 1, "objects": {UNIT: size}}))
    with link.PeerServer(bad, CREDS) as b, link.PeerServer(roots["holder"], CREDS) as good:
        copies = Link({1: b.address, 2: good.address})
        slots = {h: asyncio.Semaphore(restore_reader.PEER_STREAMS) for h in (1, 2)}
        sources = [
            restore_reader.peer_provider(copies, h, "s", DOC, 1, slots[h])  # type: ignore[arg-type]
            for h in (1, 2)
        ]
        r = restore_reader.RestoreReader(str(roots["mine"]), RAW, DOC, 1, {1: sources})
        assert asyncio.run(r.get(UNIT)) == one[UNIT]
        assert (b.requests, good.requests) == (1, 2)  # the markers; the object
    good_marker = roots["holder"] / "s" / f"d/{TX}/%tier/p00001.json"
    assert r.stats()["process 2"] == (good_marker.stat().st_size + len(one[UNIT]), 2)
    assert "its marker for process 1 is malformed" in caplog.text
    assert "past the end" not in caplog.text  # no range asked of the bad holder


def test_the_persistent_tier_only_with_the_agreed_record(roots: dict[str, Any]) -> None:
    holder = link.PeerServer(roots["holder"], CREDS)
    holder.close()  # every holder of owner 1 is gone
    r = reader(roots, holder, RAW)
    got = asyncio.run(r.get(PACK1, 5, 50))
    assert got == roots["one"][PACK1][5:50]
    assert r.stats() == {f"the persistent tier {roots['persistent']}": (45, 1)}
    other = reader(roots, holder, b"another record")
    with pytest.raises(PeerError, match="no holder of process 1's objects answered"):
        asyncio.run(other.get(PACK1, 5, 50))
    none = reader(roots, holder, None)
    with pytest.raises(PeerError, match=r"process 2: .*process 1: "):
        asyncio.run(none.get(PACK1, 5, 50))


def test_mounted_only_inside_its_block(roots: dict[str, Any]) -> None:
    with link.PeerServer(roots["holder"], CREDS) as holder:
        r = reader(roots, holder, None)
        url = str(roots["mine"])
        with mounted(url, r):
            assert open_backend(url) is r
            assert open_backend(url + "x") is not r
        assert open_backend(url) is not r


# ---------------------------------------------------------------------- published addresses
class Published:
    """``PeerCopies``' own address lookup (``_address``) over a real key-value store,
    where the other processes' addresses are published by the test."""

    _address = peer_copies.PeerCopies._address

    def __init__(self, kv: Any, addresses: dict[int, str]) -> None:
        self.name, self.timeout = "restore-test", 2.0
        self._addresses: dict[int, tuple[str, int]] = {}
        key = peer_copies._key(f"{self.name}/address")
        for j, value in addresses.items():
            kv.key_value_set(f"{key}/{j}", value)

    def peer(self, j: int) -> link.Pinned:
        return CREDS.peer(0)


@pytest.fixture
def kv(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from key_value_store(monkeypatch)


GARBAGE = ["not json", '["h"]', '{"host": "127.0.0.1", "port": 1}', '["h", "x"]']


@pytest.mark.parametrize("garbage", GARBAGE)
def test_a_holder_that_published_a_malformed_address_is_lost_and_the_next_one_read(
    roots: dict[str, Any], kv: Any, garbage: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    with link.PeerServer(roots["holder"], CREDS) as holder:
        copies = Published(kv, {2: garbage, 1: json.dumps(list(holder.address))})
        slots = {h: restore_reader.Holder(copies, h) for h in (1, 2)}  # type: ignore[arg-type]
        r = restore_reader.RestoreReader(
            str(roots["mine"]),
            RAW,
            DOC,
            1,
            {
                1: [
                    restore_reader.peer_provider(copies, h, "s", DOC, 1, slots[h])  # type: ignore[arg-type]
                    for h in (2, 1)
                ]
            },
        )
        got = asyncio.run(r.get(PACK1, 1000, 1100))
        r.close_peers()
        # the commit record, too, from the next holder of it (process 3 published no
        # address at all)
        (roots["holder"] / "s" / "quire.json").write_bytes(RAW)
        digest = record_digest(RAW)
        backend = open_backend(str(roots["mine"]))
        url = str(roots["mine"])
        rec = asyncio.run(
            restore_reader.agreed_record(
                {h: restore_reader.Holder(copies, h) for h in (1, 2, 3)},  # type: ignore[arg-type]
                0,
                backend,
                url,
                digest,
                [2, 3, 1],
                "s",
            )
        )
    assert got == roots["one"][PACK1][1000:1100]
    assert r.stats() == {"process 1": (100, 1)}
    assert rec == RAW
    assert "process 2 published a malformed peer address" in caplog.text
    assert "treated as lost, the next holder is asked" in caplog.text


def test_with_every_holder_malformed_the_persistent_tier_is_read(
    roots: dict[str, Any], kv: Any
) -> None:
    copies = Published(kv, {1: GARBAGE[0], 2: GARBAGE[3]})
    pb = open_backend(str(roots["persistent"]))

    async def record() -> bytes:
        return RAW

    sources = [
        restore_reader.peer_provider(copies, h, "s", DOC, 1, asyncio.Semaphore(1))  # type: ignore[arg-type]
        for h in (1, 2)
    ]
    sources.append(restore_reader.persistent_provider(pb, str(roots["persistent"]), DOC, 1, 0))
    r = restore_reader.RestoreReader(str(roots["mine"]), RAW, DOC, 1, {1: sources}, record)
    assert asyncio.run(r.get(PACK1, 5, 50)) == roots["one"][PACK1][5:50]
    assert r.stats() == {f"the persistent tier {roots['persistent']}": (45, 1)}


def test_the_peer_server_keeps_handshake_slots_for_the_published_hosts(
    tmp_path: Path, kv: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Opening the tier's peer copies, this process (0 of 3 here) reads the addresses the
    others published; its server keeps the run's handshake slots for their hosts (a
    malformed one is logged and left out)."""
    caplog.set_level(logging.WARNING, logger="quire")
    name = "slots-test"
    key = peer_copies._key(f"{name}#1/address")
    kv.key_value_set(f"{key}/1", '["127.0.0.7", 4242]')
    kv.key_value_set(f"{key}/2", '["h", "x"]')
    domains = peer_copies._key(f"{name}#1/domain")
    for j in (1, 2):
        kv.key_value_set(f"{domains}/{j}", f"host{j}")
    copies = peer_copies.PeerCopies(str(tmp_path / "tier"), name, 0, 3, 1, "127.0.0.1", 5.0)
    try:
        assert copies.server._admission.run_hosts == {"127.0.0.1", "127.0.0.7"}
        assert "no handshake slots kept for process 2" in caplog.text
    finally:
        copies.server.close()


# ---------------------------------------------------------------------- connections ahead
def test_a_holder_opens_its_connections_ahead_and_the_reads_use_them(
    roots: dict[str, Any],
) -> None:
    """``Holder.warm`` (a restore calls it for the first holder of each owner it lacks,
    before it fetches the record and while the load plans): every connection's handshake
    is done before the first read, and the record and the ranges then open none."""
    (roots["holder"] / "s" / "quire.json").write_bytes(RAW)
    with link.PeerServer(roots["holder"], CREDS) as holder:
        copies = Link({1: holder.address})
        h = restore_reader.Holder(copies, 1)  # type: ignore[arg-type]
        r = restore_reader.RestoreReader(
            str(roots["mine"]),
            RAW,
            DOC,
            1,
            {1: [restore_reader.peer_provider(copies, 1, "s", DOC, 1, h)]},  # type: ignore[arg-type]
        )

        async def go() -> tuple[int, int, bytes, list[bytes]]:
            h.warm()
            h.warm()  # once per load: a second call opens nothing more
            assert h._warming is not None
            await h._warming
            ahead = h.connections
            rec = await h.record("s")
            got = await asyncio.gather(*(r.get(PACK1, i * 1000, i * 1000 + 500) for i in range(8)))
            return ahead, h.connections, rec, got

        ahead, after, rec, got = asyncio.run(go())
        r.close_peers()
        assert (ahead, after) == (restore_reader.PEER_STREAMS, restore_reader.PEER_STREAMS)
        assert rec == RAW
        assert got == [roots["one"][PACK1][i * 1000 : i * 1000 + 500] for i in range(8)]
        assert h._pool is not None and not h._pool._idle  # closed with the reader


def test_connections_that_open_after_their_holder_closed_are_not_kept(
    roots: dict[str, Any],
) -> None:
    with link.PeerServer(roots["holder"], CREDS) as holder:
        h = restore_reader.Holder(Link({1: holder.address}), 1)  # type: ignore[arg-type]

        async def go() -> None:
            h.warm()
            h.close()  # the load ended (or failed) before the handshakes did
            assert h._warming is not None
            await h._warming

        asyncio.run(go())
        assert h._pool is not None and not h._pool._idle
        assert h.connections == 1  # opened, then closed at once; the others not opened


def test_a_holder_that_cannot_be_reached_ahead_fails_no_read_of_another(
    roots: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Opening ahead is only a head start: a dead holder's failure there is logged at
    debug level, and the reads route to the next holder as ever."""
    caplog.set_level(logging.DEBUG, logger="quire")
    with link.PeerServer(roots["holder"], CREDS) as holder:
        r = reader(roots, holder, None)  # owner 1: the dead process 2 first, then 1
        dead = r.sources[1][0]
        assert isinstance(dead, restore_reader.Provider) and dead.name == "process 2"

        async def go() -> bytes:
            holder2 = dead.holder  # type: ignore[attr-defined]
            holder2.warm()
            await asyncio.wait([holder2._warming])
            return await r.get(PACK1, 7, 70)

        assert asyncio.run(go()) == roots["one"][PACK1][7:70]
        r.close_peers()
    assert "process 2: opening connections ahead" in caplog.text


def test_a_holder_that_does_not_answer_is_asked_for_one_connection_ahead() -> None:
    """The connections ahead open one, then the others: a holder that accepts and never
    answers (its TLS handshake runs out the deadline) keeps one I/O thread waiting, not
    ``PEER_STREAMS`` of them."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel accepts; nothing ever answers
        copies = Link({1: silent.getsockname()})
        copies.timeout = 0.5
        h = restore_reader.Holder(copies, 1)  # type: ignore[arg-type]

        async def go() -> None:
            h.warm()
            assert h._warming is not None
            await asyncio.wait([h._warming])

        asyncio.run(go())
        silent.setblocking(False)
        asked = 0
        while True:
            try:
                conn, _ = silent.accept()
            except BlockingIOError:
                break
            conn.close()
            asked += 1
        assert asked == 1
        assert h._warming is not None and isinstance(h._warming.exception(), PeerError)
        h.close()
