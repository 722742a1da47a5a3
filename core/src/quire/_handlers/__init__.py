"""How a leaf or a unit becomes objects: the leaf-handler contract (``base``), handler choice
(``select``), what verify and cp ask of a handler (``objects``), the zarr v3 array layout and
codecs (``zarr_layout``, ``zarr_io``, ``codecs``: one codec from its spec, ``chain``: a leaf's
codec chain, each kind in its place), the save plan of an array (``arrayplan``,
with replica-parallel pieces from ``replicas``) and save_async's snapshot (``arraysnap``), the
built-in leaf handlers (``arrays``, ``jax_arrays``, ``inline``), the checkpointable contract
(``units``), the json handler (``json_unit``) and the engine side of units (``unit_ops``).

May import: ``quire._runtime``, ``quire._store``, ``quire._format`` and quire's contract
modules (``errors``, ``options``, ``metadata``).
"""
