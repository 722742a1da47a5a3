"""How a leaf or a unit becomes objects: the leaf-handler contract (``base``), handler choice
(``select``), what verify and cp ask of a handler (``objects``), the zarr v3 array layout and
codecs, and the built-in leaf handlers (``arrays``, ``jax_arrays``, ``inline``).

May import: ``quire._runtime``, ``quire._store``, ``quire._format.record`` and quire's contract
modules (``errors``, ``options``, ``metadata``).
"""
