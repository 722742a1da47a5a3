"""The peer link: files of another process's directory over TLS 1.3 with mutual
authentication (``docs/peers.md``).  ``link`` is what its users call (the run's
credentials, the server, the client calls, addresses through the key-value store); the
certificates and their checks are in ``tls``, the client's connections in ``connections``,
the server in ``server``, what it serves (regular files under one directory, read-only)
in ``files`` and the messages in ``wire``.

A room of its own, right above ``quire._runtime``, so that the declared order keeps this
security boundary small: it knows nothing of checkpoints, and its only user inside quire is
the local tier (``quire._tiers.peer_copies``, ``providers``; ``quire.tiers.PeerTLS`` is public).

May import: ``quire._runtime`` and quire's contract modules.
"""
