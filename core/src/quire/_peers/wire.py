"""The messages of peer fetches (``link``) and the TLS 1.3 connection that carries them,
read and written against one deadline.

After the handshake (``tls``: both sides present a pinned certificate), numbers
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

:class:`TLSStream` runs ``ssl``'s TLS over memory BIOs and moves the socket's bytes itself,
in large reads and writes: ``ssl.SSLSocket`` makes a system call (and, on a busy machine, a
wait for the scheduler) per 16 KiB record each way, which made a transfer several times
slower than the records' AES-GCM.  It also keeps the deadline whole: one for the handshake,
one per message, never one per read.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from typing import Any

#: The longest request path a server reads (UTF-8 bytes); longer requests are refused.
MAX_PATH_BYTES = 4096
#: The longest refusal reason a client reads.
MAX_REASON = 4 * MAX_PATH_BYTES
REQ = struct.Struct("!cHQQQ")  # b"G" / b"R", path length, max bytes, start, end
ANS = struct.Struct("!cQ")  # b"O" / b"R", length
BLOCK = 1 << 20
_READ = 1 << 18  # the most one socket read takes (a buffer of this size per connection)


class Closed(Exception):
    """The other side hung up in the middle of a message (or before its first byte)."""


class TLSStream:
    """A TLS connection over the connected socket ``sock`` (``ctx`` made by ``tls``);
    :meth:`handshake` first.  Not thread-safe: one user at a time."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, server_side: bool) -> None:
        self.sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = ctx.wrap_bio(self._in, self._out, server_side=server_side)
        self._buf = memoryview(bytearray(_READ))

    # ------------------------------------------------------------------ the socket
    def _timeout(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        self.sock.settimeout(left)

    def _flush(self, deadline: float) -> None:
        """Send what TLS has written (records, alerts)."""
        while self._out.pending:
            data = memoryview(self._out.read())
            sent = 0
            while sent < len(data):
                self._timeout(deadline)
                sent += self.sock.send(data[sent:])

    def _fill(self, deadline: float) -> None:
        """Hand TLS what the socket has (at least a byte, or the end of the stream)."""
        self._timeout(deadline)
        n = self.sock.recv_into(self._buf)
        if n:
            self._in.write(self._buf[:n])
        else:
            self._in.write_eof()

    # ------------------------------------------------------------------ TLS
    def handshake(self, deadline: float) -> None:
        """The TLS handshake, all of it before ``deadline``."""
        while True:
            try:
                self.tls.do_handshake()
                self._flush(deadline)
                return
            except ssl.SSLWantReadError:
                self._flush(deadline)
                self._fill(deadline)
            except ssl.SSLError:
                self._flush(deadline)  # the alert, so that the other side learns why
                raise

    def recv_into(self, view: memoryview, deadline: float) -> None:
        """Fill ``view`` before ``deadline``, however the bytes arrive; :class:`Closed`
        when the other side hangs up first."""
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        got = 0
        while got < len(view):
            try:
                n = int(self.tls.read(len(view) - got, view[got:]))  # type: ignore[arg-type]
            except ssl.SSLWantReadError:
                self._fill(deadline)
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError) as e:
                raise Closed(f"connection closed after {got} of {len(view)} bytes") from e
            if n == 0:
                raise Closed(f"connection closed after {got} of {len(view)} bytes")
            got += n

    def recv(self, n: int, deadline: float) -> bytes:
        buf = bytearray(n)
        self.recv_into(memoryview(buf), deadline)
        return bytes(buf)

    def send_all(self, data: Any, deadline: float) -> None:
        """Send all of ``data`` (bytes or a buffer) before ``deadline``."""
        view = memoryview(data).cast("B")
        for lo in range(0, len(view), BLOCK):  # a bounded amount of records in memory
            self.tls.write(view[lo : lo + BLOCK])
            self._flush(deadline)

    def getpeercert(self, binary_form: bool = False) -> Any:
        return self.tls.getpeercert(binary_form)

    def version(self) -> str | None:
        return self.tls.version()

    def close(self) -> None:
        self.sock.close()
