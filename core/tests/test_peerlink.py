"""The TCP peer transport in one process: a real ``PeerServer`` on 127.0.0.1 and its client.

Good fetches (one file, several over one connection, one of several MiB); everything
hostile refused, logged at WARNING on the ``quire`` logger with the client's address, and
nothing written anywhere: a wrong secret, a replayed request (on another connection and
on the same one), ``..``, absolute paths, a symlink out of the root, a directory, a FIFO,
an oversize request, a file longer than asked for, an answer altered or cut in transit.
A peer that accepts and never answers, or stalls mid-answer, fails within the deadline.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from quire._runtime import peerlink
from quire._runtime.collective import ring_shift
from quire._runtime.peerwire import MAGIC, MAX_PATH_BYTES, NONCE, REQ, mac, recv
from quire.errors import MultiProcessError, PeerError

SECRET = bytes(range(32))
BIG = 3 * (1 << 20) + 12345  # several of the server's 1 MiB blocks, not a multiple


def snapshot(top: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``top``: (mode, size, mtime_ns), links not followed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, top)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture
def tier(tmp_path: Path) -> Path:
    root = tmp_path / "tier"
    (root / "d" / "tx").mkdir(parents=True)
    (root / "d" / "tx" / "p00000").write_bytes(os.urandom(BIG))
    (root / "d" / "tx" / "idx.json").write_bytes(b'{"a": 1}')
    (root / "empty").write_bytes(b"")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_bytes(b"not for peers")
    (root / "escape").symlink_to(tmp_path / "outside" / "secret.txt")
    (root / "escape_dir").symlink_to(tmp_path / "outside")
    (root / "inside_link").symlink_to(root / "d" / "tx" / "idx.json")
    os.mkfifo(root / "fifo")
    return root


@pytest.fixture
def server(tier: Path) -> Iterator[peerlink.PeerServer]:
    with peerlink.PeerServer(tier, SECRET, idle_timeout=5.0) as s:
        yield s


def test_fetches_files_whole(server: peerlink.PeerServer, tier: Path) -> None:
    big = (tier / "d" / "tx" / "p00000").read_bytes()
    assert peerlink.fetch(server.address, "d/tx/p00000", SECRET, 30, BIG) == big
    got = peerlink.fetch_many(
        server.address,
        ["d/tx/idx.json", "empty", "inside_link", "d/tx/p00000"],
        SECRET,
        30,
        1 << 30,
    )
    assert got == [b'{"a": 1}', b"", b'{"a": 1}', big]
    assert server.address[0] == "127.0.0.1" and server.address[1] > 0


def test_listens_only_on_the_interface_given(tier: Path) -> None:
    with peerlink.PeerServer(tier, SECRET) as s:
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
    server: peerlink.PeerServer,
    tier: Path,
    caplog: pytest.LogCaptureFixture,
    path: str,
    reason: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    before = snapshot(tier.parent)
    t = time.monotonic()
    with pytest.raises(PeerError) as e:
        peerlink.fetch(server.address, path, SECRET, 10, 1 << 30)
    assert time.monotonic() - t < 5  # the FIFO never blocks the server
    msg = str(e.value)
    assert f"{server.address[0]}:{server.address[1]}" in msg and repr(path) in msg
    assert "refused" in msg and reason in msg and "another holder" in msg
    warned = [r for r in caplog.records if r.name == "quire" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and reason in warned[0].getMessage()
    assert "127.0.0.1:" in warned[0].getMessage()
    assert snapshot(tier.parent) == before
    # the connection of an authenticated client survives a refusal
    assert peerlink.fetch_many(server.address, ["empty"], SECRET, 10, 10) == [b""]


def test_wrong_secret_is_refused_and_logged(
    server: peerlink.PeerServer, tier: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    before = snapshot(tier.parent)
    with pytest.raises(PeerError, match="different secrets") as e:
        peerlink.fetch(server.address, "d/tx/idx.json", b"x" * 32, 10, 100)
    assert "'d/tx/idx.json'" in str(e.value)
    assert "bad MAC" in caplog.text and "d/tx/idx.json" in caplog.text
    assert snapshot(tier.parent) == before
    assert issubclass(PeerError, MultiProcessError)


def test_file_longer_than_asked_is_refused(
    server: peerlink.PeerServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    with pytest.raises(PeerError, match=f"file of {BIG} bytes, more than the {BIG - 1}"):
        peerlink.fetch(server.address, "d/tx/p00000", SECRET, 10, BIG - 1)
    assert f"more than the {BIG - 1} asked for" in caplog.text
    # fetch_many's bound is for all files together
    with pytest.raises(PeerError, match="more than the 1 asked for"):
        peerlink.fetch_many(server.address, ["d/tx/idx.json", "d/tx/idx.json"], SECRET, 10, 9)


# ---------------------------------------------------------------------- raw clients
def raw_connect(server: peerlink.PeerServer) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(server.address, timeout=5)
    hello = recv(sock, len(MAGIC) + NONCE)
    assert hello[: len(MAGIC)] == MAGIC
    return sock, hello[len(MAGIC) :]


def request(nonce: bytes, seq: int, path: str, limit: int = 1 << 20) -> bytes:
    raw = path.encode()
    head = REQ.pack(b"G", len(raw), limit)
    return head + raw + mac(SECRET, b"req", nonce, seq, head, raw).digest()


def answer_status(sock: socket.socket) -> bytes:
    return recv(sock, 1)


def test_replayed_requests_are_refused(
    server: peerlink.PeerServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    a, nonce = raw_connect(server)
    req = request(nonce, 0, "d/tx/idx.json")
    a.sendall(req)
    assert answer_status(a) == b"O"  # the genuine request is served
    a.close()
    # the same bytes on a new connection (another nonce): refused, connection dropped
    b, _ = raw_connect(server)
    b.sendall(req)
    assert answer_status(b) == b"R"
    b.settimeout(5)
    rest = b.recv(1 << 16)
    while chunk := b.recv(1 << 16):
        rest += chunk
    assert b"bad MAC" in rest
    b.close()
    # again on the same connection (its sequence number has moved on): refused
    c, nonce = raw_connect(server)
    c.sendall(request(nonce, 0, "empty"))
    assert answer_status(c) == b"O"
    recv(c, 8 + 32)
    c.sendall(request(nonce, 0, "empty"))
    assert answer_status(c) == b"R"
    c.close()
    assert caplog.text.count("bad MAC") == 2


def test_oversize_request_is_refused_unread(
    server: peerlink.PeerServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    sock, _ = raw_connect(server)
    sock.sendall(REQ.pack(b"G", MAX_PATH_BYTES + 1, 10))
    assert answer_status(sock) == b"R"
    assert "oversize request" in caplog.text
    sock.close()
    with pytest.raises(PeerError, match=f"at most {MAX_PATH_BYTES}"):
        peerlink.fetch(server.address, "a" * (MAX_PATH_BYTES + 1), SECRET, 5, 10)


def test_a_silent_client_is_dropped(tier: Path) -> None:
    with peerlink.PeerServer(tier, SECRET, idle_timeout=0.3) as s:
        sock, _ = raw_connect(s)
        t = time.monotonic()
        sock.settimeout(5)
        assert sock.recv(10) == b""  # the server hung up
        assert time.monotonic() - t < 3
        sock.close()


# ---------------------------------------------------------------------- bad peers
def fake_peer(behave: Callable[[socket.socket], None]) -> Iterator[tuple[str, int]]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    conns: list[socket.socket] = []

    def run() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conns.append(conn)
            behave(conn)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    yield listener.getsockname()
    listener.close()
    for c in conns:
        c.close()


def test_a_peer_that_never_answers_times_out() -> None:
    for where in fake_peer(lambda conn: None):  # accepts, says nothing
        t = time.monotonic()
        with pytest.raises(PeerError, match=r"no answer within the 0\.5s deadline") as e:
            peerlink.fetch(where, "d/tx/p00000", SECRET, 0.5, 100)
        assert time.monotonic() - t < 2
        assert f"{where[0]}:{where[1]}" in str(e.value) and "'d/tx/p00000'" in str(e.value)


def test_a_peer_that_stalls_mid_answer_times_out() -> None:
    def behave(conn: socket.socket) -> None:
        conn.sendall(MAGIC + bytes(NONCE))
        conn.recv(1 << 16)
        conn.sendall(b"O" + (1000).to_bytes(8, "big") + b"x" * 10)

    for where in fake_peer(behave):
        t = time.monotonic()
        with pytest.raises(PeerError, match="no answer within"):
            peerlink.fetch(where, "f", SECRET, 0.5, 10_000)
        assert time.monotonic() - t < 2


def test_not_a_peer() -> None:
    for where in fake_peer(lambda conn: conn.sendall(b"HTTP/1.1 400 Bad Request\r\n" * 3)):
        with pytest.raises(PeerError, match="not a quire peer"):
            peerlink.fetch(where, "f", SECRET, 5, 10)


def relay(
    server: peerlink.PeerServer, damage: Callable[[bytes, int], bytes | None]
) -> Iterator[tuple[str, int]]:
    """A man in the middle: forwards both ways, passing the server's bytes through
    ``damage(chunk, offset)`` (None: hang up)."""

    def behave(conn: socket.socket) -> None:
        up = socket.create_connection(server.address)

        def client_to_server() -> None:
            while data := conn.recv(1 << 16):
                up.sendall(data)

        threading.Thread(target=client_to_server, daemon=True).start()
        offset = 0
        while data := up.recv(1 << 16):
            out = damage(data, offset)
            if out is None:
                conn.shutdown(socket.SHUT_RDWR)
                return
            conn.sendall(out)
            offset += len(data)

    threading_behave = lambda conn: threading.Thread(  # noqa: E731
        target=behave, args=(conn,), daemon=True
    ).start()
    return fake_peer(threading_behave)


def flip_at(spot: int, mask: int = 1) -> Callable[[bytes, int], bytes]:
    """A ``relay`` damage that XORs ``mask`` into the byte at stream offset ``spot``."""

    def flip(data: bytes, offset: int) -> bytes:
        if offset <= spot < offset + len(data):
            b = bytearray(data)
            b[spot - offset] ^= mask
            return bytes(b)
        return data

    return flip


def test_an_altered_answer_is_refused(
    server: peerlink.PeerServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    flip = flip_at(len(MAGIC) + NONCE + 9 + 100_000)  # a byte of the body

    for where in relay(server, flip):
        with pytest.raises(PeerError, match="does not authenticate"):
            peerlink.fetch(where, "d/tx/p00000", SECRET, 10, BIG)
        assert f"peer {where[0]}:{where[1]}: refused its answer for 'd/tx/p00000'" in caplog.text
    for where in relay(server, lambda data, offset: data):  # the relay itself is harmless
        assert len(peerlink.fetch(where, "d/tx/p00000", SECRET, 10, BIG)) == BIG


def test_a_cut_answer_is_refused(
    server: peerlink.PeerServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")

    def cut(data: bytes, offset: int) -> bytes | None:
        return None if offset > 200_000 else data

    for where in relay(server, cut):
        with pytest.raises(PeerError, match="short answer"):
            peerlink.fetch(where, "d/tx/p00000", SECRET, 10, BIG)
        assert "refused its answer for 'd/tx/p00000': short answer" in caplog.text


def test_closed_server_is_unreachable(tier: Path) -> None:
    s = peerlink.PeerServer(tier, SECRET)
    sock, _ = raw_connect(s)  # an open connection does not keep close() waiting
    t = time.monotonic()
    s.close()
    assert time.monotonic() - t < 3
    s.close()  # idempotent
    with pytest.raises(PeerError, match="cannot reach the peer"):
        peerlink.fetch(s.address, "empty", SECRET, 2, 10)
    sock.close()


def test_bad_arguments(tier: Path) -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        peerlink.PeerServer(tier, b"short")
    with pytest.raises(NotADirectoryError):
        peerlink.PeerServer(tier / "empty", SECRET)


def test_one_process() -> None:
    a, b = peerlink.run_secret("k", 1.0), peerlink.run_secret("k", 1.0)
    assert len(a) == len(b) == 32 and a != b
    assert ring_shift("k", b"abc", 1, 1.0) == b"abc"
    assert ring_shift("k", memoryview(b""), -3, 1.0) == b""


def test_fetch_to_writes_only_an_authenticated_whole_file(
    server: peerlink.PeerServer, tier: Path, tmp_path: Path
) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    dest = mine / "p00000"
    big = (tier / "d" / "tx" / "p00000").read_bytes()
    assert peerlink.fetch_to(server.address, "d/tx/p00000", SECRET, 30, BIG, dest) == BIG
    assert dest.read_bytes() == big
    assert os.listdir(mine) == ["p00000"]
    # failures leave the destination as it was, and no partial file
    dest.write_bytes(b"old")
    with pytest.raises(PeerError, match="different secrets"):
        peerlink.fetch_to(server.address, "d/tx/p00000", b"y" * 32, 30, BIG, dest)
    with pytest.raises(PeerError, match="leaves the served directory"):
        peerlink.fetch_to(server.address, "escape", SECRET, 30, BIG, dest)
    flip = flip_at(len(MAGIC) + NONCE + 9 + 2_500_000, 0x80)

    for where in relay(server, flip):
        with pytest.raises(PeerError, match="does not authenticate"):
            peerlink.fetch_to(where, "d/tx/p00000", SECRET, 30, BIG, dest)
    assert dest.read_bytes() == b"old" and os.listdir(mine) == ["p00000"]
    # the caller's own file system failing is not the peer's fault
    with pytest.raises(FileNotFoundError):
        peerlink.fetch_to(server.address, "empty", SECRET, 30, 10, mine / "no" / "such")


def test_concurrent_clients_each_get_the_whole_file(
    server: peerlink.PeerServer, tier: Path
) -> None:
    big = (tier / "d" / "tx" / "p00000").read_bytes()
    got: list[bytes] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            got.append(peerlink.fetch(server.address, "d/tx/p00000", SECRET, 60, BIG))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(got) == 6 and all(g == big for g in got)


def test_connections_over_the_cap_are_dropped_and_logged(
    tier: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    with peerlink.PeerServer(tier, SECRET, max_connections=1) as s:
        held, _ = raw_connect(s)  # takes the only slot
        with pytest.raises(PeerError, match="short answer"):
            peerlink.fetch(s.address, "empty", SECRET, 5, 10)
        assert "too many connections" in caplog.text
        held.close()
        deadline = time.monotonic() + 5
        while True:  # the slot comes back once the server sees the hang-up
            try:
                assert peerlink.fetch(s.address, "empty", SECRET, 5, 10) == b""
                break
            except PeerError:
                assert time.monotonic() < deadline
                time.sleep(0.05)


def test_ring_shift_counts_bytes_of_any_buffer() -> None:
    import numpy as np

    floats = np.arange(5, dtype=np.float64)
    assert ring_shift("k", memoryview(floats), 1, 1.0) == floats.tobytes()


def test_a_link_to_the_root_itself_is_not_a_file(server: peerlink.PeerServer, tier: Path) -> None:
    (tier / "self").symlink_to(tier)
    with pytest.raises(PeerError, match="not a regular file"):
        peerlink.fetch(server.address, "self", SECRET, 5, 10)
    # and through it, files inside the root are served as themselves
    assert peerlink.fetch(server.address, "self/empty", SECRET, 5, 10) == b""


def test_fetches_byte_ranges_and_counts_what_it_served(
    server: peerlink.PeerServer, tier: Path
) -> None:
    big = (tier / "d" / "tx" / "p00000").read_bytes()
    a, b = 1_000_000, 2_500_001  # across the server's 1 MiB blocks
    assert peerlink.fetch(server.address, "d/tx/p00000", SECRET, 30, b - a, a, b) == big[a:b]
    got = peerlink.fetch_many(
        server.address,
        ["d/tx/p00000", "d/tx/idx.json", "d/tx/p00000", "empty"],
        SECRET,
        30,
        1 << 30,
        [(BIG - 7, BIG), None, (5, 5), (0, 0)],
    )
    assert got == [big[-7:], b'{"a": 1}', b"", b""]
    assert server.served == (b - a) + 7 + 8 and server.requests == 5
    # a range may be longer than the file's own limit allows only up to max_bytes
    assert peerlink.fetch(server.address, "d/tx/p00000", SECRET, 30, 10, 0, 10) == big[:10]


def test_ranges_past_the_end_reversed_or_longer_than_asked_are_refused(
    server: peerlink.PeerServer, tier: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    before = snapshot(tier.parent)
    with pytest.raises(PeerError, match=f"range ends at byte {BIG + 1}, past the end"):
        peerlink.fetch(server.address, "d/tx/p00000", SECRET, 10, 100, BIG - 1, BIG + 1)
    with pytest.raises(PeerError, match="longer than the 9 bytes asked for"):
        peerlink.fetch(server.address, "d/tx/p00000", SECRET, 10, 9, 0, 10)
    with pytest.raises(PeerError, match="no such file"):
        peerlink.fetch(server.address, "d/tx/nope", SECRET, 10, 9, 0, 1)
    with pytest.raises(PeerError, match=r"with '\.\.'"):
        peerlink.fetch(server.address, "d/../../outside/secret.txt", SECRET, 10, 9, 0, 1)
    with pytest.raises(PeerError, match="different secrets"):
        peerlink.fetch(server.address, "d/tx/p00000", b"y" * 32, 10, 9, 0, 1)
    with pytest.raises(ValueError, match="both start and end"):
        peerlink.fetch(server.address, "d/tx/p00000", SECRET, 10, 9, 0)
    with pytest.raises(ValueError, match="bad range"):
        peerlink.fetch(server.address, "d/tx/p00000", SECRET, 10, 9, 5, 4)
    assert caplog.text.count("refused") >= 5 and "past the end" in caplog.text
    assert snapshot(tier.parent) == before and server.served == 0


def test_an_altered_range_answer_is_refused(
    server: peerlink.PeerServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    flip = flip_at(len(MAGIC) + NONCE + 9 + 1000)

    for where in relay(server, flip):
        with pytest.raises(PeerError, match="does not authenticate"):
            peerlink.fetch(where, "d/tx/p00000", SECRET, 10, 1 << 20, 0, 1 << 20)


def test_fetch_into_fills_the_callers_buffers(server: peerlink.PeerServer, tier: Path) -> None:
    big = (tier / "d" / "tx" / "p00000").read_bytes()
    a, b = bytearray(1_500_000), bytearray(700_001)  # across the server's 1 MiB blocks
    n = peerlink.fetch_into(
        server.address, "d/tx/p00000", SECRET, 30, [memoryview(a), memoryview(b)], 12_345
    )
    assert n == len(a) + len(b) and bytes(a + b) == big[12_345 : 12_345 + n]
    with pytest.raises(PeerError, match="past the end"):
        peerlink.fetch_into(server.address, "d/tx/p00000", SECRET, 30, [memoryview(a)], BIG)
    with pytest.raises(PeerError, match="different secrets"):
        peerlink.fetch_into(server.address, "d/tx/p00000", b"z" * 32, 30, [memoryview(a)], 0)


# ---------------------------------------------------------------------- fast bodies
def test_fast_bodies_bind_the_secret_the_request_and_the_connection(
    server: peerlink.PeerServer, tier: Path
) -> None:
    """A ``g`` request's answer: its tag is HMAC over the request, the header and the
    body's Poly1305 tag under a one-time key; another secret, sequence number or body
    gives another tag."""
    from quire._runtime import peerwire

    if not peerwire.FAST:
        pytest.skip("the cryptography package is not installed: no Poly1305")
    sock, nonce = raw_connect(server)
    with sock:
        raw = b"d/tx/idx.json"
        head = REQ.pack(b"g", len(raw), 1 << 20)
        sock.sendall(head + raw + mac(SECRET, b"req", nonce, 0, head, raw).digest())
        ahead = recv(sock, peerwire.ANS.size)
        status, n = peerwire.ANS.unpack(ahead)
        body, tag = recv(sock, n), recv(sock, peerwire.TAG)
    assert (status, body) == (b"O", b'{"a": 1}')

    def tag_of(secret: bytes, seq: int, data: bytes, fast: bool = True) -> bytes:
        h = peerwire.answer_mac(secret, nonce, seq, fast, raw, ahead)
        h.update(data)
        return bytes(h.digest())

    assert tag == tag_of(SECRET, 0, body)
    assert tag != tag_of(bytes(32), 0, body)  # another secret
    assert tag != tag_of(SECRET, 1, body)  # another request of the connection
    assert tag != tag_of(SECRET, 0, b'{"a": 2}')  # another body
    assert tag != tag_of(SECRET, 0, body, fast=False)  # the plain HMAC of the body


@pytest.mark.parametrize("side", ["server", "client"])
def test_a_side_without_poly1305_gets_hmac_bodies(
    tier: Path, side: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quire._runtime import peerconn, peerserve, peerwire

    if side == "server":  # it greets QUIREP01: the client asks G / R
        monkeypatch.setattr(peerserve, "FAST", False)
        monkeypatch.setattr(peerserve, "MAGIC", peerwire.BASE_MAGIC)
    else:  # it asks G / R of a QUIREP02 server
        monkeypatch.setattr(peerconn, "FAST", False)
    with peerlink.PeerServer(tier, SECRET) as s:
        data = (tier / "d" / "tx" / "p00000").read_bytes()
        assert peerlink.fetch(s.address, "d/tx/p00000", SECRET, 10, BIG) == data
        assert peerlink.fetch(s.address, "d/tx/p00000", SECRET, 10, 10, 5, 15) == data[5:15]
        with pytest.raises(PeerError, match="does not authenticate"):
            peerlink.fetch(s.address, "d/tx/idx.json", bytes(32), 10, 100)
