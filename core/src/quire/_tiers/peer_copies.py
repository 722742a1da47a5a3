"""Peer copies of a multi-process local tier, pulled over TCP (``quire._peers.link``).

Each process serves its own local root read-only with a ``PeerServer`` on the interface
``LocalTier(peer_host=...)`` names, over TLS 1.3 with mutual authentication: each process's
certificate (ephemeral, or of the user's PKI: ``LocalTier(peer_tls=...)``) is published
through ``jax.distributed``'s key-value store and pinned by the others; the addresses go
through the store too.

When the tier opens, the processes exchange their failure domains through the store too, and
each computes the same placement (``quire._tiers.placement.place``): the ``k`` holders
of each owner's objects, in other failure domains whenever enough processes lie outside the
owner's.  After the local commit of step S, process ``j`` marks its own objects held
(``quire._tiers.ownership``) and says so in the key-value store (``.../ready/<j>``).  Each of
its ``k`` holders waits for that (at most ``timeout`` seconds), asks
``j`` for its marker and then for the objects the marker names, over one connection, checks
them (exactly ``j``'s set of S, every object against the commit record and chunk index) and
only then writes them into its own root and marks them.  A refused or failed copy is logged
and leaves the step with its other holders.

Why TCP and not a collective: the copies run in the background, beside the training loop's
own collectives, and a background collective issued in another order on some process can hang
(``docs/peers.md``); a TCP pull involves two processes and no ordering.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from quire._format.untrusted import untrusted_json
from quire._peers import link
from quire._runtime.ioloop import run_blocking
from quire._runtime.multihost import _client, _first_line
from quire._store.base import Backend
from quire._store.memory import MemoryBackend
from quire._store.url import protocol_of
from quire._tiers import ownership, placement
from quire.errors import CorruptCheckpointError, MultiProcessError, PeerError

__all__ = ["PeerCopies"]

log = logging.getLogger("quire")

_MAX_MARKER = 1 << 24
_opened: collections.Counter[str] = collections.Counter()  # per name, in call order


class PeerCopies:
    """This process's peer server and its pulls of the objects of the owners it holds
    copies of (:attr:`sources`)."""

    def __init__(
        self,
        root: str,
        name: str,
        me: int,
        count: int,
        peers: int,
        host: str,
        timeout: float,
        domain: str = "",
        tls: link.PeerTLS | None = None,
    ) -> None:
        served = _served(root, peers)
        _opened[name] += 1  # the same count in every process: Checkpointers open in order
        self.name = f"{name}#{_opened[name]}"
        self.me, self.count, self.peers, self.timeout = me, count, peers, timeout
        self.root = root
        self.credentials = link.run_credentials(_key(f"{self.name}/cert"), timeout, tls)
        self.server = link.PeerServer(served(), self.credentials, host=host)
        link.publish_address(_key(f"{self.name}/address"), self.server.address)
        self._addresses: dict[int, tuple[str, int]] = {}
        self.domains = _domains(_key(f"{self.name}/domain"), me, count, domain, timeout)
        # every process published its address before its domain: all are there now
        self.server.reserve_for(self._hosts(count))
        self.placement = placement.place(self.domains, peers)  # owner -> its holders
        self.sources = placement.sources_of(self.placement, me)  # the owners held here
        shared = placement.shared_domains(self.domains, self.placement)
        if shared and me == 0:  # once per tier and run
            log.warning(
                "%s: LocalTier(peers=%d): processes %s keep a copy in their own failure domain "
                "(domains by process: %s): too few processes in other domains; a lost domain "
                "may take every copy of their objects (give each process its failure domain: "
                "LocalTier(failure_domain=...) or $%s)",
                root,
                peers,
                shared,
                self.domains,
                placement.ENV,
            )
        self._last_ready: str | None = None  # the key the successors delete once they pulled

    def close(self) -> None:
        """Close the server once the successors pulled this process's last step (at most
        ``timeout``: a successor that died never acknowledges)."""
        try:
            if self._last_ready is not None:
                c, end = _client(), time.monotonic() + self.timeout
                while time.monotonic() < end:
                    try:
                        c.key_value_try_get(self._last_ready)
                    except Exception:  # gone: every successor acknowledged
                        break
                    time.sleep(0.02)
        finally:
            self.server.close()

    def _ms(self) -> int:
        return min(2**31 - 1, max(1, int(self.timeout * 1000)))

    def peer(self, j: int) -> link.Pinned:
        """What to expect of process ``j`` (its pinned certificate)."""
        return self.credentials.peer(j)

    def _hosts(self, count: int) -> list[str]:
        """The hosts the run's processes serve on (where their connections come from), for
        the handshake slots this process's server keeps for them."""
        hosts = []
        for j in range(count):
            try:
                hosts.append(self._address(j)[0])
            except MultiProcessError as e:  # a PeerError among them: lost when asked
                log.warning("%s: no handshake slots kept for process %d: %s", self.root, j, e)
        return hosts

    def _address(self, j: int) -> tuple[str, int]:
        if j not in self._addresses:
            key = _key(f"{self.name}/address")
            self._addresses[j] = link.lookup_address(key, j, self.timeout)
        return self._addresses[j]

    async def after_commit(
        self, backend: Backend, url: str, rel: str, doc: dict[str, Any], primary: int, tag: str
    ) -> None:
        """Say this process's objects of the step are ready, then pull those of its sources.

        ``rel``: the step's directory relative to the local root; ``tag``: the save's unique
        name (the same in every process)."""
        c = _client()
        ready = _key(f"{self.name}/{tag}/ready")
        await run_blocking(c.key_value_set, f"{ready}/{self.me}", "1")
        self._last_ready = f"{ready}/{self.me}"
        for j in self.sources:
            try:
                await run_blocking(c.blocking_key_value_get, f"{ready}/{j}", self._ms())
            except Exception as e:
                raise MultiProcessError(
                    f"{url}: process {j} did not finish its local save within "
                    f"{self.timeout:g}s, so process {self.me} holds no copy of its objects of "
                    f"this step (is it stalled or dead?): {_first_line(e)}"
                ) from e
            try:
                await self.pull(backend, url, rel, doc, primary, j, j)
            except (PeerError, CorruptCheckpointError) as e:  # logged where refused
                log.warning("%s: no copy of process %d's objects here: %s", url, j, e)
            await run_blocking(_ack, c, f"{ready}/{j}", len(self.placement[j]))

    async def signal(self, tag: str) -> None:
        """Tell the other processes ``tag`` is done here."""
        await run_blocking(_client().key_value_set, f"{_key(f'{self.name}/{tag}')}/{self.me}", "1")

    async def wait_for(self, tag: str, j: int, url: str) -> None:
        """Wait (at most ``timeout``) until process ``j`` signalled ``tag``."""
        try:
            await run_blocking(
                _client().blocking_key_value_get,
                f"{_key(f'{self.name}/{tag}')}/{j}",
                self._ms(),
            )
        except Exception as e:
            raise MultiProcessError(
                f"{url}: process {j} did not signal {tag!r} within {self.timeout:g}s and is "
                f"treated as lost: {_first_line(e)}"
            ) from e

    async def pull(
        self,
        backend: Backend,
        url: str,
        rel: str,
        doc: dict[str, Any],
        primary: int,
        j: int,
        holder: int,
    ) -> None:
        """Copy owner ``j``'s objects of step ``rel`` from process ``holder`` (checked).

        What is asked for comes from the commit record, not from the peer: ``j``'s chunk
        index (its size and crc32c are in the record), then exactly the packs that index
        points into, each bounded by the extent the index gives it; only ``j``'s objects of
        checkpointable units are named by the holder's marker (each checked to lie under a
        location of ``j``'s units, and against its crc32c trailer on arrival)."""
        addr = await run_blocking(self._address, holder)
        who = f"process {holder} at {addr[0]}:{addr[1]}"
        peer = self.peer(holder)
        objects: dict[str, bytes] = {}
        sizes: dict[str, int] = {}
        entry = ownership.entry_of(doc, j)
        if entry is not None:
            index = await run_blocking(
                link.fetch,
                addr,
                f"{rel}/{entry['object']}",
                peer,
                self.timeout,
                int(entry["size"]),
            )
            objects[entry["object"]] = index
            sizes.update(ownership.pack_extents(doc, url, j, index, who))
        if ownership.owned_unit_locations(doc, j, primary):
            marker = ownership.marker_key(str(doc["txids"][0]), j)
            raw = await run_blocking(
                link.fetch, addr, f"{rel}/{marker}", peer, self.timeout, _MAX_MARKER
            )
            try:
                listed = list(untrusted_json(raw)["objects"].items())
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ownership.refused(url, who, j, f"its marker is malformed ({e})") from e
            for k, n in listed:
                if k in sizes or k in objects:
                    continue
                if not ownership.owns_unit_key(k, doc, j, primary):
                    raise ownership.refused(url, who, j, f"{k!r} is not an object of its part")
                if not ownership.is_size(n):
                    raise ownership.refused(
                        url, who, j, f"its marker gives {k!r} the size {n!r:.40}, no object's"
                    )
                sizes[k] = n
        if sum(sizes.values()) > ownership.MAX_OBJECT_BYTES:
            raise ownership.refused(url, who, j, "its objects' sizes add up past 2**63 bytes")
        keys = sorted(sizes)
        if keys:
            datas = await run_blocking(
                link.fetch_many,
                addr,
                [f"{rel}/{k}" for k in keys],
                peer,
                self.timeout,
                max(1, sum(sizes.values())),
            )
            objects.update(zip(keys, datas))
        await ownership.receive(backend, url, doc, j, primary, objects, who)


