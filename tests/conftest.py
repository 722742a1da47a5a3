"""Fixtures shared by the cross-package tests: the real object-store servers.

Module-scoped: each test module gets its own moto server and GCS emulator on 127.0.0.1,
started on first use and stopped when the module ends.
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


@pytest.fixture(scope="module")
def gcs() -> Iterator[Any]:
    from object_store_servers import GcsEmulator

    server = GcsEmulator()
    yield server
    server.stop()
