"""Reading files of another process's local tier over TLS 1.3 with mutual authentication.

The fallback transport of peer copies (``docs/peers.md``): where a collective cannot serve
(a restarted process fetching from survivors), a process asks a peer for files of the
peer's local tier by their path relative to it.

* ``run_credentials(key, timeout, tls=None)``: this process's TLS identity (an ephemeral key
  and self-signed certificate, or the user's ``PeerTLS``), its certificate published through
  JAX's distributed key-value store, and every process's certificate read back and pinned.
* ``PeerServer(root, credentials, host, port)``: serves read-only GETs of regular files under
  ``root`` on the interface it is given, in threads of its own, to the run's processes
  (``server.reserve_for(hosts)``: handshake slots for the run's hosts).
* ``publish_address`` / ``lookup_address``: a server's address through the key-value store
  (checked as untrusted input when read).
* ``fetch`` / ``fetch_many`` / ``fetch_to`` (into a file): the client, one deadline per call,
  talking only to the process it names (``credentials.peer(j)``); ``fetch`` and
  ``fetch_many`` also read byte ranges ``[start, end)`` of files, and ``fetch_into`` reads
  one range straight into the caller's buffers.
* ``Pool(address, peer, size)``: connections to one peer kept open between calls
  (``pool=``), for a caller that sends a peer many requests (a restore's range reads);
  ``pool.connect(timeout)`` opens one ahead of the calls.

Certificates and their checks are in ``tls``, the messages in ``wire``; the server
opens files read-only and writes nothing.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import secrets
import ssl
import time
from collections.abc import Sequence
from pathlib import Path

import jax

from quire._peers.connections import Conversation, LocalWrite, Pool, converse, request_path
from quire._peers.files import FsspecFiles
from quire._peers.server import PeerServer
from quire._peers.tls import Credentials, Identity, PeerTLS, Pinned, fingerprint
from quire._peers.wire import MAX_PATH_BYTES
from quire._runtime.multihost import _client, _first_line
from quire.errors import MultiProcessError, PeerError

log = logging.getLogger("quire")

__all__ = [
    "MAX_PATH_BYTES",
    "Credentials",
    "FsspecFiles",
    "PeerServer",
    "PeerTLS",
    "Pinned",
    "Pool",
    "fetch",
    "fetch_into",
    "fetch_many",
    "fetch_to",
    "lookup_address",
    "publish_address",
    "run_credentials",
]


# ====================================================================== the run's certificates
def _ms(deadline: float) -> int:
    return min(2**31 - 1, max(1, int((deadline - time.monotonic()) * 1000)))


def run_credentials(key: str, timeout: float, tls: PeerTLS | None = None) -> Credentials:
    """This process's TLS credentials for the run (blocking; every process calls it once
    with the same ``key``).

    Makes this process's identity (an ephemeral key and a self-signed certificate naming
    it, or the user's ``tls``), publishes its certificate (public data) under
    ``<key>/<process index>`` in JAX's key-value store, and waits for every process's: those
    certificates, and no others, are trusted.  Whoever can change the key-value store can
    therefore put a certificate of their own in place of a process's: it is the trust
    root (``docs/peers.md``).  With one JAX process: this process's certificate only.

    Raises
    ------
    MultiProcessError
        A process did not publish its certificate within ``timeout`` seconds.
    PeerError
        A process published something that is not ASCII text or does not load as a PEM
        certificate (the error names it).
    PluginError
        No ``tls`` and no ``cryptography`` to make the ephemeral certificate.
    """
    me = jax.process_index()
    ident = Identity.from_files(me, tls) if tls is not None else Identity.ephemeral(me)
    if jax.process_count() == 1:
        return ident.trust({me: ident.cert_pem})
    c = _client()
    c.key_value_set(f"{key}/{me}", ident.cert_pem.decode())
    deadline = time.monotonic() + timeout
    certs = {}
    for j in range(jax.process_count()):
        try:
            raw = c.blocking_key_value_get(f"{key}/{j}", _ms(deadline))
        except Exception as e:
            raise MultiProcessError(
                f"process {me} waited {timeout:g}s for process {j} to publish its peer "
                f"certificate under {key!r}; it did not (is it stalled or dead, or not using "
                f"peer copies?): {_first_line(e)}"
            ) from e
        certs[j] = _published_certificate(raw, j, key)
    return ident.trust(certs)


#: The longest certificate (PEM, with its intermediate CAs) a process may publish.
MAX_CERTIFICATE_CHARS = 1 << 16


def _published_certificate(raw: object, index: int, key: str) -> bytes:
    """What process ``index`` published under ``key``, once it loads as PEM certificates
    (on its own, as :meth:`Identity.trust` loads it)."""
    try:
        if not isinstance(raw, str) or len(raw) > MAX_CERTIFICATE_CHARS or not raw.isascii():
            raise ValueError(f"not ASCII text of at most {MAX_CERTIFICATE_CHARS} characters")
        fingerprint(raw)  # ValueError unless its first certificate is PEM
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=raw)
    except (ValueError, ssl.SSLError) as e:
        raise PeerError(
            f"process {index} published a malformed peer certificate under {key!r} "
            f"({str(raw)[:60]!r}...: {e}); no peer link can be made with it (quire "
            "publishes a PEM certificate: does another program write to the run's "
            "coordination service?)"
        ) from None
    return raw.encode()


def publish_address(key: str, address: tuple[str, int]) -> None:
    """Publish this process's server address under ``key`` (read with :func:`lookup_address`).

    Raises
    ------
    ValueError
        ``address`` is not an IP address (a server's :attr:`PeerServer.address` is) and a
        port.
    """
    host, port = address
    _client().key_value_set(f"{key}/{jax.process_index()}", _check_address([host, port]))


#: The longest published address read (an IPv6 address and a port take under 60).
MAX_ADDRESS_CHARS = 256


def _check_address(value: object) -> str:
    """``value`` as published (JSON ``[host, port]``) when it is an IP address and a port
    (1 to 65535), nothing else; ValueError saying what is wrong otherwise."""
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError("not a list of a host and a port")
    host, port = value
    if type(port) is not int or not 0 < port < 65536:
        raise ValueError(f"port {port!r} is not a whole number from 1 to 65535")
    if not isinstance(host, str) or len(host) > 64:
        raise ValueError(f"host {host!r} is not a string of at most 64 characters")
    try:  # a name would be resolved outside the fetch's deadline: addresses only
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"host {host!r} is not an IP address") from None
    return json.dumps([str(ip), port])


def lookup_address(key: str, index: int, timeout: float) -> tuple[str, int]:
    """The address process ``index`` published under ``key``, waiting at most ``timeout`` s.

    What the key-value store holds is checked as untrusted input: a JSON list of an IP
    address and a port from 1 to 65535, nothing else.

    Raises
    ------
    MultiProcessError
        Process ``index`` published nothing within ``timeout``.
    PeerError
        What it published is not such an address (its caller treats that process as
        lost, as for any failed fetch).
    """
    try:
        raw = _client().blocking_key_value_get(f"{key}/{index}", _ms(time.monotonic() + timeout))
    except Exception as e:
        raise MultiProcessError(
            f"process {jax.process_index()} waited {timeout:g}s for process {index} to "
            f"publish its peer address under {key!r}; it did not (is it dead, or serving no "
            f"local tier?): {_first_line(e)}"
        ) from e
    try:
        if not isinstance(raw, str) or len(raw) > MAX_ADDRESS_CHARS:
            raise ValueError(f"not a string of at most {MAX_ADDRESS_CHARS} characters")
        value = json.loads(raw)
        _check_address(value)
    except ValueError as e:  # JSONDecodeError among them
        raise PeerError(
            f"process {index} published a malformed peer address under {key!r} "
            f"({str(raw)[:80]!r}: {e}); treat it as lost and read from another holder (quire "
            "publishes [IP address, port]: does another program write to the run's "
            "coordination service?)"
        ) from None
    return str(value[0]), int(value[1])


# ====================================================================== the client
#: The largest number a request's fields carry (u64: max bytes, a range's start and end).
MAX_U64 = 2**64 - 1


def _check_request(
    what: str,
    address: tuple[str, int],
    peer: Pinned,
    relpaths: Sequence[str],
    max_bytes: int,
    ranges: Sequence[tuple[int, int] | None] = (),
) -> None:
    """Refuse, before connecting, a call whose request cannot be sent: ``ValueError`` for a
    number outside the u64 fields or a range that is not ``0 <= start <= end``, or a path
    that is not UTF-8; ``PeerError`` for a path longer than peers serve
    (:func:`request_path`)."""
    if not 0 <= max_bytes <= MAX_U64:
        raise ValueError(f"{what}: max_bytes {max_bytes} is not from 0 to 2**64 - 1")
    for r in ranges:
        if r is not None and not 0 <= r[0] <= r[1] <= MAX_U64:
            raise ValueError(f"{what}: bad range {r} (0 <= start <= end < 2**64)")
    for rel in relpaths:
        request_path(address, peer, rel)


def fetch(
    address: tuple[str, int],
    relpath: str,
    peer: Pinned,
    timeout: float,
    max_bytes: int,
    start: int | None = None,
    end: int | None = None,
    *,
    pool: Pool | None = None,
) -> bytes:
    """The file ``relpath`` of the peer at ``address`` (blocking; at most ``timeout`` s).

    Parameters
    ----------
    address : (str, int)
        The peer's :attr:`PeerServer.address` (see :func:`lookup_address`).
    relpath : str
        The file, relative to the peer's served directory, ``/``-separated.
    peer : Pinned
        The process at ``address`` (``credentials.peer(index)``): the answer is accepted
        only from it.
    timeout : float
        Seconds for the whole call: connecting, asking and reading.
    max_bytes : int
        The longest file accepted; the peer refuses a longer one.  With a range: the
        longest range accepted.
    start, end : int, optional
        Only the bytes ``[start, end)`` of the file (both or neither); the peer refuses a
        range that ends past the end of the file.

    Raises
    ------
    PeerError
        The peer refused, is not the process meant (its certificate), answered short
        or not in time; or ``relpath`` is longer than :data:`MAX_PATH_BYTES`, which no peer
        serves (raised before connecting).
    ValueError
        Before connecting: ``max_bytes``, ``start`` or ``end`` outside 0 to 2**64 - 1, or
        ``start > end``; ``relpath`` does not encode as UTF-8.
    """
    if (start is None) != (end is None):
        raise ValueError("fetch: give both start and end, or neither")
    ranges = None if start is None or end is None else [(start, end)]
    return fetch_many(address, [relpath], peer, timeout, max_bytes, ranges, pool=pool)[0]


def fetch_many(
    address: tuple[str, int],
    relpaths: Sequence[str],
    peer: Pinned,
    timeout: float,
    max_bytes: int,
    ranges: Sequence[tuple[int, int] | None] | None = None,
    *,
    pool: Pool | None = None,
) -> list[bytes]:
    """Several files (or ranges ``[start, end)`` of files, ``ranges[i]`` for
    ``relpaths[i]``) of one peer over one connection, in order (see :func:`fetch`).

    ``max_bytes`` bounds the answers together; ``timeout`` the whole call.
    """
    out: list[bytes] = []
    if ranges is not None and len(ranges) != len(relpaths):
        raise ValueError("fetch_many: one range (or None) per path")
    _check_request("fetch_many", address, peer, relpaths, max_bytes, ranges or ())

    def work(conv: Conversation) -> None:
        left = max_bytes
        for i, rel in enumerate(relpaths):
            got = conv.get(rel, left, None, None if ranges is None else ranges[i])
            assert isinstance(got, bytes)
            out.append(got)
            left -= len(got)

    converse(address, peer, timeout, relpaths[0] if relpaths else "", work, pool)
    return out


def fetch_into(
    address: tuple[str, int],
    relpath: str,
    peer: Pinned,
    timeout: float,
    buffers: Sequence[memoryview],
    start: int,
    *,
    pool: Pool | None = None,
) -> int:
    """Read the bytes ``[start, start + len(buffers))`` of the peer's file ``relpath``
    straight into ``buffers`` (in order; no copy); their length.

    As :func:`fetch` with a range.  The buffers are filled as the answer arrives: when the
    call then fails (``PeerError``: a short answer, a TLS record that does not decrypt),
    what they hold is not to be used.
    """
    views = [memoryview(b) for b in buffers]
    total = sum(v.nbytes for v in views)
    _check_request("fetch_into", address, peer, [relpath], total, [(start, start + total)])
    n = 0

    def work(conv: Conversation) -> None:
        nonlocal n
        got = conv.get(relpath, total, views, (start, start + total))
        assert isinstance(got, int)
        n = got

    converse(address, peer, timeout, relpath, work, pool)
    return n


def fetch_to(
    address: tuple[str, int],
    relpath: str,
    peer: Pinned,
    timeout: float,
    max_bytes: int,
    dest: str | os.PathLike[str],
) -> int:
    """Stream the file ``relpath`` of a peer into the new file ``dest``; its length.

    Like :func:`fetch`, without holding the file in memory: the bytes go to a temporary
    file beside ``dest`` (``<dest>.part-<random>``), which becomes ``dest`` (an atomic
    rename, replacing it) only once the whole answer has arrived; on any failure
    it is removed.  The caller picks ``dest`` (inside its own tier); nothing the peer
    sends chooses where bytes are written.

    Raises
    ------
    PeerError
        As :func:`fetch`; ``dest`` is then untouched.
    ValueError
        As :func:`fetch`, before connecting.
    """
    _check_request("fetch_to", address, peer, [relpath], max_bytes)
    target = Path(dest)
    part = target.with_name(f"{target.name}.part-{secrets.token_hex(4)}")
    n = 0

    def work(conv: Conversation) -> None:
        nonlocal n
        try:
            # unbuffered: every write error surfaces in conv.get, none at close
            f = open(part, "xb", buffering=0)  # noqa: SIM115 - closed just below
        except OSError as e:
            raise LocalWrite() from e
        with f:
            got = conv.get(relpath, max_bytes, f)
            assert isinstance(got, int)
            n = got

    try:
        converse(address, peer, timeout, relpath, work)
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    return n
