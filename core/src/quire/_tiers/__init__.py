"""A Checkpointer's local tier over its persistent root (``quire.LocalTier``): one room for
everything that exists because there is a second tier.

Lowest first: ``contracts`` (contracts: what the tier asks of the roots, by the role each
plays, of the save decisions and configuration the Checkpointer hands it); the tier's
transactions: ``spread_save`` (a multi-process local save, every process into its own root,
handed to ``quire._api`` as a ``quire._engine.save.SaveScope``),
``ownership`` (a local step's objects by owner process: markers, checked peer copies, the
multi-process promotion) and on it ``promotion`` (the incremental promotion, one process or
several); with several processes ``placement`` (which processes hold each one's copies,
spread over failure domains), ``peer_copies`` (peer copies over the peer link), ``read_checks``
and ``providers`` under ``restore_reader`` (a restore's read-only view: byte ranges from the
nearest live holder, checked), ``restore_plan`` (the restore decision, a pure function of every process's view,
and the one agreement on it, with a deadline: every Checkpointer restore goes through it) and ``spread`` (``Spread``: all of that for one Checkpointer); at the top
``two_tiers`` (``TwoTiers``, the part the Checkpointer holds: local saves, promotions, reads local
first).

The Checkpointer (``quire._checkpointer``, above) makes the roots and decisions and asks the
tier through ``quire._checkpointer.tiering.Tiers``; nothing here imports it.

May import: ``quire._runtime``, ``quire._peers``, ``quire._store``, ``quire._format``,
``quire._handlers``, ``quire._engine``, ``quire._sources`` and quire's contract modules.
"""
