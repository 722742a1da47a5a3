"""The ``quire`` command: ``main`` (the parser and dispatch), one module per sub-command
(``info``, ``verify``, ``listing`` for ls, ``gc``, ``cp``, ``diff``, ``export``, ``plugins``),
what they share (``common``: exit codes, usage errors, storage options; ``targets``: what a
URL holds and the one-line refusals; ``text``: sizes, ages, tables).

The top of the package: may import anything of quire.  ``main`` imports a sub-command's
module only when it runs, so that ``quire --help`` imports no command, and ``info`` and
``ls`` import neither JAX nor zarr (``core/tests/test_cli_startup.py`` holds them to it).
"""
