"""A Checkpointer's local tier: fast local saves under the persistent root, copies on peer
processes, restores from the nearest holder (``docs/tiers.md``).

    ckpt = quire.Checkpointer(
        "s3://bucket/run1",
        local=quire.LocalTier("/local_ssd/run1", peers=1),
    )

:class:`LocalTier` configures the tier (also ``quire.LocalTier``); :class:`PeerTLS` gives
the peer link certificates of your own PKI instead of the ephemeral ones each run makes
(``docs/peers.md``).
"""

from __future__ import annotations

from quire._checkpointer.localtier import LocalTier
from quire._peers.tls import PeerTLS

__all__ = ["LocalTier", "PeerTLS"]
