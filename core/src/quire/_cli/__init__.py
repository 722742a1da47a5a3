"""The ``quire`` command (``main``): one module per group of sub-commands (``diff``, ``export``,
``lsgc`` for ls / gc), what they share (``common``: exit codes, usage errors, storage options)
and text helpers (``text``).

The top of the package: may import anything of quire.  Sub-commands import the library inside
the command function, so that ``quire --help`` does not import JAX.
"""
