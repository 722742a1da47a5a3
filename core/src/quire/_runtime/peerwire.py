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

**Fast bodies.**  HMAC-SHA256 runs at about 2 GB/s per core; a server that can compute
Poly1305 (the ``cryptography`` package importable) greets with ``QUIREP02`` instead of
``QUIREP01``, and a client that can too then asks with ``g`` / ``r`` instead of ``G`` /
``R``.  The answer to such a request is MACed as above, except that the body enters the
HMAC as its Poly1305 tag under a one-time key, ``HMAC-SHA256(secret, "key" + nonce +
sequence number)``: never used twice (one answer per sequence number, a fresh nonce per
connection) and never sent, so the body stays bound to the secret, the request and the
connection (a forgery succeeds with probability about ``length / 2**106``), at about 13
GB/s.  The request's MAC covers the letter, so an attacker cannot switch it; altering the
greeting only makes the client ask for HMAC-SHA256 bodies (or be refused).
"""

from __future__ import annotations

import hmac
import socket
import struct
import time
from typing import Any

try:
    from cryptography.hazmat.primitives import poly1305 as _poly1305
except ImportError:  # pragma: no cover - cryptography is usually installed
    _poly1305 = None  # type: ignore[assignment]

#: The greeting of a server that MACs bodies with HMAC-SHA256 only, and of one that can
#: also use Poly1305 (``g`` / ``r`` requests).
BASE_MAGIC, FAST_MAGIC = b"QUIREP01", b"QUIREP02"
FAST = _poly1305 is not None
MAGIC = FAST_MAGIC if FAST else BASE_MAGIC  # what this process's server sends
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


class _FastAnswer:
    """An answer's MAC whose body goes in as its Poly1305 tag under a one-time key."""

    def __init__(self, secret: bytes, nonce: bytes, seq: int, parts: tuple[bytes, ...]) -> None:
        assert _poly1305 is not None
        key = hmac.new(secret, b"key", "sha256")
        key.update(nonce)
        key.update(_SEQ.pack(seq))
        self._body = _poly1305.Poly1305(key.digest())
        self._head = mac(secret, b"ans", nonce, seq, *parts)
        self._tag: bytes | None = None

    def update(self, data: Any) -> None:
        self._body.update(data)

    def digest(self) -> bytes:
        if self._tag is None:
            self._head.update(self._body.finalize())
            self._tag = self._head.digest()
        return self._tag


def answer_mac(secret: bytes, nonce: bytes, seq: int, fast: bool, *parts: bytes) -> Any:
    """The MAC of an answer (``update`` with the body, then ``digest``): ``parts`` are the
    request (path and range) and the answer's header; ``fast``: the request was ``g`` / ``r``."""
    if fast:
        return _FastAnswer(secret, nonce, seq, parts)
    return mac(secret, b"ans", nonce, seq, *parts)


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
