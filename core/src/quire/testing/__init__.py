"""Conformance suites for quire plugins: subclass one class, provide a fixture.

=============================  ================================  ==========================
suite                          entry-point group                 names the plugin by
=============================  ================================  ==========================
``BackendSuite``               ``quire.backends``                ``protocol``
``CodecSuite``                 ``quire.codecs``                  ``codec_id``
``LeafHandlerSuite``           ``quire.leaf_handlers``           ``handler_id``
``CheckpointableHandlerSuite`` ``quire.checkpointables``         ``handler_id``
``SourceSuite``                ``quire.sources``                 ``source_format``
=============================  ================================  ==========================

The suites are plain pytest classes; quire registers a pytest plugin (entry point
``pytest11: quire``) so their assertions are rewritten and a few fixtures
(``quire_url``, ``quire_fresh_registry``) are available in any test.
:mod:`quire.testing.coverage` finds installed plugins that no suite covers.
"""

from __future__ import annotations

from quire.testing.backend import BackendSuite
from quire.testing.checkpointable import CheckpointableHandlerSuite
from quire.testing.codec import CodecSuite
from quire.testing.leaf import LeafHandlerSuite
from quire.testing.source import SourceSuite

__all__ = [
    "BackendSuite",
    "CheckpointableHandlerSuite",
    "CodecSuite",
    "LeafHandlerSuite",
    "SourceSuite",
]
