"""The attacks of issues 30 and 36 against the peer link, each against a real ``PeerServer`` on
127.0.0.1 and the real client (one process; the run's certificates made here).

* Forgery / man in the middle: a server with a certificate the client did not pin (another
  run's, serving forged files), or the genuine certificate of another process of the run,
  is refused before the client sends its request; so is a relay that alters the handshake.
* Downgrade: a server or a client that offers only TLS 1.2 is refused.
* Replay: a recorded client session replayed to the server gets nothing served; a recorded
  server session replayed to a client (the file changed since) is refused, never the old
  bytes.
* Slowloris: slow handshakes from one address hold at most that address's handshake slots,
  each for at most the handshake deadline; a legitimate fetch succeeds meanwhile.  A request
  trickled byte by byte is cut at its total deadline.
* A request header split over TLS records (and TCP segments) is read whole.
* A client with a certificate that is not the run's gets TLS's alert for its category
  (``unknown_ca``, ``certificate_required``, ``protocol_version``), nothing else; bytes
  that are not TLS get at most an alert.
* Floods of silent connections from 2 and from 32 addresses outside the run do not keep a
  process of the run from a handshake slot; a silent connection is closed at the
  ClientHello deadline.
* A writer under the tier swapping a directory for a link out of it never gets the bytes
  behind the link served.
* Warnings about refused connections are rate-limited.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import logging
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from peer_helpers import BIG, fake_peer, flip_at, make_tier, read_exact, relay, run_of, tls_connect

from quire._peers import link
from quire._peers.admission import GRACE
from quire._peers.server import _Warnings
from quire._peers.tls import Credentials, Identity
from quire._peers.wire import ANS, REQ
from quire.errors import PeerError

RUN, CERTS = run_of(2)  # processes 0 and 1 of one run
P0, P1 = RUN


@pytest.fixture
def tier(tmp_path: Path) -> Path:
    return make_tier(tmp_path)


@pytest.fixture
def server(tier: Path) -> Iterator[link.PeerServer]:
    """Process 0's server; the tests' client is process 1."""
    with link.PeerServer(tier, P0, idle_timeout=5.0) as s:
        yield s


def outsider(index: int, pinning: dict[int, bytes] | None = None) -> Credentials:
    """A process of no run of ours (its own key), pinning ``pinning`` (index -> PEM) besides
    itself, so that its half of a handshake with them goes through."""
    ident = Identity.ephemeral(index)
    return ident.trust({**(pinning or {}), index: ident.cert_pem})


def drain(sock: socket.socket) -> bytes:
    """Everything ``sock`` receives until the other side hangs up (or resets)."""
    back = bytearray()
    try:
        while chunk := sock.recv(1 << 16):
            back += chunk
    except ConnectionResetError:
        pass
    return bytes(back)


# ---------------------------------------------------------------------- forgery, MITM
def test_a_server_without_the_pinned_certificate_is_refused_unasked(
    tmp_path: Path, server: link.PeerServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    forged = make_tier(tmp_path / "forged")
    (forged / "d" / "tx" / "idx.json").write_bytes(b'{"a": "forged"}')
    # another run's process 0, serving forged files where process 0 was published
    with link.PeerServer(forged, outsider(0)) as mitm:
        with pytest.raises(PeerError, match="TLS certificate is not one of this run's") as e:
            link.fetch(mitm.address, "d/tx/idx.json", P1.peer(0), 5, 100)
        assert "man in the middle" in str(e.value)
        assert mitm.requests == 0  # the request (its path) never reached it
    # the genuine certificate of the run's process 1, where process 0 was meant
    with link.PeerServer(forged, P1) as other:
        with pytest.raises(PeerError, match="not the one process 0 published"):
            link.fetch(other.address, "d/tx/idx.json", P1.peer(0), 5, 100)
        assert other.requests == 0
    # a relay that alters the server's handshake
    for where in relay(server.address, flip_at(60)):
        with pytest.raises(PeerError, match="TLS"):
            link.fetch(where, "d/tx/idx.json", P1.peer(0), 5, 100)
    assert server.requests == 0
    assert caplog.text.count("d/tx/idx.json") >= 3  # each refusal logged by the client
    assert link.fetch(server.address, "d/tx/idx.json", P1.peer(0), 5, 100) == b'{"a": 1}'


@pytest.mark.parametrize("side", ["server", "client"])
def test_no_downgrade_to_tls_1_2(tier: Path, side: str) -> None:
    """The same certificates, pinned, but one side speaks TLS 1.2 only: refused."""
    old = Identity.ephemeral(0 if side == "server" else 1)
    for ctx in (old._server, old._client):
        ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    if side == "server":
        creds = old.trust({0: old.cert_pem})
        with link.PeerServer(tier, creds) as s:
            client = outsider(1, {0: old.cert_pem})
            with pytest.raises(PeerError, match=r"TLS 1\.3 handshake failed"):
                link.fetch(s.address, "empty", client.peer(0), 5, 10)
            assert s.requests == 0
    else:
        creds = old.trust({1: old.cert_pem, 0: CERTS[0]})
        server = outsider(0, {1: old.cert_pem})
        with link.PeerServer(tier, server) as s:
            with pytest.raises(PeerError, match=r"TLS 1\.3 handshake failed"):
                link.fetch(s.address, "empty", creds.peer(0), 5, 10)
            assert s.requests == 0


# ---------------------------------------------------------------------- replay
def test_a_replayed_client_session_gets_nothing_served(
    server: link.PeerServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    record = {"up": bytearray(), "down": bytearray()}
    for where in relay(server.address, record=record):
        assert link.fetch(where, "d/tx/idx.json", P1.peer(0), 5, 100) == b'{"a": 1}'
    assert server.requests == 1 and b"d/tx/idx.json" not in record["up"]  # encrypted
    with socket.create_connection(server.address, timeout=5) as raw:
        raw.sendall(bytes(record["up"]))
        back = drain(raw)
    assert b'{"a": 1}' not in back
    assert server.requests == 1 and server.served == 8  # nothing more served
    assert "no TLS 1.3 handshake with a certificate of this run" in caplog.text


def test_a_replayed_server_session_is_refused(server: link.PeerServer, tier: Path) -> None:
    record = {"up": bytearray(), "down": bytearray()}
    for where in relay(server.address, record=record):
        assert link.fetch(where, "d/tx/idx.json", P1.peer(0), 5, 100) == b'{"a": 1}'
    (tier / "d" / "tx" / "idx.json").write_bytes(b'{"a": 2}')  # changed since

    def replay(conn: socket.socket) -> None:
        conn.recv(1 << 16)  # the client's hello
        conn.sendall(bytes(record["down"]))

    for where in fake_peer(replay):
        with pytest.raises(PeerError, match="TLS"):
            link.fetch(where, "d/tx/idx.json", P1.peer(0), 5, 100)
    assert link.fetch(server.address, "d/tx/idx.json", P1.peer(0), 5, 100) == b'{"a": 2}'


# ---------------------------------------------------------------------- slowloris
def slow_handshake(address: tuple[str, int], source: str, stop: threading.Event) -> float:
    """Start a TLS record of 512 bytes and send it a byte per 50 ms; the seconds until the
    server hangs up (or the test stops it)."""
    sock = socket.create_connection(address, timeout=10, source_address=(source, 0))
    t = time.monotonic()
    try:
        sock.sendall(bytes([0x16, 3, 1, 2, 0]))  # handshake record of 512 bytes, then...
        sock.setblocking(False)
        while not stop.is_set():
            try:
                if sock.recv(1 << 10) == b"":
                    break
            except BlockingIOError:
                pass
            except OSError:
                break
            try:
                sock.send(b"\0")
            except OSError:
                break
            time.sleep(0.05)
        return time.monotonic() - t
    finally:
        sock.close()


def test_slow_handshakes_hold_few_slots_briefly_and_a_fetch_still_succeeds(
    tier: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    big = (tier / "d" / "tx" / "p00000").read_bytes()
    caps = dict(max_connections=16, max_handshakes=8, max_handshakes_per_address=4)
    with link.PeerServer(tier, P0, handshake_timeout=1.0, **caps) as s:  # type: ignore[arg-type]
        stop = threading.Event()
        lasted: list[float] = []

        def attacker() -> None:  # reconnects as soon as it is dropped
            while not stop.is_set():
                lasted.append(slow_handshake(s.address, "127.0.0.2", stop))

        threads = [threading.Thread(target=attacker, daemon=True) for _ in range(24)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        assert s.handshakes <= 4  # that address's share, however many it opens
        t0 = time.monotonic()
        got = link.fetch(s.address, "d/tx/p00000", P1.peer(0), 10, BIG)  # from 127.0.0.1
        took = time.monotonic() - t0
        time.sleep(1.5)  # every admitted slow handshake reaches its deadline meanwhile
        stop.set()
        for t in threads:
            t.join()
    assert got == big and took < 5
    assert len(lasted) > 24  # dropped and reconnected
    assert max(lasted) < 2.5  # none held past the 1 s deadline (with slack for a busy machine)
    assert "too many handshakes from its address" in caplog.text  # (the rest held back)


def silent(
    address: tuple[str, int],
    source: str,
    stop: threading.Event,
    opened: list[int],
    age: float | None = None,
) -> None:
    """Keep a connection from ``source`` open without a byte, re-opening it as soon as the
    server drops it (or, with ``age``, closing it after ``age`` seconds and opening
    another at once: never an old handshake), until ``stop``; count each one opened in
    ``opened``."""
    while not stop.is_set():
        try:
            sock = socket.create_connection(address, timeout=2, source_address=(source, 0))
        except OSError:
            continue
        opened.append(1)
        until = time.monotonic() + (age if age is not None else float("inf"))
        with sock:
            sock.settimeout(0.05)
            while not stop.is_set() and time.monotonic() < until:
                try:
                    if sock.recv(1) == b"":
                        break  # dropped: again
                except TimeoutError:
                    pass
                except OSError:
                    break


@contextlib.contextmanager
def flood(
    address: tuple[str, int], sources: list[str], each: int, age: float | None = None
) -> Iterator[list[int]]:
    """``each`` threads per address of ``sources`` keeping a silent connection open,
    re-opened as soon as the server drops it (or after ``age`` seconds: :func:`silent`);
    yields once every thread has opened one, the list that counts them."""
    stop = threading.Event()
    opened: list[int] = []
    threads = [
        threading.Thread(target=silent, args=(address, src, stop, opened, age), daemon=True)
        for src in sources
        for _ in range(each)
    ]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 10
        while len(opened) < len(threads) and time.monotonic() < deadline:
            time.sleep(0.05)
        yield opened
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert len(opened) > len(threads)  # the server dropped some, and they came back


def timed_fetches(server: link.PeerServer, n: int = 4) -> list[float]:
    """Seconds each of ``n`` fetches by process 1 took (each checked), with the server's
    handshake slots counted before each (the most held over the 0.2 s before it: a flood
    that closes and re-opens its connections leaves a slot free for a moment)."""
    took = []
    for _ in range(n):
        full = 0
        for _ in range(20):
            time.sleep(0.01)
            full = max(full, server.handshakes)
        t0 = time.monotonic()
        got = link.fetch(server.address, "d/tx/idx.json", P1.peer(0), 5, 100)
        took.append(time.monotonic() - t0)
        assert got == b'{"a": 1}' and full >= 8  # the slots the others may take, taken
    return took


@pytest.mark.parametrize(("addresses", "each"), [(2, 10), (32, 2)])
def test_no_flood_of_silent_handshakes_keeps_a_process_of_the_run_out(
    tier: Path, addresses: int, each: int
) -> None:
    """Silent connections from ``addresses`` source addresses outside the run (``each``
    from each, re-opened as soon as they are dropped: more than every handshake slot) do
    not keep the run's processes from a handshake: each fetch from a host of the run
    succeeds within a second or two."""
    sources = [f"127.0.{i // 250}.{2 + i % 250}" for i in range(addresses)]
    with link.PeerServer(tier, P0) as s:
        s.reserve_for(["127.0.0.1"])  # as the tier does: its processes' published hosts
        with flood(s.address, sources, each):
            took = timed_fetches(s)
    assert max(took) < 2.0, took


def test_an_address_outside_the_run_gets_its_share_against_a_few_others(tier: Path) -> None:
    """With no host of the run known, the shared slots are shared fairly: two flooding
    addresses cannot keep a third out."""
    with link.PeerServer(tier, P0) as s, flood(s.address, ["127.0.0.2", "127.0.0.3"], 10):
        took = timed_fetches(s)
    assert max(took) < 2.0, took


def test_a_host_of_the_run_that_floods_keeps_out_only_its_own(
    tier: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A host is not authenticated by its address: connections from a host of the run
    (another user of it) may take the run's slots, but not from the run's other hosts."""
    caplog.set_level(logging.WARNING, logger="quire")
    with link.PeerServer(tier, P0) as s:
        s._warn = _Warnings(burst=1 << 30)  # every line: the cuts among them
        s.reserve_for(["127.0.0.1", "127.0.0.2"])
        with flood(s.address, ["127.0.0.2", "127.0.0.3"], 12):  # every slot taken
            took = timed_fetches(s)
    assert max(took) < 2.0, took
    assert "to give its slot to one from 127.0.0.1: 127.0.0.2 held the most" in caplog.text


