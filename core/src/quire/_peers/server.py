"""The server side of peer fetches: ``PeerServer`` serves regular files under one directory
(a ``files.Files``), read-only, over TLS 1.3 to the run's processes (certificates in
``tls``, messages in ``wire``, who takes a handshake slot in ``admission``): caps on
connections, deadlines for the ClientHello, the handshake and each request, refusals
logged at a bounded rate."""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import ssl
import threading
import time
from collections.abc import Iterable
from typing import Any

from quire._peers.admission import Admission, Shake
from quire._peers.files import Files, FsspecFiles, LocalFiles, Refused
from quire._peers.tls import Credentials
from quire._peers.wire import ANS, BLOCK, MAX_PATH_BYTES, REQ, Closed, TLSStream

__all__ = ["Files", "FsspecFiles", "LocalFiles", "PeerServer"]

log = logging.getLogger("quire")

#: An answer may take a second per MiB beyond the request's deadline (a slow link).
_MIN_RATE = 1 << 20


class _TCP4(socketserver.ThreadingTCPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = False
    request_queue_size = 128  # many processes may ask one survivor at once
    owner: PeerServer

    def process_request(self, request: Any, client_address: Any) -> None:
        # the caps are checked here, in the accepting thread: no thread for a refused one
        shake = self.owner._admit(request, client_address)
        if shake is None:
            request.close()  # no answer, not even a TLS alert
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.owner._admission.release(shake)
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.owner._warn("peer server: error serving %s", client_address, exc_info=True)


class _TCP6(_TCP4):
    address_family = socket.AF_INET6


class _Warnings:
    """One server's WARNING lines: ``burst`` at once, then one per ``every`` seconds; the
    lines held back are counted in the next one (a flood of bad clients is not a flood of
    log lines)."""

    def __init__(self, burst: int = 10, every: float = 10.0) -> None:
        self.burst, self.every = burst, every
        self.tokens, self.when, self.held = float(burst), time.monotonic(), 0
        self._lock = threading.Lock()

    def __call__(self, msg: str, *args: Any, exc_info: bool = False) -> None:
        with self._lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.when) / self.every)
            self.when = now
            if self.tokens < 1:
                self.held += 1
                return
            self.tokens -= 1
            held, self.held = self.held, 0
        if held:
            msg, args = f"{msg} (and {held} warnings of this server held back before it)", args
        log.warning(msg, *args, exc_info=exc_info)


