"""``quire.Checkpointer`` for training loops (``checkpointer``), composed of parts it holds, each
owning its state (no mixins; ``core/tests/test_architecture.py`` checks): a root of numbered
steps (``steproot``: ``StepRoot``, holding the step ``ledger``, the background ``tasks`` and
the retention and garbage rules, ``retain``), the save decision (``deciding``, with the
policies of ``save_policies`` and ``keep_policies``), and how saves and reads go over its
tiers (``tiering``: the root alone, or ``tiers``: ``quire.LocalTier`` (configured in
``localtier``), a fast per-process local root under the persistent one, handed its roots and
decisions (``tiertypes``), promotion from local bytes, reads local first; with several
processes ``tiermulti``: the agreed step and restore from peers, ``tierplan``: that agreement
as data, ``tierplace``: which processes hold each one's copies (spread over failure domains),
``tierpull``: peer copies over TCP, ``tierread``: a restore's read-only view, byte ranges from
the nearest live holder).

May import: everything below the package face (``quire._api`` and the subpackages under it),
never ``quire`` itself or ``quire._cli``.
"""
