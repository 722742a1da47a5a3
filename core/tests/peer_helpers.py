"""What the peer-link tests share: the credentials of a run of ``n`` processes made in one
process, a tier directory with hostile entries, raw TLS clients, fake peers and relays, and
a real key-value store (JAX's coordination service) in this process."""

from __future__ import annotations

import os
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from jax._src import distributed
from jax._src.lib import _jax

from quire._peers.tls import Credentials, Identity

BIG = 3 * (1 << 20) + 12345  # several of the server's 1 MiB blocks, not a multiple


def run_of(n: int) -> tuple[list[Credentials], dict[int, bytes]]:
    """The credentials of processes ``0 .. n-1`` of one run (each pins every certificate),
    and their certificates (PEM)."""
    ids = [Identity.ephemeral(i) for i in range(n)]
    certs = {i.index: i.cert_pem for i in ids}
    return [i.trust(certs) for i in ids], certs


def make_tier(tmp_path: Path) -> Path:
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


def snapshot(top: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``top``: (mode, size, mtime_ns), links not followed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, top)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def tls_connect(
    address: tuple[str, int], creds: Credentials, source: str | None = None
) -> ssl.SSLSocket:
    """A raw TLS client of ``creds``'s process (optionally from the local address
    ``source``), handshake done."""
    sock = socket.create_connection(
        address, timeout=5, source_address=(source, 0) if source else None
    )
    return creds.client_context.wrap_socket(sock)


def read_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock`` (a raw client's view of an answer), however they arrive."""
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, f"closed after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


def fake_peer(behave: Callable[[socket.socket], None]) -> Iterator[tuple[str, int]]:
    """A TCP listener on 127.0.0.1 that runs ``behave(conn)`` per accepted connection
    (iterate once: yields its address, closes it after)."""
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


def relay(
    target: tuple[str, int],
    damage: Callable[[bytes, int], bytes | None] = lambda data, offset: data,
    record: dict[str, bytearray] | None = None,
) -> Iterator[tuple[str, int]]:
    """A man in the middle of TCP: forwards both ways, passing the server's bytes through
    ``damage(chunk, offset)`` (None: hang up); ``record`` collects what went each way
    (``"up"``: the client's bytes, ``"down"``: the server's)."""

    def behave(conn: socket.socket) -> None:
        up = socket.create_connection(target)

        def client_to_server() -> None:
            try:
                while data := conn.recv(1 << 16):
                    if record is not None:
                        record["up"] += data
                    up.sendall(data)
            except OSError:
                pass

        threading.Thread(target=client_to_server, daemon=True).start()
        offset = 0
        try:
            while data := up.recv(1 << 16):
                if record is not None:
                    record["down"] += data
                out = damage(data, offset)
                if out is None:
                    conn.shutdown(socket.SHUT_RDWR)
                    return
                conn.sendall(out)
                offset += len(data)
        except OSError:
            pass

    return fake_peer(
        lambda conn: threading.Thread(target=behave, args=(conn,), daemon=True).start()
    )


def flip_at(spot: int, mask: int = 1) -> Callable[[bytes, int], bytes]:
    """A ``relay`` damage that XORs ``mask`` into the byte at stream offset ``spot``."""

    def flip(data: bytes, offset: int) -> bytes:
        if offset <= spot < offset + len(data):
            b = bytearray(data)
            b[spot - offset] ^= mask
            return bytes(b)
        return data

    return flip


def key_value_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """JAX's coordination service and a client of it, in this process, installed as the
    client quire's multi-process code talks to (what ``jax.distributed.initialize`` sets)
    until the generator is closed; yields the client, to publish what other processes
    would.  Use it as a fixture's body: ``yield from key_value_store(monkeypatch)``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    where = f"127.0.0.1:{port}"
    service = _jax.get_distributed_runtime_service(where, 1)
    try:
        client = _jax.get_distributed_runtime_client(where, 0, init_timeout=30)
        client.connect()
        try:
            monkeypatch.setattr(distributed.global_state, "client", client)
            yield client
        finally:
            client.shutdown()
    finally:
        service.shutdown()
