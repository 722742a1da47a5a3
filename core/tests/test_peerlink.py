"""The TLS peer transport in one process: a real ``PeerServer`` on 127.0.0.1 and its client.

Good fetches (one file, several over one connection, ranges, into buffers, into a file, one
of several MiB, concurrent clients, kept connections); every bad request refused, logged at
WARNING on the ``quire`` logger with the client's address and process, and nothing written
anywhere: ``..``, absolute paths, a symlink out of the root, a directory, a FIFO, an
oversize request, a file longer than asked for, a range past the end.  A peer that accepts
and never answers, or stalls mid-answer, fails within the deadline; an answer altered or cut
in transit is refused.  The attacks of issue 30 are in ``test_peerlink_attacks.py``.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from peer_helpers import (
    BIG,
    fake_peer,
    flip_at,
    key_value_store,
    make_tier,
    read_exact,
    relay,
    run_of,
    snapshot,
    tls_connect,
)

from quire._peers import files, link
from quire._peers.tls import Credentials, Identity
from quire._peers.wire import ANS, MAX_PATH_BYTES, REQ
from quire._runtime.collective import exchange, kv_exchange, ring_shift
from quire.errors import MultiProcessError, PeerError


@pytest.fixture(scope="module")
def creds() -> Credentials:
    return link.run_credentials("test/peers", 1.0)  # one JAX process: its own only


@pytest.fixture
def tier(tmp_path: Path) -> Path:
    return make_tier(tmp_path)


@pytest.fixture
def server(tier: Path, creds: Credentials) -> Iterator[link.PeerServer]:
    with link.PeerServer(tier, creds, idle_timeout=5.0) as s:
        yield s


def test_fetches_files_whole(server: link.PeerServer, tier: Path, creds: Credentials) -> None:
    me = creds.peer(0)
    big = (tier / "d" / "tx" / "p00000").read_bytes()
    assert link.fetch(server.address, "d/tx/p00000", me, 30, BIG) == big
    got = link.fetch_many(
        server.address, ["d/tx/idx.json", "empty", "inside_link", "d/tx/p00000"], me, 30, 1 << 30
    )
    assert got == [b'{"a": 1}', b"", b'{"a": 1}', big]
    assert server.address[0] == "127.0.0.1" and server.address[1] > 0


def test_speaks_tls_1_3_only_with_a_certificate_on_both_sides(
    server: link.PeerServer, creds: Credentials
) -> None:
    with tls_connect(server.address, creds) as s:
        assert s.version() == "TLSv1.3"
        assert s.getpeercert(binary_form=True) is not None
    for ctx in (creds.server_context, creds.client_context):
        assert ctx.minimum_version == ctx.maximum_version == ssl.TLSVersion.TLSv1_3
        assert ctx.verify_mode == ssl.CERT_REQUIRED


def test_listens_only_on_the_interface_given(tier: Path, creds: Credentials) -> None:
    with link.PeerServer(tier, creds) as s:
        sock = s._server.socket
        assert sock.getsockname()[0] == "127.0.0.1"
        assert sock.family == socket.AF_INET


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("../outside/secret.txt", "'..'"),
        ("d/../../outside/secret.txt", "'..'"),
        ("d/./tx/idx.json", "'..', '.'"),
        ("d//tx/idx.json", "empty"),
        ("d\\tx", "backslashes"),
        ("a\0b", "NUL"),
        ("/etc/passwd", "absolute path"),
        (str(Path(__file__).resolve()), "absolute path"),
        ("escape", "leaves the served directory"),
        ("escape_dir/secret.txt", "leaves the served directory"),
        ("d", "not a regular file"),
        ("fifo", "not a regular file"),
        ("d/tx/missing", "no such file"),
    ],
)
def test_refuses_paths_outside_or_not_files(
    server: link.PeerServer,
    tier: Path,
    creds: Credentials,
    caplog: pytest.LogCaptureFixture,
    path: str,
    reason: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    before = snapshot(tier.parent)
    t = time.monotonic()
    with pytest.raises(PeerError) as e:
        link.fetch(server.address, path, creds.peer(0), 10, 1 << 30)
    assert time.monotonic() - t < 5  # the FIFO never blocks the server
    msg = str(e.value)
    assert f"{server.address[0]}:{server.address[1]}" in msg and repr(path) in msg
    assert "refused" in msg and reason in msg and "another holder" in msg
    warned = [r for r in caplog.records if r.name == "quire" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and reason in warned[0].getMessage()
    assert "process 0 at 127.0.0.1:" in warned[0].getMessage()
    assert snapshot(tier.parent) == before
    # the connection of an authenticated client survives a refusal
    assert link.fetch_many(server.address, ["empty"], creds.peer(0), 10, 10) == [b""]


def test_file_longer_than_asked_is_refused(
    server: link.PeerServer, creds: Credentials, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    me = creds.peer(0)
    with pytest.raises(PeerError, match=f"file of {BIG} bytes, more than the {BIG - 1}"):
        link.fetch(server.address, "d/tx/p00000", me, 10, BIG - 1)
    assert f"more than the {BIG - 1} asked for" in caplog.text
    # fetch_many's bound is for all files together
    with pytest.raises(PeerError, match="more than the 1 asked for"):
        link.fetch_many(server.address, ["d/tx/idx.json", "d/tx/idx.json"], me, 10, 9)
    assert issubclass(PeerError, MultiProcessError)


def test_oversize_or_unknown_requests_are_refused_unread(
    server: link.PeerServer, creds: Credentials, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    for head in (REQ.pack(b"G", MAX_PATH_BYTES + 1, 10, 0, 0), REQ.pack(b"X", 1, 10, 0, 0)):
        with tls_connect(server.address, creds) as sock:
            sock.sendall(head)
            status, n = ANS.unpack(read_exact(sock, ANS.size))
            assert status == b"R"
            read_exact(sock, n)
            assert sock.recv(10) == b""  # and the server hung up
    assert "oversize request" in caplog.text and "unknown request" in caplog.text
    with pytest.raises(PeerError, match=f"at most {MAX_PATH_BYTES}"):
        link.fetch(server.address, "a" * (MAX_PATH_BYTES + 1), creds.peer(0), 5, 10)


def test_idle_connections_are_dropped(tier: Path, creds: Credentials) -> None:
    with link.PeerServer(tier, creds, idle_timeout=0.3, handshake_timeout=0.3) as s:
        silent = socket.create_connection(s.address, timeout=5)  # never says hello
        authed = tls_connect(s.address, creds)  # authenticated, then asks nothing
        t = time.monotonic()
        assert silent.recv(10) == b""
        assert authed.recv(10) == b""
        assert time.monotonic() - t < 3
        silent.close()
        authed.close()


# ---------------------------------------------------------------------- bad peers
def test_a_peer_that_never_answers_times_out(creds: Credentials) -> None:
    for where in fake_peer(lambda conn: None):  # accepts, says nothing
        t = time.monotonic()
        with pytest.raises(PeerError, match=r"no answer within the 0\.5s deadline") as e:
            link.fetch(where, "d/tx/p00000", creds.peer(0), 0.5, 100)
        assert time.monotonic() - t < 2
        assert f"{where[0]}:{where[1]}" in str(e.value) and "'d/tx/p00000'" in str(e.value)


def test_a_peer_that_stalls_mid_answer_times_out(
    server: link.PeerServer, creds: Credentials
) -> None:
    def stall(data: bytes, offset: int) -> bytes:
        if offset > 200_000:
            time.sleep(2)
        return data

    for where in relay(server.address, stall):
        t = time.monotonic()
        with pytest.raises(PeerError, match="no answer within"):
            link.fetch(where, "d/tx/p00000", creds.peer(0), 0.5, BIG)
        assert time.monotonic() - t < 2


def test_not_a_peer(creds: Credentials, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    for where in fake_peer(lambda conn: conn.sendall(b"HTTP/1.1 400 Bad Request\r\n" * 3)):
        with pytest.raises(PeerError, match=r"TLS 1\.3 handshake failed"):
            link.fetch(where, "f", creds.peer(0), 5, 10)
    assert "TLS 1.3 handshake failed" in caplog.text


def test_an_altered_answer_is_refused(
    server: link.PeerServer, creds: Credentials, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    for spot in (100_000, 2_500_000):  # a byte of the body's TLS records
        for where in relay(server.address, flip_at(spot)):
            with pytest.raises(PeerError, match="TLS record failed its check"):
                link.fetch(where, "d/tx/p00000", creds.peer(0), 10, BIG)
    where_s = f"peer {where[0]}:{where[1]} (process 0), file 'd/tx/p00000'"
    assert where_s in caplog.text
    for where in relay(server.address):  # the relay itself is harmless
        assert len(link.fetch(where, "d/tx/p00000", creds.peer(0), 10, BIG)) == BIG


def test_a_cut_answer_is_refused(
    server: link.PeerServer, creds: Credentials, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")

    def cut(data: bytes, offset: int) -> bytes | None:
        return None if offset > 200_000 else data

    for where in relay(server.address, cut):
        with pytest.raises(PeerError, match="short answer"):
            link.fetch(where, "d/tx/p00000", creds.peer(0), 10, BIG)
        assert "file 'd/tx/p00000': short answer" in caplog.text


def test_closed_server_is_unreachable(tier: Path, creds: Credentials) -> None:
    s = link.PeerServer(tier, creds)
    sock = tls_connect(s.address, creds)  # an open connection does not keep close() waiting
    t = time.monotonic()
    s.close()
    assert time.monotonic() - t < 3
    s.close()  # idempotent
    with pytest.raises(PeerError, match="cannot reach the peer"):
        link.fetch(s.address, "empty", creds.peer(0), 2, 10)
    sock.close()


def test_bad_arguments(tier: Path, creds: Credentials) -> None:
    with pytest.raises(TypeError, match="run_credentials"):
        link.PeerServer(tier, b"a secret" * 4)  # type: ignore[arg-type]
    with pytest.raises(NotADirectoryError):
        link.PeerServer(tier / "empty", creds)
    with pytest.raises(KeyError, match="process 3"):
        creds.peer(3)


def test_one_process() -> None:
    a, b = link.run_credentials("k", 1.0), link.run_credentials("k", 1.0)
    assert a.processes == b.processes == [0]
    assert a.peer(0).fingerprint != b.peer(0).fingerprint  # a fresh key each time
    assert ring_shift("k", b"abc", 1, 1.0) == b"abc"
    assert ring_shift("k", memoryview(b""), -3, 1.0) == b""


def test_fetch_to_writes_only_a_whole_file(
    server: link.PeerServer, tier: Path, tmp_path: Path, creds: Credentials
) -> None:
    me = creds.peer(0)
    mine = tmp_path / "mine"
    mine.mkdir()
    dest = mine / "p00000"
    big = (tier / "d" / "tx" / "p00000").read_bytes()
    assert link.fetch_to(server.address, "d/tx/p00000", me, 30, BIG, dest) == BIG
    assert dest.read_bytes() == big
    assert os.listdir(mine) == ["p00000"]
    # failures leave the destination as it was, and no partial file
    dest.write_bytes(b"old")
    with pytest.raises(PeerError, match="leaves the served directory"):
        link.fetch_to(server.address, "escape", me, 30, BIG, dest)
    for where in relay(server.address, flip_at(2_500_000, 0x80)):
        with pytest.raises(PeerError, match="TLS record failed its check"):
            link.fetch_to(where, "d/tx/p00000", me, 30, BIG, dest)
    assert dest.read_bytes() == b"old" and os.listdir(mine) == ["p00000"]
    # the caller's own file system failing is not the peer's fault
    with pytest.raises(FileNotFoundError):
        link.fetch_to(server.address, "empty", me, 30, 10, mine / "no" / "such")


def test_concurrent_clients_each_get_the_whole_file(
    server: link.PeerServer, tier: Path, creds: Credentials
) -> None:
    import concurrent.futures

    big = (tier / "d" / "tx" / "p00000").read_bytes()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(
            pool.map(
                lambda _: link.fetch(server.address, "d/tx/p00000", creds.peer(0), 60, BIG),
                range(6),
            )
        )
    assert len(got) == 6 and all(g == big for g in got)


def test_ring_shift_counts_bytes_of_any_buffer() -> None:
    import numpy as np

    floats = np.arange(5, dtype=np.float64)
    assert ring_shift("k", memoryview(floats), 1, 1.0) == floats.tobytes()


def test_a_link_to_the_root_itself_is_not_a_file(
    server: link.PeerServer, tier: Path, creds: Credentials
) -> None:
    (tier / "self").symlink_to(tier)
    with pytest.raises(PeerError, match="not a regular file"):
        link.fetch(server.address, "self", creds.peer(0), 5, 10)
    # and through it, files inside the root are served as themselves
    assert link.fetch(server.address, "self/empty", creds.peer(0), 5, 10) == b""


def test_fetches_byte_ranges_and_counts_what_it_served(
    server: link.PeerServer, tier: Path, creds: Credentials
) -> None:
    me = creds.peer(0)
    big = (tier / "d" / "tx" / "p00000").read_bytes()
    a, b = 1_000_000, 2_500_001  # across the server's 1 MiB blocks
    assert link.fetch(server.address, "d/tx/p00000", me, 30, b - a, a, b) == big[a:b]
    got = link.fetch_many(
        server.address,
        ["d/tx/p00000", "d/tx/idx.json", "d/tx/p00000", "empty"],
        me,
        30,
        1 << 30,
        [(BIG - 7, BIG), None, (5, 5), (0, 0)],
    )
    assert got == [big[-7:], b'{"a": 1}', b"", b""]
    assert server.served == (b - a) + 7 + 8 and server.requests == 5
    # a range may be longer than the file's own limit allows only up to max_bytes
    assert link.fetch(server.address, "d/tx/p00000", me, 30, 10, 0, 10) == big[:10]


def test_ranges_past_the_end_reversed_or_longer_than_asked_are_refused(
    server: link.PeerServer, tier: Path, creds: Credentials, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    me = creds.peer(0)
    before = snapshot(tier.parent)
    with pytest.raises(PeerError, match=f"range ends at byte {BIG + 1}, past the end"):
        link.fetch(server.address, "d/tx/p00000", me, 10, 100, BIG - 1, BIG + 1)
    with pytest.raises(PeerError, match="longer than the 9 bytes asked for"):
        link.fetch(server.address, "d/tx/p00000", me, 10, 9, 0, 10)
    with pytest.raises(PeerError, match="no such file"):
        link.fetch(server.address, "d/tx/nope", me, 10, 9, 0, 1)
    with pytest.raises(PeerError, match=r"with '\.\.'"):
        link.fetch(server.address, "d/../../outside/secret.txt", me, 10, 9, 0, 1)
    with pytest.raises(ValueError, match="both start and end"):
        link.fetch(server.address, "d/tx/p00000", me, 10, 9, 0)
    with pytest.raises(ValueError, match="bad range"):
        link.fetch(server.address, "d/tx/p00000", me, 10, 9, 5, 4)
    assert caplog.text.count("refused") >= 4 and "past the end" in caplog.text
    assert snapshot(tier.parent) == before and server.served == 0


def test_arguments_a_request_cannot_carry_are_refused_before_connecting(
    server: link.PeerServer, tier: Path, creds: Credentials
) -> None:
    """Numbers past the request's u64 fields, a negative start or limit, a path that is not
    UTF-8: the caller's own mistakes, a ``ValueError`` before any connection (not a struct or
    codec error from inside the conversation, after a handshake); a path longer than peers
    serve: the ``PeerError`` of a refusal (the caller reads another holder), also before
    connecting."""
    me, u64, buf = creds.peer(0), 2**64, [memoryview(bytearray(4))]
    dest = tier.parent / "dest"
    bad: list[tuple[str, Any]] = [
        ("max_bytes", lambda a, t: link.fetch(a, "d/tx/idx.json", me, t, u64)),
        ("max_bytes", lambda a, t: link.fetch(a, "d/tx/idx.json", me, t, -1)),
        ("max_bytes", lambda a, t: link.fetch_to(a, "d/tx/idx.json", me, t, u64, dest)),
        ("bad range", lambda a, t: link.fetch(a, "d/tx/idx.json", me, t, 10, 0, u64)),
        ("bad range", lambda a, t: link.fetch(a, "d/tx/idx.json", me, t, 10, -1, 3)),
        ("bad range", lambda a, t: link.fetch_many(a, ["d/tx/p00000"], me, t, 1, [(u64, u64)])),
        ("bad range", lambda a, t: link.fetch_into(a, "d/tx/idx.json", me, t, buf, -1)),
        ("bad range", lambda a, t: link.fetch_into(a, "d/tx/idx.json", me, t, buf, u64 - 2)),
        ("UTF-8", lambda a, t: link.fetch(a, "d/\ud800", me, t, 100)),
        ("UTF-8", lambda a, t: link.fetch_many(a, ["d/tx/idx.json", "d/\udcff"], me, t, 100)),
        ("UTF-8", lambda a, t: link.fetch_into(a, "d/\ud800", me, t, buf, 0)),
        ("UTF-8", lambda a, t: link.fetch_to(a, "d/\ud800", me, t, 100, dest)),
    ]
    long = "d/" + "a" * MAX_PATH_BYTES
    for what, call in bad:
        with pytest.raises(ValueError, match=what) as e:
            call(server.address, 5)
        assert type(e.value) is ValueError, e.value
    with pytest.raises(PeerError, match=f"at most {MAX_PATH_BYTES}") as p:
        link.fetch_many(server.address, ["d/tx/idx.json", long], me, 5, 100)
    assert f"{long!r}" in str(p.value) and "(process 0)" in str(p.value)
    with socket.socket() as silent:  # where nothing answers: every call fails before it
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        for _, call in bad:
            with pytest.raises(ValueError):
                call(silent.getsockname(), 0.2)
        with pytest.raises(PeerError, match=f"at most {MAX_PATH_BYTES}"):
            link.fetch(silent.getsockname(), long, me, 0.2, 100)
        silent.setblocking(False)
        with pytest.raises(BlockingIOError):
            silent.accept()  # nobody connected
    assert not dest.exists() and server.requests == 0


def test_fetch_into_fills_the_callers_buffers(
    server: link.PeerServer, tier: Path, creds: Credentials
) -> None:
    me = creds.peer(0)
    big = (tier / "d" / "tx" / "p00000").read_bytes()
    a, b = bytearray(1_500_000), bytearray(700_001)  # across the server's 1 MiB blocks
    n = link.fetch_into(
        server.address, "d/tx/p00000", me, 30, [memoryview(a), memoryview(b)], 12_345
    )
    assert n == len(a) + len(b) and bytes(a + b) == big[12_345 : 12_345 + n]
    with pytest.raises(PeerError, match="past the end"):
        link.fetch_into(server.address, "d/tx/p00000", me, 30, [memoryview(a)], BIG)
    for where in relay(server.address, flip_at(1000)):
        with pytest.raises(PeerError, match="TLS"):
            link.fetch_into(where, "d/tx/p00000", me, 30, [memoryview(a)], 0)


def test_a_pool_keeps_connections_and_replaces_dropped_ones(tier: Path, creds: Credentials) -> None:
    me = creds.peer(0)
    big = (tier / "d" / "tx" / "p00000").read_bytes()
    with (
        link.PeerServer(tier, creds, idle_timeout=0.3) as s,
        link.Pool(s.address, me, 2) as pool,
    ):
        for i in range(3):
            got = link.fetch(s.address, "d/tx/p00000", me, 5, 10, i, i + 10, pool=pool)
            assert got == big[i : i + 10]
        assert pool.connections == 1
        time.sleep(0.8)  # the server drops the idle connection
        assert link.fetch(s.address, "empty", me, 5, 10, 0, 0, pool=pool) == b""
        assert pool.connections == 2
        with pytest.raises(ValueError, match="a pool of process 0 used for process 1"):
            other = link.Pinned(1, me.fingerprint, me.context)
            link.fetch(s.address, "empty", other, 5, 10, pool=pool)


def test_links_inside_the_root_are_followed_by_the_walk_and_others_refused(
    server: link.PeerServer, tier: Path, creds: Credentials
) -> None:
    """The server walks each path itself from the root (``LocalFiles``): relative and
    absolute links that stay inside are followed, even through each other; a link whose
    target climbs above the root (even to come back), one to another tree, a loop and a
    chain of more than ``MAX_LINKS`` are refused."""
    me = creds.peer(0)
    (tier / "d" / "rel").symlink_to("tx/idx.json")  # relative, from d/
    (tier / "d" / "up").symlink_to("..")  # d/up is the root
    (tier / "d" / "tx" / "hop").symlink_to("../rel")  # a link to a link
    (tier / "abs_dir").symlink_to(tier / "d" / "tx")  # absolute, inside
    (tier / "out_and_back").symlink_to("../tier/empty")  # above the root, then back
    (tier / "loop").symlink_to("loop")
    (tier / "chain0").symlink_to("empty")
    for i in range(1, files.MAX_LINKS + 1):
        (tier / f"chain{i}").symlink_to(f"chain{i - 1}")
    got = link.fetch_many(
        server.address,
        ["d/rel", "d/up/empty", "d/tx/hop", "abs_dir/idx.json", "d/up/d/up/abs_dir/hop"],
        me,
        10,
        100,
    )
    assert got == [b'{"a": 1}', b"", b'{"a": 1}', b'{"a": 1}', b'{"a": 1}']
    assert link.fetch(server.address, f"chain{files.MAX_LINKS - 1}", me, 10, 10) == b""
    for path, reason in [
        ("out_and_back", "leaves the served directory"),
        ("d/up/escape_dir/secret.txt", "leaves the served directory"),
        ("loop", f"more than {files.MAX_LINKS} symbolic links"),
        (f"chain{files.MAX_LINKS}", f"more than {files.MAX_LINKS} symbolic links"),
        ("empty/x", "no such file"),
    ]:
        with pytest.raises(PeerError, match=reason):
            link.fetch(server.address, path, me, 10, 100)


def test_a_root_given_through_a_link_serves_absolute_links_written_either_way(
    tmp_path: Path, creds: Credentials
) -> None:
    real = make_tier(tmp_path / "real")
    (tmp_path / "via").symlink_to(real)
    given = tmp_path / "via"
    (real / "by_given").symlink_to(given / "d" / "tx" / "idx.json")
    (real / "by_real").symlink_to(real / "d" / "tx" / "idx.json")
    with link.PeerServer(given, creds) as s:
        assert s.root == str(real)
        got = link.fetch_many(s.address, ["by_given", "by_real"], creds.peer(0), 10, 100)
    assert got == [b'{"a": 1}', b'{"a": 1}']


def test_the_server_closes_the_root_it_opened_and_only_that(tier: Path, creds: Credentials) -> None:
    with link.PeerServer(tier, creds) as s:
        fd = s.files._fd  # type: ignore[attr-defined]
        assert fd is not None and os.path.samestat(os.fstat(fd), os.stat(tier))
    assert s.files._fd is None  # type: ignore[attr-defined]
    mine = files.LocalFiles(tier)  # a Files handed to the server stays the caller's
    with link.PeerServer(mine, creds):
        pass
    f, size = mine.open(["empty"])
    f.close()
    mine.close()
    assert size == 0


# ---------------------------------------------------------------------- published addresses
@pytest.fixture
def kv(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from key_value_store(monkeypatch)


@pytest.mark.parametrize(
    "value",
    [
        "not json",
        "",
        "null",
        '["h"]',
        '{"host": "127.0.0.1", "port": 80}',
        '["h", "x"]',
        '["127.0.0.1", "80"]',
        '["127.0.0.1", 0]',
        '["127.0.0.1", 65536]',
        '["127.0.0.1", -1]',
        '["127.0.0.1", true]',
        '["127.0.0.1", 80.0]',
        '["127.0.0.1", 80, 1]',
        "[1, 80]",
        '["", 80]',
        '["example.com", 80]',  # a name would be resolved outside the call's deadline
        '["127.0.0.1\\u0000", 80]',
        f'["{"1" * 300}", 80]',
        "[" * 5000 + "]" * 5000,
    ],
)
def test_a_malformed_published_address_is_a_peer_error(kv: Any, value: str) -> None:
    kv.key_value_set("addr/3", value)
    with pytest.raises(PeerError, match="process 3 published a malformed peer address") as e:
        link.lookup_address("addr", 3, 1.0)
    assert "'addr'" in str(e.value) and "treat it as lost" in str(e.value)


def test_published_addresses_round_trip(kv: Any) -> None:
    link.publish_address("addr", ("127.0.0.1", 8080))  # as process 0
    kv.key_value_set("addr/1", '["::1", 65535]')
    assert link.lookup_address("addr", 0, 1.0) == ("127.0.0.1", 8080)
    assert link.lookup_address("addr", 1, 1.0) == ("::1", 65535)
    with pytest.raises(MultiProcessError, match=r"waited 0\.1s for process 2"):
        link.lookup_address("addr", 2, 0.1)
    with pytest.raises(ValueError, match="not an IP address"):
        link.publish_address("addr2", ("localhost", 80))


@pytest.mark.parametrize(
    "value",
    [
        "not a certificate",
        "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        "x" * (link.MAX_CERTIFICATE_CHARS + 1),
    ],
)
def test_a_malformed_published_certificate_is_a_peer_error(
    kv: Any, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setattr(link.jax, "process_count", lambda: 2)  # process 1: published below
    kv.key_value_set("cert/1", value)
    with pytest.raises(PeerError, match="process 1 published a malformed peer certificate"):
        link.run_credentials("cert", 1.0)
    # a well-formed one is pinned
    _, certs = run_of(2)
    kv.key_value_set("good/1", certs[1].decode())
    assert link.run_credentials("good", 1.0).processes == [0, 1]


def test_each_published_certificate_is_trusted_as_itself_or_refused_naming_its_process(
    kv: Any, monkeypatch: pytest.MonkeyPatch, tier: Path
) -> None:
    """A certificate published without its final newline passes the check and is pinned and
    trusted as that certificate, and so is the next one (joined into one PEM text, it
    spoiled it: ssl.SSLError); one followed by a character that is not ASCII is a
    ``PeerError`` naming the process (it was a TypeError from ``ssl``)."""
    monkeypatch.setattr(link.jax, "process_count", lambda: 3)  # 1 and 2: published below
    ids = {j: Identity.ephemeral(j) for j in (1, 2)}
    kv.key_value_set("bare/1", ids[1].cert_pem.decode().rstrip("\n"))
    kv.key_value_set("bare/2", ids[2].cert_pem.decode())
    got = link.run_credentials("bare", 1.0)  # process 0, in this process
    assert got.processes == [0, 1, 2]
    certs = {j: i.cert_pem for j, i in ids.items()}
    certs[0] = kv.key_value_try_get("bare/0").encode()
    others = {j: i.trust(certs) for j, i in ids.items()}
    with link.PeerServer(tier, got) as mine:  # process 0 trusts 1 and 2 as clients ...
        for j, creds in others.items():
            assert link.fetch(mine.address, "d/tx/idx.json", creds.peer(0), 5, 8) == b'{"a": 1}'
            with link.PeerServer(tier, creds) as theirs:  # ... and as servers
                got_back = link.fetch(theirs.address, "d/tx/idx.json", got.peer(j), 5, 8)
                assert got_back == b'{"a": 1}'
    kv.key_value_set("accent/1", certs[1].decode() + "\u00e9")
    kv.key_value_set("accent/2", certs[2].decode())
    with pytest.raises(PeerError, match="process 1 published a malformed peer certificate"):
        link.run_credentials("accent", 1.0)


@pytest.mark.parametrize("value", ["not base64!", "abc", "QUJD\u00e9"])
def test_a_malformed_payload_of_a_key_value_exchange_is_a_multi_process_error(
    kv: Any, value: str
) -> None:
    kv.key_value_set("x/1", value)  # process 1's payload
    with pytest.raises(MultiProcessError, match="process 1 published a malformed payload"):
        kv_exchange("x", [0, 1], b"mine", 1.0, "url", "agreeing")
    kv.key_value_set("y/1", "QUJD")
    assert kv_exchange("y", [0, 1], b"mine", 1.0, "url", "agreeing") == [b"mine", b"ABC"]


@pytest.mark.parametrize("value", ["x", "-5", "1e3", "9" * 30, ""])
def test_a_malformed_length_at_an_exchange_barrier_is_a_multi_process_error(
    kv: Any, value: str
) -> None:
    kv.key_value_set("x/1", value)
    with pytest.raises(MultiProcessError, match="process 1 published the malformed length"):
        exchange("x", [0, 1], b"mine", 1.0, "url")
