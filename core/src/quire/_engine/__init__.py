"""Transactions over the format: the one commit path (``commit``), save (``save``), load,
metadata and verify (``load``, which reads chunks several processes need once and exchanges
them through ``shared_reads``), the partial-save journal (``journal``, replayed by
``journal_replay``; finalize's pack rewrite in ``packrewrite``), ``quire cp`` of a committed
checkpoint (``copying``, format v2's packs in ``packcopy``; a self-contained copy of an
incremental step in ``unborrow``), incremental steps' change detection and leases
(``incremental``, mostly-dead packs in ``compaction``), garbage collection of a Checkpointer
root (``garbage``) and checkpoints anywhere under a prefix (``scan``).  The local tier's
transactions (its multi-process save, peer copies, promotions) are ``quire._tiers``'.

Inside the package, lowest first: commit, shared_reads < save, load < packrewrite < journal
< garbage < scan; copying and packcopy stand beside them.

May import: ``quire._runtime``, ``quire._store``, ``quire._format``, ``quire._handlers`` and
quire's contract modules.
"""
