"""The client side of peer fetches (``link``): the TLS connection to one pinned process,
one connection's requests, the mapping of every failure to a ``PeerError``, and a pool of
connections kept open between calls (messages in ``wire``, certificates in
``tls``)."""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from quire._peers.tls import Pinned
from quire._peers.wire import ANS, BLOCK, MAX_PATH_BYTES, MAX_REASON, REQ, Closed, TLSStream
from quire.errors import PeerError

__all__ = ["Conversation", "LocalWrite", "Pool", "converse", "request_path"]

log = logging.getLogger("quire")

#: The first pause before asking again a server that closed a new connection unanswered
#: (every slot taken); doubled each time, up to :data:`_BUSY_MAX`, within the call's deadline.
_BUSY_FIRST, _BUSY_MAX = 0.02, 0.5


class LocalWrite(Exception):
    """Writing the caller's destination failed (the OSError is its cause)."""


class Conversation:
    """One TLS connection's requests; ``deadline`` and ``fail`` are those of the call it
    serves now (a pooled connection serves several)."""

    def __init__(self, sock: TLSStream, deadline: float, fail: Any) -> None:
        self.sock, self.deadline, self.fail = sock, deadline, fail
        self.current = ""
        self.answering = False  # an answer's first byte has arrived for the current request

    def get(
        self,
        rel: str,
        limit: int,
        into: BinaryIO | list[memoryview] | None,
        span: tuple[int, int] | None = None,
    ) -> bytes | int:
        """The file ``rel`` (at most ``limit`` bytes; only ``span`` = ``[start, end)`` of it
        when given): its bytes, or, written to ``into`` (a file, or buffers exactly as long
        as ``span``), its length."""
        self.current = rel
        self.answering = False
        sock, deadline, fail = self.sock, self.deadline, self.fail
        raw = rel.encode("utf-8")  # checked by the caller (request_path)
        start, end = span if span is not None else (0, 0)
        op = b"G" if span is None else b"R"
        sock.send_all(REQ.pack(op, len(raw), max(0, limit), start, end) + raw, deadline)
        ahead = sock.recv(1, deadline)
        self.answering = True
        status, n = ANS.unpack(ahead + sock.recv(ANS.size - 1, deadline))
        want = None if span is None else end - start
        if (
            status not in (b"O", b"R")
            or (status == b"O" and (n > limit or (want is not None and n != want)))
            or (status == b"R" and n > MAX_REASON)
        ):
            raise fail(
                f"malformed answer (status {status!r}, {n} bytes)",
                "is it a quire peer of this version?",
                hostile=True,
            )
        if status == b"R":
            reason = sock.recv(n, deadline).decode("utf-8", "replace")
            raise fail(
                f"refused: {reason}",
                "the peer does not serve that file: read it from another holder",
            )
        if isinstance(into, list):  # straight into the caller's memory
            for v in into:
                sock.recv_into(v, deadline)
            return n
        if into is None:
            buf = bytearray(n)
            sock.recv_into(memoryview(buf), deadline)
            return bytes(buf)
        block = memoryview(bytearray(min(BLOCK, n)))
        for lo in range(0, n, BLOCK):
            piece = block[: min(BLOCK, n - lo)]
            sock.recv_into(piece, deadline)
            try:
                done = 0
                while done < len(piece):  # a raw file may write part of it
                    done += into.write(piece[done:]) or 0
            except OSError as e:
                raise LocalWrite() from e
        return n


def request_path(address: tuple[str, int], peer: Pinned, rel: str) -> bytes:
    """``rel`` as a request carries it, checked before any connection is made.

    Raises
    ------
    ValueError
        ``rel`` does not encode as UTF-8 (a lone surrogate): no file of any peer has
        that name; the caller's mistake.
    PeerError
        It is longer than :data:`MAX_PATH_BYTES`: peers serve no such path, as when the
        peer refused it (the caller reads another holder).
    """
    try:
        raw = rel.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"peer file {rel!r} does not encode as UTF-8 ({e.reason}): a request names a "
            "file by its UTF-8 path"
        ) from None
    if len(raw) > MAX_PATH_BYTES:
        raise _error(
            address,
            peer,
            rel,
            f"path of {len(raw)} bytes",
            f"peers serve paths of at most {MAX_PATH_BYTES}: read it from another holder",
        )
    return raw


def _error(address: tuple[str, int], peer: Pinned, rel: str, why: str, fix: str) -> PeerError:
    where = f"{address[0]}:{address[1]}"
    return PeerError(f"peer {where} (process {peer.index}), file {rel!r}: {why}; {fix}")


def _handshake(address: tuple[str, int], peer: Pinned, deadline: float, fail: Any) -> TLSStream:
    """A TLS connection to ``address`` that is process ``peer.index`` (checked), asking
    again while the server closes new connections unanswered (every slot taken)."""
    pause = _BUSY_FIRST
    while True:
        sock = socket.create_connection(address, timeout=max(0.001, deadline - time.monotonic()))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tls = TLSStream(sock, peer.context, server_side=False)
            tls.handshake(deadline)
        except (ssl.SSLEOFError, ConnectionResetError, BrokenPipeError):
            sock.close()  # closed before any TLS byte: the server is full; again, if in time
            if time.monotonic() + pause >= deadline:
                raise fail(
                    "the peer kept closing new connections unanswered (all its connection "
                    "slots taken) until the deadline",
                    "treat it as lost and read from another holder",
                ) from None
            time.sleep(pause)
            pause = min(_BUSY_MAX, 2 * pause)
            continue
        except ssl.SSLCertVerificationError as e:
            sock.close()
            raise fail(
                f"its TLS certificate is not one of this run's ({e.verify_message})",
                f"a man in the middle, or not process {peer.index} of this run: check the "
                "address it published",
                hostile=True,
            ) from None
        except ssl.SSLError as e:
            sock.close()
            raise fail(
                f"TLS 1.3 handshake failed ({e})",
                "is it a quire peer of this run (TLS 1.3, certificates of the run)?",
                hostile=True,
            ) from None
        except BaseException:
            sock.close()
            raise
        why = peer.check(tls)
        if why is not None:
            sock.close()
            raise fail(why, "check the address it published", hostile=True)
        return tls


