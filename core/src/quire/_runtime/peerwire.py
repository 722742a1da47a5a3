"""The wire format of peer fetches (``peerlink``): framing, MACs, reads with a deadline.

One connection (numbers big-endian)::

    server: b"QUIREP01" + nonce (32 random bytes, fresh per connection)
    client: b"G" + u16 path length + u64 max bytes + path (UTF-8) + MAC   (one per file)
         or b"R" + u16 path length + u64 max bytes + path + u64 start + u64 end + MAC
                                                  (the bytes [start, end) of the file)
    server: b"O" + u64 length + body + MAC        (the file)
         or b"R" + u64 length + reason + MAC      (refused; after a bad MAC it hangs up)

Every MAC is HMAC-SHA256 under the run's secret over a label (``req`` / ``ans``), the
connection's nonce, the request's sequence number on the connection, the request's header
and path (and, in an answer, its header and body).  A request recorded on one connection
fails on another (other nonce) and later on the same one (other sequence number); an
answer is bound to its request, so a client accepts no body that the secret's holder did
not send for that path.
"""

from __future__ import annotations

import hmac
import socket
import struct
import time
from typing import Any

MAGIC = b"QUIREP01"
NONCE = 32
TAG = 32
#: The longest request path a server reads (UTF-8 bytes); longer requests are refused.
MAX_PATH_BYTES = 4096
REQ = struct.Struct("!cHQ")  # b"G" / b"R", path length, max bytes
RANGE = struct.Struct("!QQ")  # after the path of a b"R" request: start, end
ANS = struct.Struct("!cQ")  # b"O" / b"R", length
_SEQ = struct.Struct("!Q")
BLOCK = 1 << 20


def mac(secret: bytes, label: bytes, nonce: bytes, seq: int, *parts: bytes) -> Any:
    h = hmac.new(secret, label, "sha256")
    h.update(nonce)
    h.update(_SEQ.pack(seq))
    for p in parts:
        h.update(p)
    return h


class Closed(Exception):
    """The other side hung up (or was too slow) in the middle of a message."""


def recv_into(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise Closed(f"connection closed after {got} of {len(view)} bytes")
        got += n


def recv(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)