class PeerServer:
    """Serves regular files under ``root`` to the run's processes over TLS 1.3 (read-only).

    A client must send its ClientHello within ``hello_timeout`` and complete a TLS 1.3
    handshake with a certificate of the run (``credentials``: the pinned certificates, or
    the user's CA and a certificate some process published) within ``handshake_timeout``
    (both from the accept); otherwise the connection is closed (a failed handshake gets
    TLS's alert, e.g. ``unknown_ca``; nothing else is answered before it is done).

    Parameters
    ----------
    root : str, path or Files
        The directory served (this process's local tier): a path (opened once, at start:
        :class:`LocalFiles`, closed with the server), or a :class:`Files` such as
        :class:`FsspecFiles` (the caller's to close).
    credentials : Credentials
        This process's TLS identity and the run's certificates
        (``link.run_credentials``).
    host : str
        The interface to listen on (``127.0.0.1`` by default: this machine only).  Give
        the address of the network peers use, never ``0.0.0.0`` unless every interface
        is meant.
    port : int
        0 picks a free port; :attr:`address` says which.
    idle_timeout : float
        Seconds an authenticated connection may wait between requests.
    handshake_timeout : float
        Seconds from accepting a connection to the end of its handshake, in all.
    request_timeout : float
        Seconds for one request, in all: reading it whole (from its first byte) and sending
        its answer, plus a second per MiB of the answer.
    hello_timeout : float
        Seconds from accepting a connection until its first TLS record (the ClientHello)
        has arrived whole (at most ``handshake_timeout``).
    max_connections, max_per_address : int
        Connections served at once, in all and from one client address (default: 3/4 of
        ``max_connections``, so that no address holds every one).
    max_handshakes : int
        Connections in their handshake (not yet authenticated) at once (default a quarter
        of ``max_connections``: the others stay for the run's processes).
    reserved_handshakes : int
        Those of them only connections from the run's hosts take (:meth:`reserve_for`;
        default half).
    max_handshakes_per_address : int
        The most of the others one address holds (default half of them).

    A connection over a cap is closed at once, without an answer; when the handshake slots
    a connection may take are full, the address holding the most of them may lose its
    oldest handshake to it (``quire._peers.admission``: the rule, and the invariant it
    keeps).  Each refusal is logged at WARNING on the ``quire`` logger with the client's
    address (and, once authenticated, its process), at most 10 lines at once and then one
    per 10 s, the lines held back counted: a connection over a cap, a handshake cut for
    another, no ClientHello in time, a handshake that failed (after how long, and why) or
    took too long, a certificate that is none of the run's, a request longer than
    :data:`MAX_PATH_BYTES` or of an unknown kind (the connection is dropped after the
    refusal), an absolute path, a path with ``..``, ``.``, empty or NUL components or
    backslashes, a path that leads out of ``root`` through a symlink, anything but a
    regular file, a file longer than the request's maximum; for a range request, a range
    that is reversed (``start > end``), ends past the end of the file, or is longer than
    the request's maximum.

    :attr:`served` counts the file bytes answered (all connections), ``requests`` the files
    or ranges answered; each answer is logged at DEBUG.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Files,
        credentials: Credentials,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        idle_timeout: float = 30.0,
        handshake_timeout: float = 10.0,
        request_timeout: float = 30.0,
        hello_timeout: float = 2.0,
        max_connections: int = 64,
        max_per_address: int | None = None,
        max_handshakes: int | None = None,
        reserved_handshakes: int | None = None,
        max_handshakes_per_address: int | None = None,
    ) -> None:
        if not isinstance(credentials, Credentials):
            raise TypeError(
                f"PeerServer: credentials must be tls.Credentials (link."
                f"run_credentials), got {type(credentials).__name__}"
            )
        self._own_files = not isinstance(root, Files)  # made here: closed here
        self.files = root if isinstance(root, Files) else LocalFiles(root)
        self.root = self.files.label
        self.credentials = credentials
        self._idle_s, self._handshake_s, self._request_s = (
            idle_timeout,
            handshake_timeout,
            request_timeout,
        )
        self._hello_s = min(hello_timeout, handshake_timeout)
        handshakes = max_handshakes or max(1, max_connections // 4)
        reserved = handshakes // 2 if reserved_handshakes is None else reserved_handshakes
        self._admission = Admission(
            max_connections,
            max_per_address or max(1, 3 * max_connections // 4),
            handshakes,
            min(reserved, handshakes),
            max_handshakes_per_address or max(1, (handshakes - reserved) // 2),
        )
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._warn = _Warnings()
        self.served = 0  # file bytes sent, all connections together
        self.requests = 0  # files and ranges sent
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                owner._serve(self.request, self.client_address)

        try:
            server = (_TCP6 if ":" in host else _TCP4)((host, port), Handler)
        except BaseException:
            if self._own_files:
                self.files.close()
            raise
        server.owner = self
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
        self._admission.close()
        self._server.shutdown()
        self._server.server_close()
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join()
        if self._own_files:
            self.files.close()

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PeerServer({self.root!r}, address={self.address})"

    @property
    def connections(self) -> int:
        """Connections open now (authenticated or in their handshake)."""
        return self._admission.connections

    @property
    def handshakes(self) -> int:
        """Connections in their handshake now."""
        return self._admission.handshakes

    def reserve_for(self, hosts: Iterable[str]) -> None:
        """Keep ``reserved_handshakes`` handshake slots for connections from ``hosts``: the
        IP addresses the run's processes published for their servers (the tier calls it
        once they are known).  Replaces the hosts given before."""
        self._admission.reserve_for(hosts)

    # -------------------------------------------------------------- one connection
    def _admit(self, sock: socket.socket, peer: Any) -> Shake | None:
        """A handshake slot for a new connection from ``peer``, or None (logged)."""
        shake, why = self._admission.admit(sock, str(peer[0]))
        if shake is None:
            self._warn(
                "peer server %s: closed a connection from %s:%s unanswered: %s",
                self.root, peer[0], peer[1], why,
            )  # fmt: skip
        elif why:
            self._warn("peer server %s: %s", self.root, why)
        return shake

    def _handshake(self, sock: socket.socket, since: float) -> TLSStream:
        """The TLS handshake of a connection accepted at ``since``: its ClientHello whole
        within the hello deadline, the rest within the handshake deadline."""
        _hello(sock, since + self._hello_s)
        tls = TLSStream(sock, self.credentials.server_context, server_side=True)
        tls.handshake(since + self._handshake_s)
        return tls

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        who = f"{peer[0]}:{peer[1]}"
        shake = self._admission.shake_of(sock)
        if shake is None:  # cut before its thread started
            sock.close()
            return
        shaking = True
        try:
            with self._lock:
                if self._closed:
                    return
                self._open.add(sock)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                tls = self._handshake(sock, shake.since)
                process = self.credentials.who(tls.getpeercert(binary_form=True))
            except _HelloTimeout:
                self._warn(
                    "peer server %s: closed a connection from %s unanswered: no TLS "
                    "ClientHello within %gs",
                    self.root, who, self._hello_s,
                )  # fmt: skip
                return
            except OSError as e:  # ssl.SSLError and TimeoutError among them
                if not self._admission.shaken(shake):  # (a cut one was logged as such)
                    self._warn(
                        "peer server %s: closed a connection from %s: no TLS 1.3 handshake "
                        "with a certificate of this run: %s",
                        self.root, who, _failure(e, time.monotonic() - shake.since),
                    )  # fmt: skip
                return
            finally:
                cut = self._admission.shaken(shake)
                shaking = False
            if cut:
                return
            if process is None:  # chained to the user's CA, but published by no process
                self._warn(
                    "peer server %s: closed a connection from %s unanswered: its certificate "
                    "is none that a process of this run published",
                    self.root, who,
                )  # fmt: skip
                return
            who = f"process {process} at {who}"
            while self._request(tls, who):
                pass
        except (OSError, Closed):
            pass  # the client went away or ran out of time: nothing to answer
        finally:
            if shaking:
                self._admission.shaken(shake)
            with self._lock:
                self._open.discard(sock)
            sock.close()
            self._admission.release(shake)

    def _request(self, tls: TLSStream, who: str) -> bool:
        """Serve one request; False when the connection is over."""
        try:
            first = tls.recv(1, time.monotonic() + self._idle_s)
        except (TimeoutError, Closed):
            return False  # idle for too long, or the client is done
        deadline = time.monotonic() + self._request_s
        op, n, limit, start, end = REQ.unpack(first + tls.recv(REQ.size - 1, deadline))
        path = "<unread>"
        try:
            if op not in (b"G", b"R"):
                raise Refused(f"unknown request {op!r}", hang_up=True)
            if n > MAX_PATH_BYTES:
                raise Refused(
                    f"oversize request: path of {n} bytes (at most {MAX_PATH_BYTES})",
                    hang_up=True,
                )
            raw = tls.recv(n, deadline)
            path = raw.decode("utf-8", "backslashreplace")
            if op == b"R":
                if start > end or end - start > limit:
                    raise Refused(
                        f"range [{start}, {end}) is reversed or longer than the {limit} "
                        "bytes asked for"
                    )
                f, size = self._open_file(raw, limit, end)
            else:
                f, size = self._open_file(raw, limit)
                start, end = 0, size
        except Refused as r:
            self._warn("peer server %s: refused %r from %s: %s", self.root, path[:300], who, r)
            body = str(r).encode()
            tls.send_all(ANS.pack(b"R", len(body)) + body, deadline)
            return not r.hang_up
        with f:
            f.seek(start)
            with self._lock:  # counted before sending: a client may act on the answer at once
                self.served += end - start
                self.requests += 1
            self._send_file(tls, f, end - start, deadline + (end - start) / _MIN_RATE)
        log.debug("peer server %s: sent %r [%d, %d) to %s", self.root, path, start, end, who)
        return True

    def _open_file(self, raw: bytes, limit: int, end: int | None = None) -> tuple[Any, int]:
        try:
            rel = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise Refused("path is not UTF-8") from None
        if rel.startswith("/"):
            raise Refused("absolute path")
        parts = rel.split("/")
        if "\\" in rel or "\0" in rel or any(p in ("", ".", "..") for p in parts):
            raise Refused("path with '..', '.', empty or NUL components or backslashes")
        f, size = self.files.open(parts)
        if (end is None and size > limit) or (end is not None and end > size):
            f.close()
            if end is None:
                raise Refused(f"file of {size} bytes, more than the {limit} asked for")
            raise Refused(f"range ends at byte {end}, past the end of the file ({size})")
        return f, size

    def _send_file(self, tls: TLSStream, f: Any, size: int, deadline: float) -> None:
        head = ANS.pack(b"O", size)
        if not size:
            tls.send_all(head, deadline)
            return
        left = size
        buf = bytearray(len(head) + min(BLOCK, size))
        buf[: len(head)] = head  # the header goes out with the first block
        view = memoryview(buf)
        at = len(head)
        while left:
            n = f.readinto(view[at : at + min(len(buf) - at, left)])
            if not n:
                # the file shrank under us: the client sees a short answer; hang up
                raise Closed(f"file shrank to {size - left} bytes while being sent")
            tls.send_all(view[: at + n], deadline)
            left -= n
            at = 0


class _HelloTimeout(TimeoutError):
    """No ClientHello within the hello deadline."""


_RECORD = 5  # a TLS record's header: type, version, length
_HANDSHAKE, _CLIENT_HELLO = 0x16, 1
_MAX_RECORD = _RECORD + (1 << 14)  # TLS refuses a longer plaintext record itself
_MAX_HELLO = 1 << 16  # bytes of records waited for; a longer ClientHello goes to TLS as is


def _hello_needs(got: bytes) -> int:
    """How many bytes from the stream's start hold the whole ClientHello, given its first
    ``got`` bytes: more than ``len(got)`` while it is incomplete (at least the next record
    header, or that whole record), else 0 (whole, or not a ClientHello the wait is for:
    not a handshake record, a record or a message TLS refuses for its length — the
    handshake then refuses it)."""
    at, body = 0, b""  # the records' payloads so far: the handshake message
    while True:
        if len(got) < at + _RECORD:
            return at + _RECORD
        if got[at] != _HANDSHAKE:
            return 0
        length = int.from_bytes(got[at + 3 : at + 5], "big")
        if length == 0 or _RECORD + length > _MAX_RECORD:
            return 0
        end = at + _RECORD + length
        if end > _MAX_HELLO:
            return 0
        if len(got) < end:
            return end
        body += got[at + _RECORD : end]
        if len(body) >= 4 and (
            body[0] != _CLIENT_HELLO or 4 + int.from_bytes(body[1:4], "big") <= len(body)
        ):
            return 0
        at = end


def _hello(sock: socket.socket, deadline: float) -> None:
    """Wait until the connection's ClientHello has arrived whole (in one TLS record, or
    over several), without reading it (``MSG_PEEK``, with ``SO_RCVLOWAT`` the bytes it
    needs: no busy loop).  Returns at once for bytes that are not a TLS handshake record,
    a record or ClientHello longer than TLS allows, or the end of the stream (the
    handshake then refuses them); :class:`_HelloTimeout` when the ClientHello is not whole
    at ``deadline`` (one already there is taken however late this thread looks)."""
    need = _RECORD
    try:
        while True:
            left = deadline - time.monotonic()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, need)
            sock.settimeout(max(left, 0.0))  # 0: one last look, without waiting
            try:
                got = sock.recv(need, socket.MSG_PEEK)
            except (TimeoutError, BlockingIOError):
                raise _HelloTimeout("no ClientHello in time") from None
            if not got:
                return  # the end of the stream: the handshake refuses it
            more = _hello_needs(got)
            if not more:
                return
            if len(got) >= need and more > need:
                need = more  # the next record's header, or the rest of its record
                continue
            if left <= 0:
                raise _HelloTimeout("no ClientHello in time")
            return  # a waiting peek returns short only at the end of the stream
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)


def _failure(e: OSError, after: float) -> str:
    """What a failed handshake's error says, and when it failed."""
    if isinstance(e, TimeoutError):
        return f"it did not finish within the handshake deadline ({after:.2g}s)"
    if isinstance(e, ssl.SSLCertVerificationError):
        why = f"{e.reason}: {e.verify_message}"
    else:
        why = str(getattr(e, "reason", None) or e)
    return f"it failed after {after:.2g}s ({why})"