def _served(root: str, peers: int) -> Callable[[], Any]:
    """What this process's peer server serves (made when called, after the checks): its
    local root, a directory on disk or in its ``memory://`` store."""
    proto = protocol_of(root)
    if proto == "file":

        def disk() -> Any:
            os.makedirs(root, exist_ok=True)
            return root

        return disk
    if proto == "memory":

        def memory() -> Any:
            b = MemoryBackend(root)
            b.fs.makedirs(b.root, exist_ok=True)
            return link.FsspecFiles(b.fs, b.root)

        return memory
    raise NotImplementedError(
        f"LocalTier({root!r}, peers={peers}): peer copies are served from this process's "
        "local tier: a path on disk or tmpfs, or a memory:// URL, not a remote store; use one "
        "of those, or peers=0"
    )


def _domains(key: str, me: int, count: int, domain: str, timeout: float) -> list[str]:
    """Every process's failure domain, through the key-value store (blocking)."""
    c = _client()
    c.key_value_set(f"{key}/{me}", domain)
    ms = min(2**31 - 1, max(1, int(timeout * 1000)))
    out = []
    for j in range(count):
        try:
            out.append(str(c.blocking_key_value_get(f"{key}/{j}", ms)))
        except Exception as e:
            raise MultiProcessError(
                f"process {me} waited {timeout:g}s for process {j} to publish its failure "
                f"domain under {key!r} while opening the local tier; it did not (is it dead, "
                f"or opening no local tier with peers?): {_first_line(e)}"
            ) from e
    return out


def _ack(c: Any, key: str, readers: int) -> None:
    """Count one reader of ``key``; the last one deletes it (coordination memory only)."""
    try:
        if c.key_value_increment(f"{key}/acks", 1) >= readers:
            c.key_value_delete(key)
            c.key_value_delete(f"{key}/acks")
    except Exception:  # broad: coordination memory only  # pragma: no cover
        pass


def _key(name: str) -> str:
    return f"quire/n/{hashlib.sha256(name.encode()).hexdigest()[:16]}/peer"
