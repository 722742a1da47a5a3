"""One peer-link connection alone: ``TLSStream`` (TLS 1.3 over memory BIOs, as the peer link
sends a pack) against the bare socket, MiB/s and CPU per GiB at each end, in one run.

Run from the repository root::

    .venv/bin/python benchmarks/bench_tls_stream.py                      # 512 MiB, 5 reps
    .venv/bin/python benchmarks/bench_tls_stream.py --mib 1024 --reps 7
    .venv/bin/python benchmarks/bench_tls_stream.py --aes128             # + an experiment

Two processes on 127.0.0.1 (this one and a forked sender; no JAX): the sender writes
``--mib`` MiB in 16 MiB messages from one buffer, the receiver reads them into one buffer,
so only the stream is measured (no files, no pool, no requests; ``bench_peers`` measures
those).  Ways, interleaved in every repetition:

* **tls**: ``quire._peers.wire.TLSStream`` (``send_all`` / ``recv_into``) after a handshake
  with the ephemeral pinned certificates (``tls.Identity``), the suite OpenSSL picks
  (TLS_AES_256_GCM_SHA384);
* **clear**: ``socket.sendall`` / ``recv_into`` on the same kind of connection
  (``TCP_NODELAY``), no TLS at all: the floor any TLS adds to;
* **tls-aes128** (``--aes128``, an experiment, nothing quire does): the same as **tls**
  with TLS 1.3 limited to TLS_AES_128_GCM_SHA256.  Python 3.11's ``ssl`` cannot choose a
  TLS 1.3 suite, so this calls OpenSSL's ``SSL_CTX_set_ciphersuites`` through ``ctypes`` on
  the ``SSL_CTX`` pointer that CPython keeps right after a context object's header; the
  negotiated suite is checked before it is timed.

MiB/s is the receiver's wall time from the first byte asked to the last one read; CPU is
``os.times()`` (user + system) of each end over the same transfer, per GiB.  The medians
(and the best MiB/s) of ``--reps``.  Right before each timed transfer both ends touch and
free ~3x their buffers (memory left free is handed back to the host on some VMs and is slow
to touch again).  Everything runs on ONE machine: on a small VM both ends share the cores,
so compare the ways within one run.
"""

from __future__ import annotations

import argparse
import os
import socket
import ssl
import statistics
import struct
import time
from typing import Any

from quire._peers import tls as _tls
from quire._peers.wire import TLSStream

MSG = 16 << 20
AES128 = b"TLS_AES_128_GCM_SHA256"


def prewarm(n: int) -> None:
    b = bytearray(3 * n)
    b[::4096] = b"\1" * len(b[::4096])
    del b


def cpu() -> float:
    t = os.times()
    return t.user + t.system


def limit_to_aes128(ctx: ssl.SSLContext) -> None:
    """The experiment: TLS 1.3 suites of ``ctx`` limited to AES-128-GCM (CPython only)."""
    import _ssl
    import ctypes

    lib = ctypes.CDLL(_ssl.__file__)
    fn = lib.SSL_CTX_set_ciphersuites
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_int
    ptr = ctypes.c_void_p.from_address(id(ctx) + object.__basicsize__).value
    if fn(ptr, AES128) != 1:
        raise RuntimeError("SSL_CTX_set_ciphersuites refused TLS_AES_128_GCM_SHA256")


def contexts(aes128: bool) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    ids = [_tls.Identity.ephemeral(0), _tls.Identity.ephemeral(1)]
    certs = {i.index: i.cert_pem for i in ids}
    server, client = ids[0].trust(certs).server_context, ids[1].trust(certs).client_context
    if aes128:
        limit_to_aes128(server)
        limit_to_aes128(client)
    return server, client


