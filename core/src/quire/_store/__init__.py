"""Bytes at a URL: the :class:`~quire.backends.Backend` contract (``base``), the built-in
backends (``local``, ``memory``, ``fsspec_generic``), URL → backend (``url``), the view that
forwards to a wrapped backend (``wrapped``) and the object-store toolkit quire-s3 and quire-gcs
build on: ``object_hooks`` (what a subclass implements), ``object_backend``
(:class:`~quire.backends.ObjectStoreBackend`) and its parts,
``clients`` (shared clients, request slots, each attempt's deadline), ``request_errors``
(failed requests as typed errors, credentials redacted), ``uploads`` (part uploads, the
commit's conditional write), with ``retries``, ``endpoints``, ``buffers`` and ``listing``.

May import: ``quire._runtime`` and quire's contract modules (``errors``, ``options``).
"""