@pytest.mark.parametrize("run_hosts", [["127.0.0.1", "127.0.0.2"], []])
def test_handshakes_kept_young_do_not_keep_another_address_out(
    tier: Path, run_hosts: list[str]
) -> None:
    """A flood that closes each silent connection before the grace period a handshake
    gets (and opens another at once) leaves no handshake old enough to be cut: it must not
    keep a host of the run out of the run's slots (another host of the run floods them),
    nor a third address out of the shared slots (two addresses flood them)."""
    sources = ["127.0.0.2", "127.0.0.3"]
    with link.PeerServer(tier, P0) as s:
        s.reserve_for(run_hosts)
        with flood(s.address, sources, 12, age=0.6 * GRACE):
            took = timed_fetches(s)
    assert max(took) < 2.0, took


def test_a_connection_without_a_client_hello_is_closed_at_the_hello_deadline(
    tier: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    with link.PeerServer(tier, P0, hello_timeout=0.3, handshake_timeout=6.0) as s:
        t = time.monotonic()
        with socket.create_connection(s.address, timeout=5) as silent:
            assert silent.recv(10) == b""
        assert 0.25 < time.monotonic() - t < 2.5
        with socket.create_connection(s.address, timeout=5) as slow:
            slow.sendall(bytes([0x16, 3, 1, 2, 0]) + b"\0" * 100)  # 100 of 512 bytes
            assert drain(slow) == b""  # (reset: its bytes were left unread)
        # A whole first record that holds only the first byte of a ClientHello (TLS lets one
        # span records), then nothing: the ClientHello is not whole at the hello deadline.
        t = time.monotonic()
        with socket.create_connection(s.address, timeout=8) as piece:
            piece.sendall(bytes([0x16, 3, 1, 0, 1, 1]))
            assert drain(piece) == b""
        assert time.monotonic() - t < 2.5
        assert s.handshakes == 0
    assert caplog.text.count("no TLS ClientHello within 0.3s") == 3


def records(hello: bytes, cuts: tuple[int, ...]) -> list[bytes]:
    """The handshake record ``hello`` (one record) as several records, its payload cut at
    ``cuts``."""
    head, body = hello[:5], hello[5:]
    assert head[0] == 0x16 and int.from_bytes(head[3:5], "big") == len(body)
    bounds = [0, *cuts, len(body)]
    return [
        head[:3] + (b - a).to_bytes(2, "big") + body[a:b] for a, b in itertools.pairwise(bounds)
    ]


@pytest.mark.parametrize("split", ["TCP segments", "TLS records"])
def test_a_client_hello_in_pieces_within_the_deadline_is_waited_for(
    tier: Path, split: str
) -> None:
    """The server waits for the whole ClientHello, however it arrives (here in three TCP
    segments, or in three TLS records, over 0.4 s; a hello deadline of 1 s)."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = P1.client_context.wrap_bio(incoming, outgoing)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    if split == "TCP segments":
        pieces = [hello[:3], hello[3:40], hello[40:]]
    else:
        pieces = records(hello, (1, 40))
    with link.PeerServer(tier, P0, hello_timeout=1.0) as s:
        sock = socket.create_connection(s.address, timeout=5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(0.2)
        while True:  # the rest of the handshake, then one request
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                sock.sendall(outgoing.read())
                incoming.write(sock.recv(1 << 16))
        path = b"d/tx/idx.json"
        tls.write(REQ.pack(b"G", len(path), 100, 0, 0) + path)
        sock.sendall(outgoing.read())
        back = b""
        while len(back) < ANS.size + 8:
            try:
                back += tls.read(1 << 16)
            except ssl.SSLWantReadError:
                incoming.write(sock.recv(1 << 16))
        sock.close()
    assert back == ANS.pack(b"O", 8) + b'{"a": 1}'


def test_a_request_trickled_byte_by_byte_is_cut_at_its_deadline(tier: Path) -> None:
    with link.PeerServer(tier, P0, idle_timeout=5.0, request_timeout=0.5) as s:
        sock = tls_connect(s.address, P1)
        path = b"d/tx/idx.json"
        message = REQ.pack(b"G", len(path), 100, 0, 0) + path  # 2 s at a byte per 50 ms
        t = time.monotonic()
        with pytest.raises(OSError):
            for b in message:
                sock.sendall(bytes([b]))  # one TLS record each, well within idle_timeout
                time.sleep(0.05)
            assert sock.recv(10) == b""  # (hung up before answering)
            raise ConnectionResetError
        assert time.monotonic() - t < 1.8 and s.requests == 0
        sock.close()


# ---------------------------------------------------------------------- split header
@pytest.mark.parametrize("cut", [1, 5, REQ.size - 1, REQ.size + 3])
def test_a_request_split_over_records_and_segments_is_read_whole(
    server: link.PeerServer, cut: int
) -> None:
    path = b"d/tx/idx.json"
    message = REQ.pack(b"G", len(path), 100, 0, 0) + path
    with tls_connect(server.address, P1) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(message[:cut])
        time.sleep(0.2)  # the server has read the first piece alone
        sock.sendall(message[cut:])
        status, n = ANS.unpack(read_exact(sock, ANS.size))
        assert (status, read_exact(sock, n)) == (b"O", b'{"a": 1}')
    assert server.requests == 1


# ---------------------------------------------------------------------- a wrong certificate
def test_a_client_with_the_wrong_certificate_gets_an_alert_and_nothing_else(
    server: link.PeerServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    stranger = outsider(7, {0: CERTS[0]})  # knows process 0's certificate; not the run's
    with pytest.raises(PeerError, match="did not accept this process's certificate") as e:
        link.fetch(server.address, "d/tx/idx.json", stranger.peer(0), 5, 100)
    assert "'d/tx/idx.json'" in str(e.value) and "TLSV1_ALERT_UNKNOWN_CA" in str(e.value)
    assert server.requests == 0 and server.served == 0
    # The server logs from its own thread, after the close the client saw: wait for it.
    deadline = time.monotonic() + 10
    while "closed a connection from" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "closed a connection from 127.0.0.1:" in caplog.text
    assert "no TLS 1.3 handshake with a certificate of this run" in caplog.text
    assert link.fetch(server.address, "d/tx/idx.json", P1.peer(0), 5, 100) == b'{"a": 1}'


def _no_certificate() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    return ctx


def _tls_1_2() -> ssl.SSLContext:
    ctx = outsider(1, {0: CERTS[0]}).client_context
    ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    return ctx


@pytest.mark.parametrize(
    ("client", "alert", "logged"),
    [
        (_no_certificate, "TLSV13_ALERT_CERTIFICATE_REQUIRED", "PEER_DID_NOT_RETURN_A_CERT"),
        (
            lambda: outsider(7, {0: CERTS[0]}).client_context,
            "TLSV1_ALERT_UNKNOWN_CA",
            "self-signed",
        ),
        (_tls_1_2, "TLSV1_ALERT_PROTOCOL_VERSION", "UNSUPPORTED_PROTOCOL"),
    ],
)
def test_a_refused_handshake_gets_the_tls_alert_that_names_why(
    server: link.PeerServer,
    caplog: pytest.LogCaptureFixture,
    client: Any,
    alert: str,
    logged: str,
) -> None:
    """What ``docs/peers.md`` says a refused client learns: TLS's alert for its category,
    no more; the server's warning says what failed, and that it failed at once."""
    caplog.set_level(logging.WARNING, logger="quire")
    with (
        socket.create_connection(server.address, timeout=5) as raw,
        pytest.raises(ssl.SSLError) as e,
        client().wrap_socket(raw) as sock,
    ):
        sock.sendall(b"G")
        sock.recv(1)
    assert e.value.reason == alert
    deadline = time.monotonic() + 10
    while "closed a connection from" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "no TLS 1.3 handshake with a certificate of this run: it failed after 0." in caplog.text
    assert logged in caplog.text and "within" not in caplog.text
    assert server.requests == 0


@pytest.mark.parametrize(
    ("data", "back"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", b""),
        (b"\0" * 10, b""),
        (b"", bytes([0x15, 3, 3, 0, 2, 2, 50])),  # the end of the stream: decode_error
    ],
)
def test_bytes_that_are_not_tls_get_at_most_an_alert(
    server: link.PeerServer, data: bytes, back: bytes
) -> None:
    with socket.create_connection(server.address, timeout=5) as raw:
        raw.sendall(data)
        raw.shutdown(socket.SHUT_WR)
        assert drain(raw) == back


def test_warnings_about_refused_connections_are_rate_limited(
    tier: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    with link.PeerServer(tier, P0) as s:
        s._warn = _Warnings(burst=3, every=0.5)
        for _ in range(30):  # not TLS at all: each handshake fails at once
            with socket.create_connection(s.address, timeout=5) as c:
                c.sendall(b"GET / HTTP/1.1\r\n\r\n")
                drain(c)
        lines = [r for r in caplog.records if "closed a connection" in r.getMessage()]
        assert 3 <= len(lines) <= 5
        time.sleep(0.6)
        with socket.create_connection(s.address, timeout=5) as c:
            c.sendall(b"\0" * 10)
            drain(c)
    last = [r.getMessage() for r in caplog.records if "closed a connection" in r.getMessage()]
    assert "warnings of this server held back before it" in last[-1]


def test_a_connection_over_the_cap_is_closed_and_the_client_asks_again(
    tier: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    with link.PeerServer(tier, P0, max_connections=1) as s:
        held = tls_connect(s.address, P1)  # takes the only slot
        with pytest.raises(PeerError, match="kept closing new connections unanswered"):
            link.fetch(s.address, "empty", P1.peer(0), 0.5, 10)
        assert "too many connections" in caplog.text
        threading.Timer(0.3, held.close).start()  # the slot comes back meanwhile
        t = time.monotonic()
        assert link.fetch(s.address, "empty", P1.peer(0), 5, 10) == b""
        assert 0.2 < time.monotonic() - t < 3


def test_the_key_file_of_an_ephemeral_identity_is_not_left_behind(tmp_path: Path) -> None:
    import tempfile

    before = set(os.listdir(tempfile.gettempdir()))
    Identity.ephemeral(3)
    assert not {n for n in set(os.listdir(tempfile.gettempdir())) - before if "quire-peer" in n}


# ---------------------------------------------------------------------- a writer under the tier
_SWAPPER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b = (os.fsencode(p) for p in sys.argv[1:3])
print("swapping", flush=True)
while True:  # renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE): an atomic swap
    if libc.renameat2(-100, a, -100, b, 2) != 0:
        sys.exit(f"renameat2: {os.strerror(ctypes.get_errno())}")
"""


def ask(sock: ssl.SSLSocket, path: bytes) -> tuple[bytes, bytes]:
    """One request on an authenticated raw connection: (status, body or reason)."""
    sock.sendall(REQ.pack(b"G", len(path), 1 << 20, 0, 0) + path)
    status, n = ANS.unpack(read_exact(sock, ANS.size))
    return status, read_exact(sock, n)


@pytest.mark.skipif(
    not hasattr(ctypes.CDLL(None), "renameat2"), reason="renameat2 is Linux's (glibc 2.28+)"
)
def test_a_directory_swapped_for_a_link_out_of_the_tier_never_serves_outside_bytes(
    tier: Path,
) -> None:
    """A writer under the tier (another process) swaps a directory and a symlink leading
    outside, atomically, in a loop, while a process of the run asks for a file under that
    directory: every answer is the file inside or a refusal, never the file outside."""
    inside, swap = tier / "d" / "race", tier / "d" / "swap"
    inside.mkdir()
    (inside / "f").write_bytes(b"inside.." * 64)
    out = tier.parent / "outside" / "race"
    out.mkdir()
    (out / "f").write_bytes(b"OUTSIDE!" * 64)
    swap.symlink_to(out)
    answers: collections.Counter[bytes] = collections.Counter()
    writer = subprocess.Popen(
        [sys.executable, "-c", _SWAPPER, str(inside), str(swap)], stdout=subprocess.PIPE
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == b"swapping\n"
        with link.PeerServer(tier, P0) as s, tls_connect(s.address, P1) as sock:
            for _ in range(800):
                status, body = ask(sock, b"d/race/f")
                answers[body[:8] if status == b"O" else status] += 1
        assert writer.poll() is None  # it swapped all along
    finally:
        writer.kill()
        writer.wait()
    assert answers[b"OUTSIDE!"] == 0, answers
    assert answers[b"inside.."] > 0 and answers[b"R"] > 0, answers  # both states were seen
