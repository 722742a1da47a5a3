"""The client side of peer fetches (``peerlink``): one connection's conversation, the
connect-and-greet, the mapping of every failure to a ``PeerError``, and a pool of
connections kept open between calls (wire format in ``peerwire``)."""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from quire._runtime.peerwire import (
    ANS,
    BASE_MAGIC,
    BLOCK,
    FAST,
    FAST_MAGIC,
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
    recv_into,
)
from quire.errors import PeerError

__all__ = ["Conversation", "LocalWrite", "Pool", "converse"]

log = logging.getLogger("quire")


class LocalWrite(Exception):
    """Writing the caller's destination failed (the OSError is its cause)."""


class Conversation:
    """One connection's requests, numbered from 0 (see ``peerwire``); ``deadline`` and
    ``fail`` are those of the call it serves now (a pooled connection serves several)."""

    def __init__(
        self, sock: socket.socket, nonce: bytes, secret: bytes, deadline: float, fail: Any
    ) -> None:
        self.sock, self.nonce, self.secret = sock, nonce, secret
        self.deadline, self.fail = deadline, fail
        self.seq = 0
        self.current = ""
        self.answering = False  # an answer's first byte has arrived for the current request
        self.fast = False  # the server greeted with FAST_MAGIC and Poly1305 is here too

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
        seq, self.seq = self.seq, self.seq + 1
        sock, deadline, fail = self.sock, self.deadline, self.fail
        raw = rel.encode("utf-8")
        if len(raw) > MAX_PATH_BYTES:
            raise fail(
                f"path of {len(raw)} bytes", f"peers serve paths of at most {MAX_PATH_BYTES}"
            )
        rng = b"" if span is None else RANGE.pack(*span)
        op = b"G" if span is None else b"R"
        if self.fast:  # the body's MAC through Poly1305 (``peerwire``)
            op = op.lower()
        head = REQ.pack(op, len(raw), max(0, limit))
        sock.sendall(
            head + raw + rng + mac(self.secret, b"req", self.nonce, seq, head, raw, rng).digest()
        )
        ahead = recv(sock, 1, deadline)
        self.answering = True
        ahead += recv(sock, ANS.size - 1, deadline)
        status, n = ANS.unpack(ahead)
        want = None if span is None else span[1] - span[0]
        if status not in (b"O", b"R") or (
            status == b"O" and (n > limit or (want is not None and n != want))
        ):
            raise fail(
                f"malformed answer (status {status!r}, {n} bytes)",
                "is it a quire peer?",
                hostile=True,
            )
        if status == b"R" and n > 4 * MAX_PATH_BYTES:
            raise fail("malformed refusal", "is it a quire peer?", hostile=True)
        h = answer_mac(self.secret, self.nonce, seq, self.fast, raw + rng, ahead)
        if isinstance(into, list) and status == b"O":  # straight into the caller's memory
            for v in into:
                flat = v.cast("B") if v.format != "B" or v.ndim != 1 else v
                for lo in range(0, flat.nbytes, BLOCK):
                    recv_into(sock, flat[lo : lo + BLOCK], deadline)
                    h.update(flat[lo : lo + BLOCK])
        elif into is None or status == b"R":
            buf = bytearray(n)
            view = memoryview(buf)
            for lo in range(0, n, BLOCK):
                recv_into(sock, view[lo : lo + BLOCK], deadline)
                h.update(view[lo : lo + BLOCK])
        else:
            assert not isinstance(into, list)
            block = memoryview(bytearray(min(BLOCK, n)))
            for lo in range(0, n, BLOCK):
                piece = block[: min(BLOCK, n - lo)]
                recv_into(sock, piece, deadline)
                h.update(piece)
                try:
                    done = 0
                    while done < len(piece):  # a raw file may write part of it
                        done += into.write(piece[done:]) or 0
                except OSError as e:
                    raise LocalWrite() from e
        tag = recv(sock, TAG, deadline)
        good = hmac.compare_digest(tag, h.digest())
        if status == b"R":
            reason = buf.decode("utf-8", "replace")
            if not good:
                raise fail(
                    f"refused, and the refusal does not authenticate ({reason})",
                    "the two processes hold different secrets: are they the same run?",
                    hostile=True,
                )
            raise fail(
                f"refused: {reason}",
                "the peer does not serve that file: read it from another holder",
            )
        if not good:
            raise fail(
                "the answer does not authenticate (altered in transit, or another secret)",
                "check that both processes are the same run; read from another holder",
                hostile=True,
            )
        return n if into is not None else bytes(buf)


def converse(
    address: tuple[str, int],
    secret: bytes,
    timeout: float,
    first: str,
    work: Callable[[Conversation], None],
    pool: Pool | None = None,
) -> None:
    """Run ``work`` on a connection to ``address`` (a fresh one, or an idle one of
    ``pool``, given back after success); every failure as a :class:`PeerError`.

    A pooled connection the peer closed while it was idle (its ``idle_timeout``) fails
    before any byte of its answer: the request is sent once more on a fresh connection.
    """
    deadline = time.monotonic() + timeout
    where = f"{address[0]}:{address[1]}"
    conv: Conversation | None = None

    def fail(why: str, fix: str, *, hostile: bool = False) -> PeerError:
        current = conv.current if conv is not None and conv.current else first
        if hostile:  # an answer that is not what a peer of this run sends: say so
            log.warning("peer %s: refused its answer for %r: %s", where, current, why)
        return PeerError(f"peer {where}, file {current!r}: {why}; {fix}")

    def fresh() -> Conversation:
        sock = socket.create_connection(address, timeout=max(0.001, deadline - time.monotonic()))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = recv(sock, len(MAGIC) + NONCE, deadline)
            if hello[: len(MAGIC)] not in (BASE_MAGIC, FAST_MAGIC):
                raise fail(
                    "the server is not a quire peer (bad greeting)",
                    "check the address the peer published",
                    hostile=True,
                )
        except BaseException:
            sock.close()
            raise
        c = Conversation(sock, hello[len(MAGIC) :], secret, deadline, fail)
        c.fast = FAST and hello[: len(MAGIC)] == FAST_MAGIC
        return c

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
    try:
        idle = pool.take() if pool is not None else None
        if idle is not None:
            try:
                attempt(idle)
                return
            except (Closed, ConnectionError):
                if idle.answering:
                    raise
                # closed by the peer while idle: once more, on a fresh connection
        c = fresh()
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
    except Closed as e:
        raise fail(
            f"short answer ({e})", "the peer died or dropped the connection", hostile=True
        ) from None
    except LocalWrite as e:
        assert isinstance(e.__cause__, OSError)
        raise e.__cause__ from None  # writing the caller's file failed: not the peer's doing
    except OSError as e:
        raise fail(
            f"cannot reach the peer ({e})", "treat it as lost and read from another holder"
        ) from e


class Pool:
    """Connections to the peer at ``address`` kept open between calls (pass it as
    ``pool=`` to ``peerlink``'s fetches): at most ``size`` idle ones; thread-safe; close
    it (or use it as a context manager) when done.  Each connection
    keeps its own nonce and sequence numbers, so reuse changes nothing of what the MACs
    bind (``peerwire``)."""

    def __init__(self, address: tuple[str, int], size: int) -> None:
        self.address, self.size = (str(address[0]), int(address[1])), size
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

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.sock.close()
