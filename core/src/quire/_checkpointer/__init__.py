"""``quire.Checkpointer`` for training loops (``checkpointer``), composed of parts it holds,
each owning its state (no mixins; ``core/tests/test_architecture.py`` checks): a root of
numbered steps (``steproot``: ``StepRoot``, holding the step ``ledger``, the background
``tasks`` and the retention and garbage rules, ``retain``), the save decision (``deciding``,
with the policies of ``save_policies`` and ``keep_policies``), and how saves and reads go
over its tiers (``tiering``: ``Tiers``, the narrow interface the Checkpointer asks, and
``arrange``, which makes the parts: the root alone, or a local tier over it, configured by
``quire.LocalTier`` in ``localtier``).  The local tier itself is a room below:
``quire._tiers``.

May import: everything below the package face (``quire._api`` and the subpackages under it),
never ``quire`` itself or ``quire._cli``.
"""
