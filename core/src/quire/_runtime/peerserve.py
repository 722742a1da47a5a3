"""The server side of peer fetches: ``PeerServer`` serves regular files under one directory,
read-only, to clients holding the run's secret (wire format in ``peerwire``)."""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import socketserver
import stat
import threading
from pathlib import Path
from typing import Any

from quire._runtime.peerwire import (
    ANS,
    BLOCK,
    FAST,
    MAGIC,
    MAX_PATH_BYTES,
    NONCE,
    RANGE,
    REQ,
    TAG,
    Closed,
    answer_mac,
    mac,
    recv,
)

__all__ = ["PeerServer"]

log = logging.getLogger("quire")


class _TCP4(socketserver.ThreadingTCPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = False
    request_queue_size = 128  # many processes may ask one survivor at once

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.warning("peer server: error serving %s", client_address, exc_info=True)


class _TCP6(_TCP4):
    address_family = socket.AF_INET6


class _Refused(Exception):
    def __init__(self, reason: str, *, hang_up: bool = False) -> None:
        super().__init__(reason)
        self.hang_up = hang_up


class PeerServer:
    """Serves regular files under ``root`` to clients holding ``secret`` (read-only).

    Parameters
    ----------
    root : str or path
        The directory served (this process's local tier); resolved once, at start.
    secret : bytes
        The run's secret (:func:`run_secret`), at least 16 bytes.
    host : str
        The interface to listen on (``127.0.0.1`` by default: this machine only).  Give
        the address of the network peers use, never ``0.0.0.0`` unless every interface
        is meant.
    port : int
        0 picks a free port; :attr:`address` says which.
    idle_timeout : float
        Seconds a connection may stay silent (or stall a read) before the server drops it.
    max_connections : int
        Connections served at once; more are refused and logged.

    Refused, each logged at WARNING on the ``quire`` logger with the client's address:
    a bad MAC (the connection is dropped), a request longer than :data:`MAX_PATH_BYTES`
    (dropped), an absolute path, a path with ``..``, ``.``, empty or NUL components or
    backslashes, a path that leaves ``root`` once symlinks are resolved, anything but a
    regular file, a file longer than the request's maximum; for a range request, a range
    that is empty-reversed (``start > end``), ends past the end of the file, or is longer
    than the request's maximum.

    :attr:`served` counts the file bytes answered (all connections), ``requests`` the files
    or ranges answered; each answer is logged at DEBUG.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        idle_timeout: float = 30.0,
        max_connections: int = 64,
    ) -> None:
        if len(secret) < 16:
            raise ValueError("a peer secret must be at least 16 bytes (use run_secret)")
        self.root = Path(root).resolve(strict=True)
        if not self.root.is_dir():
            raise NotADirectoryError(f"peer server root {self.root} is not a directory")
        self._secret = bytes(secret)
        self._idle = idle_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.served = 0  # file bytes sent, all connections together
        self.requests = 0  # files and ranges sent
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                owner._serve(self.request, self.client_address)

        server = (_TCP6 if ":" in host else _TCP4)((host, port), Handler)
        self._server = server
        self.address: tuple[str, int] = tuple(server.server_address[:2])  # type: ignore[assignment]
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.name = f"quire-peer-server-{self.address[1]}"
        self._thread.start()

    # -------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Stop accepting, drop open connections and wait for the accept thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._open)
        self._server.shutdown()
        self._server.server_close()
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join()

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PeerServer({str(self.root)!r}, address={self.address})"

    # -------------------------------------------------------------- one connection
    def _serve(self, sock: socket.socket, peer: Any) -> None:
        who = f"{peer[0]}:{peer[1]}"
        if not self._slots.acquire(blocking=False):
            log.warning("peer server %s: refused %s: too many connections", self.root, who)
            return
        with self._lock:
            if self._closed:
                self._slots.release()
                return
            self._open.add(sock)
        try:
            sock.settimeout(self._idle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = secrets.token_bytes(NONCE)
            sock.sendall(MAGIC + nonce)
            seq = 0
            while self._request(sock, who, nonce, seq):
                seq += 1
        except (OSError, Closed):
            pass  # the client went away or stalled: nothing to answer
        finally:
            with self._lock:
                self._open.discard(sock)
            self._slots.release()

    def _request(self, sock: socket.socket, who: str, nonce: bytes, seq: int) -> bool:
        """Serve one request; False when the connection is over."""
        try:
            head = sock.recv(REQ.size, socket.MSG_WAITALL)
        except TimeoutError:
            return False
        if not head:
            return False  # the client is done
        if len(head) < REQ.size:
            raise Closed("short request")
        op, n, limit = REQ.unpack(head)
        path, raw, rng = "<unread>", b"", b""
        fast = FAST and op in (b"g", b"r")  # bodies MACed through Poly1305 (``peerwire``)
        try:
            if op not in (b"G", b"R") and not fast:
                raise _Refused(f"unknown request {op!r}", hang_up=True)
            if n > MAX_PATH_BYTES:
                raise _Refused(
                    f"oversize request: path of {n} bytes (at most {MAX_PATH_BYTES})",
                    hang_up=True,
                )
            raw = recv(sock, n)
            if op in (b"R", b"r"):
                rng = recv(sock, RANGE.size)
            tag = recv(sock, TAG)
            path = raw.decode("utf-8", "backslashreplace")
            want = mac(self._secret, b"req", nonce, seq, head, raw, rng).digest()
            if not hmac.compare_digest(tag, want):
                raise _Refused(
                    "bad MAC (not this run's secret, or a replayed request)", hang_up=True
                )
            if rng:
                start, end = RANGE.unpack(rng)
                if start > end or end - start > limit:
                    raise _Refused(
                        f"range [{start}, {end}) is reversed or longer than the {limit} "
                        "bytes asked for"
                    )
                fd = self._open_file(raw, limit, end)
            else:
                start, end = 0, -1
                fd = self._open_file(raw, limit)
        except _Refused as r:
            log.warning("peer server %s: refused %r from %s: %s", self.root, path[:300], who, r)
            self._answer(sock, nonce, seq, raw + rng, b"R", str(r), fast)
            return not r.hang_up
        with os.fdopen(fd, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if end < 0:
                end = size
            f.seek(start)
            with self._lock:  # counted before sending: a client may act on the answer at once
                self.served += end - start
                self.requests += 1
            self._send_file(sock, nonce, seq, raw + rng, f, end - start, fast)
        log.debug("peer server %s: sent %r [%d, %d) to %s", self.root, path, start, end, who)
        return True

    def _open_file(self, raw: bytes, limit: int, end: int | None = None) -> int:
        try:
            rel = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Refused("path is not UTF-8") from None
        if rel.startswith("/"):
            raise _Refused("absolute path")
        parts = rel.split("/")
        if "\\" in rel or "\0" in rel or any(p in ("", ".", "..") for p in parts):
            raise _Refused("path with '..', '.', empty or NUL components or backslashes")
        try:
            full = self.root.joinpath(*parts).resolve(strict=True)
        except (OSError, RuntimeError):
            raise _Refused("no such file") from None
        if not full.is_relative_to(self.root):
            raise _Refused("path leaves the served directory (through a symlink)")
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOFOLLOW: the
            # resolved path has no link left unless one was swapped in since.
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise _Refused(f"cannot open: {e.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise _Refused("not a regular file")
        if end is None and st.st_size > limit:
            os.close(fd)
            raise _Refused(f"file of {st.st_size} bytes, more than the {limit} asked for")
        if end is not None and end > st.st_size:
            os.close(fd)
            raise _Refused(f"range ends at byte {end}, past the end of the file ({st.st_size})")
        os.set_blocking(fd, True)
        return fd

    def _answer(
        self,
        sock: socket.socket,
        nonce: bytes,
        seq: int,
        raw: bytes,
        status: bytes,
        text: str,
        fast: bool,
    ) -> None:
        body = text.encode()
        head = ANS.pack(status, len(body))
        h = answer_mac(self._secret, nonce, seq, fast, raw, head)
        h.update(body)
        sock.sendall(head + body + h.digest())

    def _send_file(
        self,
        sock: socket.socket,
        nonce: bytes,
        seq: int,
        raw: bytes,
        f: Any,
        size: int,
        fast: bool,
    ) -> None:
        head = ANS.pack(b"O", size)
        h = answer_mac(self._secret, nonce, seq, fast, raw, head)
        sock.sendall(head)
        left = size
        buf = bytearray(min(BLOCK, max(1, size)))
        view = memoryview(buf)
        while left:
            n = f.readinto(view[: min(len(buf), left)])
            if not n:
                # the file shrank under us: the client sees a short answer; hang up
                raise Closed(f"file shrank to {size - left} bytes while being sent")
            h.update(view[:n])
            sock.sendall(view[:n])
            left -= n
        sock.sendall(h.digest())
