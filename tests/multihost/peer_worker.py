"""One JAX process of the peer-transport test (launched by ``tests/test_peers_multihost.py``).

Usage (through ``harness.launch``, 2 CPU devices per process)::

    python tests/multihost/peer_worker.py WORKDIR JSON

Prints one ``QUIRE-MH {...}`` line per result; the parent asserts on them.  In order:

1. ``ring``: ``ring_shift`` by each shift of ``args["shifts"]``, each process sending
   ``payload(i, size)`` with sizes that differ per process (one empty), in rounds of
   ``args["round_bytes"]``; reports the sha256 of what arrived and its length.  Then a
   shift of a float64 buffer (``floats``).
2. ``peer``: ``run_credentials`` (each process's certificate through the key-value store);
   a ``PeerServer`` on this process's tier directory, published with ``publish_address``;
   a ``fetch`` of the next process's pack through ``lookup_address``; the same address
   asked as if it were another process (refused: its certificate is not that process's),
   and by a client whose certificate is none of the run's (refused by the server).
3. ``mismatch``: process 0 passes another ``round_bytes``: every process must raise.
4. ``late``: every process but the last calls ``ring_shift`` with a 2 s timeout, the last
   does not: the others must raise ``MultiProcessError`` naming it within the timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import ssl
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from worker_harness import init, report

from quire._peers import link
from quire._peers.tls import Identity
from quire._runtime.collective import ring_shift
from quire.errors import MultiProcessError, PeerError

PID, NPROC = 0, 1
WORKDIR = Path(".")
ARGS: dict[str, Any] = {}


def emit(check: str, **kw: Any) -> None:
    report(check=check, **kw)


def payload(i: int, size: int) -> bytes:
    """Deterministic bytes that differ per process and position."""
    seed = hashlib.sha256(f"peer-{i}".encode()).digest()
    reps = -(-size // len(seed))
    raw = bytearray((seed * reps)[:size])
    for k in range(0, size, 4099):
        raw[k] = (k // 4099 + i) % 256
    return bytes(raw)


def barrier(name: str) -> None:
    from jax._src import distributed

    client = distributed.global_state.client
    assert client is not None
    client.wait_at_barrier(f"peer-{name}", 60_000)


def ring() -> None:
    sizes = ARGS["sizes"]
    mine = payload(PID, sizes[PID])
    for shift in ARGS["shifts"]:
        t = time.monotonic()
        got = ring_shift(f"test/ring/{shift}", mine, shift, 30.0, round_bytes=ARGS["round_bytes"])
        emit(
            "ring",
            shift=shift,
            length=len(got),
            sha=hashlib.sha256(got).hexdigest(),
            seconds=time.monotonic() - t,
        )
    # a buffer of 8-byte items: its bytes travel, not its item count
    import numpy as np

    src = (PID - 1) % NPROC
    got = ring_shift("test/ring/floats", memoryview(np.arange(1000 * PID, dtype=np.float64)), 1, 30)
    emit("floats", ok=got == np.arange(1000 * src, dtype=np.float64).tobytes())


def peer() -> None:
    creds = link.run_credentials("test/certs", 30.0)
    tier = WORKDIR / f"tier{PID}"
    (tier / "packs").mkdir(parents=True)
    body = payload(100 + PID, ARGS["pack_bytes"])
    (tier / "packs" / f"p{PID:05d}").write_bytes(body)
    with link.PeerServer(tier, creds) as server:
        link.publish_address("test/peers", server.address)
        nxt, other = (PID + 1) % NPROC, (PID + 2) % NPROC
        where = link.lookup_address("test/peers", nxt, 30.0)
        got = link.fetch(where, f"packs/p{nxt:05d}", creds.peer(nxt), 30.0, 1 << 30)
        refusals = []
        stranger = Identity.ephemeral(PID)  # of no run: it knows nxt's certificate only
        their = ssl.DER_cert_to_PEM_cert(_cert_at(where)).encode()
        for who in (
            creds.peer(other),
            stranger.trust({PID: stranger.cert_pem, nxt: their}).peer(nxt),
        ):
            try:
                link.fetch(where, f"packs/p{nxt:05d}", who, 30.0, 1 << 30)
                refusals.append(None)
            except PeerError as e:
                refusals.append(str(e))
        pins = sorted(creds.peer(j).fingerprint.hex() for j in creds.processes)
        emit(
            "peer",
            mine=creds.peer(PID).fingerprint.hex(),
            pins=hashlib.sha256("".join(pins).encode()).hexdigest(),
            address=list(where),
            fetched=hashlib.sha256(got).hexdigest(),
            other_process=refusals[0],
            stranger=refusals[1],
        )
        barrier("fetched")  # keep serving until every process has fetched


def _cert_at(address: tuple[str, int]) -> bytes:
    """The certificate the server at ``address`` presents (unverified: it is public)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(address, timeout=10) as sock, ctx.wrap_socket(sock) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def mismatch() -> None:
    rb = 1 << 16 if PID == 0 else 1 << 17
    try:
        ring_shift("test/mismatch", b"x", 1, 30.0, round_bytes=rb)
        emit("mismatch", error=None)
    except MultiProcessError as e:
        emit("mismatch", error=str(e))


def late() -> None:
    if PID == NPROC - 1:
        emit("late", skipped=True)
        return
    t = time.monotonic()
    try:
        ring_shift("test/late", b"x", 1, 2.0)
        emit("late", error=None)
    except MultiProcessError as e:
        emit("late", error=str(e), seconds=time.monotonic() - t)


def main() -> None:
    global PID, NPROC, WORKDIR, ARGS
    WORKDIR = Path(sys.argv[1])
    ARGS = json.loads(sys.argv[2])
    me = init(initialization_timeout=60)
    PID, NPROC = me.process, me.processes
    try:
        ring()
        peer()
        mismatch()
        late()
    except BaseException as e:
        emit("crashed", failed=f"{type(e).__name__}: {e}", tb=traceback.format_exc()[-3000:])
        sys.stdout.flush()
        os._exit(2)
    emit("done")
    sys.stdout.flush()
    # the late ring shift left keys behind and the last process never joined it: no
    # shutdown barrier, just leave
    os._exit(0)


if __name__ == "__main__":
    main()
