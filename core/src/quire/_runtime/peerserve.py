"""The server side of peer fetches: ``PeerServer`` serves regular files under one directory,
read-only, to clients holding the run's secret (wire format in ``peerwire``).

What it serves is a :class:`Files`: :class:`LocalFiles` (a directory on disk or tmpfs) or
:class:`FsspecFiles` (a directory of an fsspec filesystem, e.g. the process's ``memory://``
store).  The server checks a request's path (relative, no ``..``, ``.``, empty or NUL
components, no backslashes) before asking either; each then keeps the answer under its root
and to regular files, and neither writes anything."""

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

__all__ = ["Files", "FsspecFiles", "LocalFiles", "PeerServer"]

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


class Files:
    """What a :class:`PeerServer` serves: regular files under one root, read-only."""

    label: str  # the root, for messages

    def open(self, parts: list[str]) -> tuple[Any, int]:
        """``(reader, size)`` of the file at ``parts`` (checked components) under the root;
        the reader has ``seek``, ``readinto`` and ``close``.  Raises ``_Refused``."""
        raise NotImplementedError


class LocalFiles(Files):
    """A directory on disk (or tmpfs), resolved once; symlinks are followed only while they
    stay inside it, and only regular files are opened (``O_NOFOLLOW``, non-blocking so a
    FIFO never stalls the server)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve(strict=True)
        if not self.root.is_dir():
            raise NotADirectoryError(f"peer server root {self.root} is not a directory")
        self.label = str(self.root)

    def open(self, parts: list[str]) -> tuple[Any, int]:
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
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0), st.st_size


class FsspecFiles(Files):
    """A directory of an fsspec filesystem (``root``: a path of ``fs``, e.g. the process's
    ``memory://`` store), read with ``info`` and ``cat_file`` only, a block at a time.

    The path asked for is the root joined with the checked components; a path the filesystem
    would read as another (its ``_strip_protocol`` changes it) is refused, so nothing outside
    the root is served.  fsspec filesystems have no symlinks to follow."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = str(fs._strip_protocol(root)).rstrip("/")
        if not fs.isdir(self.root):
            raise NotADirectoryError(f"peer server root {self.root} is not a directory of {fs}")
        self.label = f"{type(fs).__name__}:{self.root}"

    def open(self, parts: list[str]) -> tuple[Any, int]:
        path = "/".join([self.root, *parts])
        if self.fs._strip_protocol(path) != path:
            raise _Refused("path the filesystem would read as another")
        try:
            info = self.fs.info(path)
        except (OSError, ValueError):
            raise _Refused("no such file") from None
        if info.get("type") != "file":
            raise _Refused("not a regular file")
        return _FsspecReader(self.fs, path), int(info["size"])


class _FsspecReader:
    """``seek`` / ``readinto`` over ``fs.cat_file`` ranges (no shared file position)."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs, self.path, self.pos = fs, path, 0

    def seek(self, pos: int) -> None:
        self.pos = pos

    def readinto(self, view: memoryview) -> int:
        try:
            data = self.fs.cat_file(self.path, self.pos, self.pos + len(view))
        except (OSError, ValueError):
            return 0  # gone since: the server hangs up (a short answer)
        view[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def close(self) -> None:
        pass

    def __enter__(self) -> _FsspecReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PeerServer:
    """Serves regular files under ``root`` to clients holding ``secret`` (read-only).

    Parameters
    ----------
    root : str, path or Files
        The directory served (this process's local tier): a path (resolved once, at start:
        :class:`LocalFiles`), or a :class:`Files` such as :class:`FsspecFiles`.
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
        root: str | os.PathLike[str] | Files,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        idle_timeout: float = 30.0,
        max_connections: int = 64,
    ) -> None:
        if len(secret) < 16:
            raise ValueError("a peer secret must be at least 16 bytes (use run_secret)")
        self.files = root if isinstance(root, Files) else LocalFiles(root)
        self.root = self.files.label
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
        return f"PeerServer({self.root!r}, address={self.address})"

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
                opened = self._open_file(raw, limit, end)
            else:
                start, end = 0, -1
                opened = self._open_file(raw, limit)
        except _Refused as r:
            log.warning("peer server %s: refused %r from %s: %s", self.root, path[:300], who, r)
            self._answer(sock, nonce, seq, raw + rng, b"R", str(r), fast)
            return not r.hang_up
        f, size = opened
        with f:
            if end < 0:
                end = size
            f.seek(start)
            with self._lock:  # counted before sending: a client may act on the answer at once
                self.served += end - start
                self.requests += 1
            self._send_file(sock, nonce, seq, raw + rng, f, end - start, fast)
        log.debug("peer server %s: sent %r [%d, %d) to %s", self.root, path, start, end, who)
        return True

    def _open_file(self, raw: bytes, limit: int, end: int | None = None) -> tuple[Any, int]:
        try:
            rel = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Refused("path is not UTF-8") from None
        if rel.startswith("/"):
            raise _Refused("absolute path")
        parts = rel.split("/")
        if "\\" in rel or "\0" in rel or any(p in ("", ".", "..") for p in parts):
            raise _Refused("path with '..', '.', empty or NUL components or backslashes")
        f, size = self.files.open(parts)
        if (end is None and size > limit) or (end is not None and end > size):
            f.close()
            if end is None:
                raise _Refused(f"file of {size} bytes, more than the {limit} asked for")
            raise _Refused(f"range ends at byte {end}, past the end of the file ({size})")
        return f, size

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
