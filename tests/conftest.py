"""Fixtures shared by the cross-package tests: the real object-store servers.

One fixture per row of ``object_store_servers.STORES``, named by the row and scoped as it
says: each test module gets its own moto server on 127.0.0.1, started on first use and
stopped when the module ends; the whole session shares one fake-gcs-server (a process of its
own; every test writes under a fresh prefix).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

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