def converse(
    address: tuple[str, int],
    peer: Pinned,
    timeout: float,
    first: str,
    work: Callable[[Conversation], None],
    pool: Pool | None = None,
    *,
    fresh: bool = False,
) -> None:
    """Run ``work`` on a connection to process ``peer.index`` at ``address`` (a fresh one,
    or an idle one of ``pool`` unless ``fresh``, given back after success); every failure
    as a :class:`PeerError`.

    A pooled connection the peer closed while it was idle (its ``idle_timeout``) fails
    before any byte of its answer: the request is sent once more on a fresh connection.
    """
    deadline = time.monotonic() + timeout
    where = f"{address[0]}:{address[1]}"
    conv: Conversation | None = None

    def fail(why: str, fix: str, *, hostile: bool = False) -> PeerError:
        current = conv.current if conv is not None and conv.current else first
        if hostile:  # not what a peer of this run does: say so
            log.warning("peer %s (process %d), file %r: %s", where, peer.index, current, why)
        return _error(address, peer, current, why, fix)

    def attempt(c: Conversation) -> None:
        nonlocal conv
        conv = c
        c.deadline, c.fail = deadline, fail
        try:
            work(c)
        except BaseException:
            c.sock.close()  # in an unknown state: never reused
            raise
        if pool is None or not pool.give(c):
            c.sock.close()

    if pool is not None and pool.address != (str(address[0]), int(address[1])):
        raise ValueError(f"a pool of connections to {pool.address} used for {address}")
    if pool is not None and pool.peer.index != peer.index:
        raise ValueError(f"a pool of process {pool.peer.index} used for process {peer.index}")
    try:
        idle = pool.take() if pool is not None and not fresh else None
        if idle is not None:
            try:
                attempt(idle)
                return
            except (Closed, ConnectionError):
                if idle.answering:
                    raise
                # closed by the peer while idle: once more, on a fresh connection
        c = Conversation(_handshake(address, peer, deadline, fail), deadline, fail)
        if pool is not None:
            pool.opened()
        attempt(c)
    except PeerError:
        raise
    except TimeoutError:
        raise fail(
            f"no answer within the {timeout:g}s deadline",
            "treat the peer as lost and read from another holder",
        ) from None
    except (Closed, ConnectionResetError) as e:
        if isinstance(e, ConnectionResetError) and conv is None:  # before the handshake
            raise fail(
                f"cannot reach the peer ({e})", "treat it as lost and read from another holder"
            ) from e
        # A reset after the handshake is the same refusal as a close: a server that drops
        # a connection with our request still unread in its buffer sends RST, not FIN.
        answering = conv is not None and conv.answering
        raise fail(
            f"short answer ({e})" if answering else f"closed the connection unanswered ({e})",
            "the peer died or dropped the connection"
            if answering
            else "the peer did not accept this process's certificate (not the same run?), "
            "or it died",
            hostile=True,
        ) from None
    except LocalWrite as e:
        assert isinstance(e.__cause__, OSError)
        raise e.__cause__ from None  # writing the caller's file failed: not the peer's doing
    except ssl.SSLError as e:  # after the handshake: an alert, or a record that fails
        if "ALERT" in str(e.reason):
            raise fail(
                f"the peer ended the TLS session ({e.reason})",
                "it did not accept this process's certificate: are both processes of the same run?",
                hostile=True,
            ) from None
        raise fail(
            f"a TLS record failed its check ({e.reason or e})",
            "altered in transit: read from another holder",
            hostile=True,
        ) from None
    except OSError as e:
        raise fail(
            f"cannot reach the peer ({e})", "treat it as lost and read from another holder"
        ) from e


class Pool:
    """Connections to process ``peer.index`` at ``address`` kept open between calls (pass it
    as ``pool=`` to ``link``'s fetches): at most ``size`` idle ones; thread-safe; close
    it (or use it as a context manager) when done."""

    def __init__(self, address: tuple[str, int], peer: Pinned, size: int) -> None:
        self.address, self.peer, self.size = (str(address[0]), int(address[1])), peer, size
        self._idle: list[Conversation] = []
        self._lock = threading.Lock()
        self._closed = False
        self.connections = 0  # connections opened for calls through this pool

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def opened(self) -> None:
        with self._lock:
            self.connections += 1

    def take(self) -> Conversation | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def give(self, conv: Conversation) -> bool:
        """Keep ``conv`` for the next call; False (the caller closes it) when full or closed."""
        with self._lock:
            if self._closed or len(self._idle) >= self.size:
                return False
            self._idle.append(conv)
            return True

    def connect(self, timeout: float) -> None:
        """Open one more connection now (its handshake within ``timeout`` s) and keep it
        idle for a call to come; a :class:`PeerError` as a call's when that fails."""
        converse(self.address, self.peer, timeout, "", _nothing, self, fresh=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.sock.close()


def _nothing(conv: Conversation) -> None:
    """A call that asks nothing (:meth:`Pool.connect`: the handshake alone)."""
