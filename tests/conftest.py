"""Fixtures shared by the cross-package tests: the real object-store servers.

One fixture per row of ``object_store_servers.STORES``, named by the row and scoped as it
says: the whole session (each xdist worker) shares one moto server on 127.0.0.1 and one
fake-gcs-server (a process of its own), started on first use; every test writes under a
fresh prefix (``fresh_url()``), so sharing a server costs no isolation.

It also puts ``core/tests`` on ``sys.path``: its helpers (``forkserver``, ``propcase``,
``dropchunk``, ...) serve the tests here too.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "tests"))

import pytest
from object_store_servers import STORES, StoreUnderTest


def _server_fixture(store: StoreUnderTest) -> Callable[[], Iterator[Any]]:
    @pytest.fixture(scope=store.scope, name=store.fixture)
    def server() -> Iterator[Any]:
        running = store.server()
        yield running
        running.stop()

    return server


for _store in STORES.values():  # moto, gcs
    globals()[f"_{_store.fixture}_fixture"] = _server_fixture(_store)
