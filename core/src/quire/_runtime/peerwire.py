"""The messages of peer fetches (``peerlink``) inside a TLS 1.3 connection, and reads and
writes that keep one deadline.

After the handshake (``peertls``: both sides present a pinned certificate), numbers
big-endian::

    client: REQ = op (b"G": the whole file, b"R": the bytes [start, end) of it)
                  + u16 path length + u64 max bytes + u64 start + u64 end   (27 bytes)
            then the path (UTF-8, at most MAX_PATH_BYTES)
    server: ANS = b"O" + u64 length, then the body      (the file or the range)
             or   b"R" + u64 length, then the reason    (refused; at most MAX_REASON)

A connection carries requests one after the other.  Every length is read whole (a message
split over TCP segments or TLS records is read on) and bounded before anything is
allocated: the path by :data:`MAX_PATH_BYTES`, a body by the request's maximum, a reason by
:data:`MAX_REASON`.  Integrity, replay and who-is-who are TLS's: nothing here is a MAC.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time

#: The longest request path a server reads (UTF-8 bytes); longer requests are refused.
MAX_PATH_BYTES = 4096
#: The longest refusal reason a client reads.
MAX_REASON = 4 * MAX_PATH_BYTES
REQ = struct.Struct("!cHQQQ")  # b"G" / b"R", path length, max bytes, start, end
ANS = struct.Struct("!cQ")  # b"O" / b"R", length
BLOCK = 1 << 20


class Closed(Exception):
    """The other side hung up in the middle of a message (or before its first byte)."""


def _left(sock: socket.socket, deadline: float | None) -> None:
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(left)


def recv_into(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    """Fill ``view`` from ``sock`` before ``deadline`` (``time.monotonic``), however the
    bytes arrive; :class:`Closed` when the other side hangs up first."""
    got = 0
    while got < len(view):
        _left(sock, deadline)
        try:
            n = sock.recv_into(view[got:])
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError) as e:
            raise Closed(f"connection closed after {got} of {len(view)} bytes") from e
        if n == 0:
            raise Closed(f"connection closed after {got} of {len(view)} bytes")
        got += n


def recv(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def send_all(sock: socket.socket, data: bytes | memoryview, deadline: float | None) -> None:
    """Send all of ``data`` before ``deadline`` (one deadline, not one per write)."""
    view = memoryview(data).cast("B")
    sent = 0
    while sent < len(view):
        _left(sock, deadline)
        try:
            sent += sock.send(view[sent:])
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError) as e:
            raise Closed(f"connection closed after {sent} of {len(view)} bytes sent") from e
