"""Which connections a peer server (``server``) takes, and which hold its handshake slots.

A connection counts against ``max_connections`` (in all) and ``max_per_address`` (from its
client's address) until it closes, and holds a **handshake slot** from its accept until its
TLS handshake ends (done, failed or cut).  The handshake slots are the scarce part: anyone
who can reach the port can open a connection and say nothing, and until the handshake ends
nobody knows whether it is a process of the run.  They are kept in two pools:

* the **run's** slots (``reserved``): only connections from the hosts the run's processes
  published for their own servers (:meth:`Admission.reserve_for`) take them;
* the **shared** slots (the others): any address, at most ``per_address`` of them each.

A new connection takes a free slot of the first pool it may use (the run's first).  When
those are all taken, it takes the slot of a handshake of the address holding the most slots
of that pool, when that address holds at least two more than the newcomer's: its oldest that
has run for :data:`GRACE` seconds (a process of the run needs far less to finish one), else,
when that address holds more than a fair share of the pool (its slots over the addresses
holding one, the newcomer's counted), its oldest however young (so that a flood closing
each connection before the grace period and opening another keeps no one out): that
handshake is cut (its socket shut down).  Otherwise it is refused.

So the invariant: **a connection from a host of the run finds a slot of the run at once,
however many connections arrive from other addresses** (they never hold one); within each
pool no address can keep another from its fair share, and a hostile connection from a
host of the run (a host is not authenticated by its address: another user of it, a NAT)
competes only with the run's connections from that host.  The time a slot is held is
bounded besides (``server``): the ClientHello must arrive within the hello deadline, the
handshake end within the handshake deadline.
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Iterable

__all__ = ["GRACE", "Admission", "Shake", "canonical_host"]

#: Seconds a handshake runs before a newcomer with a better claim to its slot may cut it.
GRACE = 0.5
RUN, SHARED = "the run's", "shared"


def canonical_host(host: str) -> str:
    """``host`` as the server sees a client's address (an IPv4 address mapped into IPv6
    as the IPv4 one)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


@dataclasses.dataclass(eq=False)
class Shake:
    """One connection in its handshake: its socket, its client's address, when it was
    accepted (``time.monotonic``), the pool its slot is in, and whether it was cut."""

    sock: socket.socket
    addr: str
    since: float
    pool: str
    cut: bool = False
    counted: bool = True  # among its address's connections


class Admission:
    """A server's caps on connections and its handshake slots (see the module docstring);
    thread-safe.

    Parameters
    ----------
    max_connections, max_per_address : int
        Connections at once, in all and from one address.
    max_handshakes : int
        Handshake slots, both pools.
    reserved : int
        Those of them kept for the run's hosts.
    per_address : int
        The most shared slots one address holds.
    clock : callable
        Seconds, monotonic (``time.monotonic``).
    """

    def __init__(
        self,
        max_connections: int,
        max_per_address: int,
        max_handshakes: int,
        reserved: int,
        per_address: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.max, self.max_addr = max_connections, max_per_address
        self.sizes = {RUN: reserved, SHARED: max(0, max_handshakes - reserved)}
        self.per_address = per_address
        self.run_hosts: frozenset[str] = frozenset()
        self._conns: collections.Counter[str] = collections.Counter()
        self._shaking: dict[socket.socket, Shake] = {}
        self._lock = threading.Lock()
        self.closed = False

    def reserve_for(self, hosts: Iterable[str]) -> None:
        """Keep the run's slots for connections from ``hosts`` (IP addresses)."""
        got = frozenset(canonical_host(str(h)) for h in hosts)
        with self._lock:
            self.run_hosts = got

    @property
    def connections(self) -> int:
        with self._lock:
            return sum(self._conns.values())

    @property
    def handshakes(self) -> int:
        with self._lock:
            return len(self._shaking)

    def shake_of(self, sock: socket.socket) -> Shake | None:
        with self._lock:
            return self._shaking.get(sock)

    # ------------------------------------------------------------------ in and out
    def admit(self, sock: socket.socket, host: str) -> tuple[Shake | None, str]:
        """A handshake slot for the new connection ``sock`` from ``host``, or why not
        (``(None, reason)``).  A handshake cut to make room is shut down here; its reason
        is the second item (empty when none was cut)."""
        addr = canonical_host(host)
        now = self.clock()
        with self._lock:
            if self.closed:
                return None, "the server is closing"
            if self._conns[addr] >= self.max_addr:
                return None, "too many connections from its address"
            full = sum(self._conns.values()) >= self.max
            pools = [RUN, SHARED] if addr in self.run_hosts else [SHARED]
            why = "too many connections" if full else "too many handshakes"
            for pool in pools:
                held = [h for h in self._shaking.values() if h.pool == pool]
                mine = sum(h.addr == addr for h in held)
                if pool == SHARED and mine >= self.per_address:
                    why = "too many handshakes from its address"
                    continue
                victim = None
                if full or len(held) >= self.sizes[pool]:
                    victim = self._victim(held, self.sizes[pool], addr, mine, now)
                    if victim is None:
                        continue
                shake = Shake(sock, addr, now, pool)
                self._shaking[sock] = shake
                self._conns[addr] += 1
                if victim is None:
                    return shake, ""
                self._cut(victim)
                return shake, (
                    f"cut the handshake of a connection from {victim.addr} (after "
                    f"{now - victim.since:.2g}s) to give its slot to one from {addr}: "
                    f"{victim.addr} held the most of the {pool} handshake slots"
                )
        return None, why

    def _victim(
        self, held: list[Shake], size: int, addr: str, mine: int, now: float
    ) -> Shake | None:
        """The handshake a newcomer from ``addr`` holding ``mine`` of ``held`` (a pool of
        ``size`` slots) takes the slot of, from the address holding the most, if that is
        at least two more than ``mine``: its oldest past :data:`GRACE`; else, when that
        address holds more than a fair share (the slots over the addresses holding one,
        the newcomer's counted), its oldest however young: handshakes kept younger than
        the grace period (closed and opened again) never keep another address out."""
        by_addr = collections.Counter(h.addr for h in held)
        if not by_addr:
            return None
        top = max(by_addr.values())
        if top < mine + 2:
            return None
        tops = [h for h in held if by_addr[h.addr] == top]
        old = [h for h in tops if now - h.since >= GRACE]
        if not old:
            fair = -(-size // len(set(by_addr) | {addr}))
            if top <= fair:
                return None
            old = tops
        return min(old, key=lambda h: h.since)

    def _cut(self, victim: Shake) -> None:
        # under the lock: its thread closes the socket only once it is out of _shaking
        del self._shaking[victim.sock]
        victim.cut = True
        self._uncount(victim)  # its connection's place is the newcomer's now
        try:
            victim.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def shaken(self, shake: Shake) -> bool:
        """The handshake of ``shake`` is over: its slot back; True when it was cut (then
        the connection is to be closed, whatever the handshake's outcome)."""
        with self._lock:
            self._shaking.pop(shake.sock, None)
            return shake.cut

    def release(self, shake: Shake) -> None:
        """The connection of ``shake`` is closed."""
        with self._lock:
            self._shaking.pop(shake.sock, None)
            self._uncount(shake)

    def _uncount(self, shake: Shake) -> None:
        if shake.counted:
            shake.counted = False
            self._conns[shake.addr] -= 1
            if self._conns[shake.addr] <= 0:
                del self._conns[shake.addr]

    def close(self) -> None:
        with self._lock:
            self.closed = True
