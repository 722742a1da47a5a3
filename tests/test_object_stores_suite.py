"""The backend conformance suite on real servers, for every object store under test
(``object_store_servers.STORES``: S3 on moto, GCS on fake-gcs-server).

Each runs twice: straight to the server, and through a fault-injecting proxy that fails
every few requests (503 SlowDown, 500, connection resets before and after the server saw
the request) - the backend's retries must make every test pass unchanged.  The classes
(``TestS3Backend``, ``TestS3BackendThroughFaults``, ``TestGCSBackend``, ...) are made from
the rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from object_store_servers import STORES, FaultProxy, StoreUnderTest

from quire.testing import BackendSuite

MiB = 1 << 20
FAST_RETRY = {"retry_backoff": 0.01, "retry_max_backoff": 0.2, "retry_deadline": 30}


def _small(store: StoreUnderTest) -> dict[str, Any]:
    """Small thresholds, so that the suite's large object takes the multipart / resumable
    path and the split-range read path (S3: 5 MiB parts from 5 MiB; GCS: 256 KiB from
    1 MiB)."""
    parts = store.parts(store.min_part, threshold=max(store.min_part, MiB))
    return {**parts, "read_part_size": 4 * MiB}


def _flaky(proxy: FaultProxy) -> FaultProxy:
    proxy.add("503", every=7, times=-1)
    proxy.add("500", every=11, times=-1)
    proxy.add("reset", every=13, times=-1)
    proxy.add("reset-after", every=17, times=-1)
    return proxy


def _check_faults_fired(proxy: FaultProxy) -> None:
    """After a whole class ran through it, every kind of fault was injected (and the tests
    passed anyway).  Skipped for short runs (``-k``), where some may not have come up."""
    actions = [entry[2] for entry in proxy.log]
    if len(actions) >= 200:
        assert set(actions) >= {"503", "500", "reset", "reset-after"}, set(actions)


def _suite(store: StoreUnderTest, through_faults: bool) -> type[BackendSuite]:
    """The suite on ``store``'s server, straight to it or through a flaky proxy."""

    class Suite(BackendSuite):
        protocol = store.scheme

        @pytest.fixture
        def server(self, request: pytest.FixtureRequest) -> Any:
            return request.getfixturevalue(store.fixture)

        @pytest.fixture
        def backend_url(self, server: Any) -> str:
            return str(server.fresh_url())

        @pytest.fixture
        def storage_options(self, server: Any, request: pytest.FixtureRequest) -> dict[str, Any]:
            if not through_faults:
                return dict(server.options(**_small(store)))
            proxy = request.getfixturevalue("flaky_proxy")
            return dict(server.options(proxy.endpoint, **_small(store), **FAST_RETRY))

        @pytest.fixture(scope="class")
        @classmethod
        def flaky_proxy(cls, request: pytest.FixtureRequest) -> Iterator[FaultProxy]:
            server = request.getfixturevalue(store.fixture)
            proxy = _flaky(FaultProxy((server.host, server.port), store.flavor))
            yield proxy
            _check_faults_fired(proxy)
            proxy.stop()

    Suite.__name__ = Suite.__qualname__ = f"Test{store.label}Backend" + (
        "ThroughFaults" if through_faults else ""
    )
    return Suite


for _store in STORES.values():
    for _through_faults in (False, True):
        _class = _suite(_store, _through_faults)
        globals()[_class.__name__] = _class
