"""Bytes at a URL: the :class:`~quire.backends.Backend` contract (``base``), the built-in
backends (``local``, ``memory``, ``fsspec_generic``), URL → backend (``url``), the view that
forwards to a wrapped backend (``wrapped``) and the object-store toolkit quire-s3 and quire-gcs
build on (``objbackend``, ``objstore``, ``objerrors``, ``objwrites``).

May import: ``quire._runtime`` and quire's contract modules (``errors``, ``options``).
"""
