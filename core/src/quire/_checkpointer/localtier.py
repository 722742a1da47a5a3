"""``quire.LocalTier``: the configuration of a Checkpointer's fast per-process tier.

The Checkpointer takes it (``local=``) with its other settings and applies its policies; the
tier itself (its local roots, peer copies, restores and promotions) is the room below,
``quire._tiers``, which reads only the rest (``quire._tiers.contracts.TierSpec``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from quire._checkpointer.keep_policies import KeepPolicy
from quire._checkpointer.save_policies import SavePolicy
from quire._peers.tls import PeerTLS, require_cryptography
from quire._store.url import normalize

__all__ = ["LocalTier"]


@dataclasses.dataclass(frozen=True)
class LocalTier:
    """A fast per-process tier for :class:`quire.Checkpointer` (``local=LocalTier(...)``).

    Each process keeps its own quire Checkpointer root at ``<url>/process_<index>`` (so
    processes sharing a machine never share a directory), written whenever either tier's save
    policy says so; steps due for the persistent tier are copied there from these local bytes.
    See ``docs/tiers.md``.

    Parameters
    ----------
    url : str or path
        The local tier's base URL: a local disk, tmpfs or ``memory://`` URL.
    save_policy : quire.policies.SavePolicy, optional
        When the local tier saves (default: never on its own; it then saves only the steps
        the persistent policy saves).
    keep : quire.policies.KeepPolicy, optional
        Which local steps survive (default: all).
    peers : int
        With several JAX processes: copies of each process's objects of each local step on
        ``peers`` other processes (checked on arrival), in other failure domains whenever
        enough processes lie outside this one's, so a lost local directory (or host) is
        restored from its peers (default 0: from the persistent tier).
    storage_options : dict, optional
        fsspec options for the local tier's backend.
    peer_host : str
        The interface each process serves its local tier on to its peers (read-only, over
        TLS 1.3 with mutual authentication); ``127.0.0.1`` by default: this machine only.
        Give the address other hosts reach this one at for multi-host runs.
    peer_tls : quire.tiers.PeerTLS, optional
        This process's certificate, key and CA from your own PKI for the peer link
        (default: an ephemeral key and self-signed certificate per process, made with the
        ``cryptography`` package of the ``quire[peers]`` extra and pinned through
        ``jax.distributed``'s key-value store; see ``docs/peers.md``).
    failure_domain : str, optional
        What this process dies with (a host, a rack), for choosing where its peer copies go:
        each process's copies go to processes of other domains whenever enough exist
        (default: ``$QUIRE_FAILURE_DOMAIN``, else the host name).

    Raises
    ------
    TypeError, ValueError
        An argument has the wrong type or value.
    quire.errors.PluginError
        ``peers > 0`` without ``peer_tls`` and ``cryptography`` is not installed (install
        ``quire[peers]``).
    """

    url: str | os.PathLike[str]
    save_policy: SavePolicy | None = None
    keep: KeepPolicy | None = None
    peers: int = 0
    storage_options: Mapping[str, Any] | None = None
    peer_host: str = "127.0.0.1"
    failure_domain: str | None = None
    peer_tls: PeerTLS | None = None

    def __post_init__(self) -> None:
        if self.save_policy is not None and not isinstance(self.save_policy, SavePolicy):
            raise TypeError(f"save_policy must be a SavePolicy, got {self.save_policy!r}")
        if self.keep is not None and not isinstance(self.keep, KeepPolicy):
            raise TypeError(f"keep must be a KeepPolicy, got {self.keep!r}")
        if isinstance(self.peers, bool) or not isinstance(self.peers, int) or self.peers < 0:
            raise ValueError(f"peers must be an int >= 0, got {self.peers!r}")
        if not isinstance(self.peer_host, str) or not self.peer_host:
            raise TypeError(f"peer_host must be a host name or address, got {self.peer_host!r}")
        if self.failure_domain is not None and (
            not isinstance(self.failure_domain, str) or not self.failure_domain
        ):
            raise TypeError(
                f"failure_domain must be a non-empty string, got {self.failure_domain!r}"
            )
        object.__setattr__(self, "url", normalize(self.url))
        if self.peer_tls is not None and not isinstance(self.peer_tls, PeerTLS):
            raise TypeError(f"peer_tls must be a quire.tiers.PeerTLS, got {self.peer_tls!r}")
        if self.peers and self.peer_tls is None:  # at configuration, not at the first copy
            require_cryptography(f"LocalTier({str(self.url)!r}, peers={self.peers})")

    def process_url(self, index: int) -> str:
        """The local tier root of process ``index``.

        Parameters
        ----------
        index : int
            A JAX process index.

        Returns
        -------
        str
            ``<url>/process_<index, five digits>``.
        """
        return f"{self.url}/process_{index:05d}"
