"""Fixtures shared by the cross-package tests: the real object-store servers.

Each test module gets its own moto server on 127.0.0.1, started on first use and stopped when
the module ends; the whole session shares one fake-gcs-server (a process of its own; every
test writes under a fresh prefix).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def moto() -> Iterator[Any]:
    from object_store_servers import MotoS3

    server = MotoS3()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs() -> Iterator[Any]:
    from object_store_servers import FakeGcs

    server = FakeGcs()
    yield server
    server.stop()