def open_end(
    sock: socket.socket, way: str, ctx: ssl.SSLContext, server_side: bool
) -> tuple[TLSStream | None, float]:
    """One end of a connection made for ``way``: its TLS stream (None: the bare socket)
    after the handshake, and the deadline of every call on it."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    deadline = time.monotonic() + 600
    if way == "clear":
        return None, deadline
    stream = TLSStream(sock, ctx, server_side=server_side)
    stream.handshake(deadline)
    return stream, deadline


def sender(lsock: socket.socket, way: str, server: ssl.SSLContext, total: int) -> None:
    """The forked end: accept one connection, send ``total`` bytes, report its CPU."""
    sock, _ = lsock.accept()
    stream, deadline = open_end(sock, way, server, server_side=True)
    buf = bytearray(os.urandom(1 << 20) * (MSG >> 20))
    prewarm(MSG)
    sock.recv(1)  # the receiver is ready
    c0 = cpu()
    for _ in range(total // MSG):
        if stream is None:
            sock.sendall(buf)
        else:
            stream.send_all(buf, deadline)
    spent = cpu() - c0
    sock.recv(1)  # the receiver has it all
    sock.sendall(struct.pack("!d", spent))
    sock.close()


def one(way: str, ctxs: dict[str, tuple[ssl.SSLContext, ssl.SSLContext]], mib: int) -> Any:
    total = mib << 20
    server, client = ctxs[way]
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            sender(lsock, way, server, total)
        finally:
            os._exit(0)
    sock = socket.create_connection(lsock.getsockname())
    lsock.close()
    stream, deadline = open_end(sock, way, client, server_side=False)
    if stream is not None:
        suite = stream.tls.cipher()[0]  # type: ignore[index]
        if way == "tls-aes128" and suite != AES128.decode():
            raise RuntimeError(f"negotiated {suite}, not {AES128.decode()}")
    out = memoryview(bytearray(MSG))
    prewarm(MSG)
    sock.sendall(b"g")
    t0, c0 = time.perf_counter(), cpu()
    for _ in range(total // MSG):
        if stream is None:
            got = 0
            while got < MSG:
                n = sock.recv_into(out[got:])
                if not n:
                    raise ConnectionError("sender hung up")
                got += n
        else:
            stream.recv_into(out, deadline)
    wall, spent = time.perf_counter() - t0, cpu() - c0
    sock.sendall(b"d")
    (sent_cpu,) = struct.unpack("!d", sock.recv(8, socket.MSG_WAITALL))
    sock.close()
    os.waitpid(pid, 0)
    gib = total / (1 << 30)
    return mib / wall, sent_cpu / gib, spent / gib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="bytes per transfer (MiB, 16 MiB steps)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--aes128", action="store_true", help="add the AES-128-GCM experiment")
    args = ap.parse_args()
    mib = max(16, args.mib // 16 * 16)
    plain = contexts(False)
    ctxs = {"tls": plain, "clear": plain}  # (the bare socket uses none)
    if args.aes128:
        ctxs["tls-aes128"] = contexts(True)
    ways = list(ctxs)
    for way in ways:
        one(way, ctxs, 16)  # untimed: imports, first handshakes
    got: dict[str, list[Any]] = {w: [] for w in ways}
    for _ in range(args.reps):
        for way in ways:
            got[way].append(one(way, ctxs, mib))
    print(f"{mib} MiB per transfer, {args.reps} reps; medians (best MiB/s)")
    print("| way | MiB/s | sender CPU s/GiB | receiver CPU s/GiB | / clear MiB/s |")
    print("|---|---|---|---|---|")
    clear = statistics.median(r[0] for r in got["clear"])
    for way in ways:
        rates = [r[0] for r in got[way]]
        rate = statistics.median(rates)
        send = statistics.median(r[1] for r in got[way])
        recv = statistics.median(r[2] for r in got[way])
        print(
            f"| {way} | {rate:.0f} ({max(rates):.0f}) | {send:.2f} | {recv:.2f} | "
            f"{rate / clear:.2f} |"
        )


if __name__ == "__main__":
    main()
