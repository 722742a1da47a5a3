"""The backend conformance suite on real servers: S3 (moto) and GCS (fake-gcs-server).

Each runs twice: straight to the server, and through a fault-injecting proxy that fails
every few requests (503 SlowDown, 500, connection resets before and after the server saw
the request) - the backend's retries must make every test pass unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from object_store_servers import FakeGcs, FaultProxy, MotoS3

from quire.testing import BackendSuite

MiB = 1 << 20
# Small thresholds, so that the suite's large object takes the multipart / resumable path
# and the split-range read path.
S3_SMALL = {
    "multipart_threshold": 5 * MiB,
    "multipart_chunksize": 5 * MiB,
    "read_part_size": 4 * MiB,
}
GCS_SMALL = {
    "resumable_threshold": 1 * MiB,
    "resumable_chunksize": 256 * 1024,
    "read_part_size": 4 * MiB,
}
FAST_RETRY = {"retry_backoff": 0.01, "retry_max_backoff": 0.2, "retry_deadline": 30}


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


@pytest.fixture(scope="module")
def flaky_s3(moto: MotoS3) -> Iterator[FaultProxy]:
    proxy = _flaky(FaultProxy((moto.host, moto.port), "s3"))
    yield proxy
    _check_faults_fired(proxy)
    proxy.stop()


@pytest.fixture(scope="module")
def flaky_gcs(gcs: FakeGcs) -> Iterator[FaultProxy]:
    proxy = _flaky(FaultProxy(("127.0.0.1", gcs.port), "gcs"))
    yield proxy
    _check_faults_fired(proxy)
    proxy.stop()


class TestS3Backend(BackendSuite):
    protocol = "s3"

    @pytest.fixture
    def backend_url(self, moto: MotoS3) -> str:
        return moto.fresh_url()

    @pytest.fixture
    def storage_options(self, moto: MotoS3) -> dict[str, Any]:
        return moto.options(**S3_SMALL)


class TestS3BackendThroughFaults(BackendSuite):
    protocol = "s3"

    @pytest.fixture
    def backend_url(self, moto: MotoS3) -> str:
        return moto.fresh_url()

    @pytest.fixture
    def storage_options(self, moto: MotoS3, flaky_s3: FaultProxy) -> dict[str, Any]:
        return moto.options(flaky_s3.endpoint, **S3_SMALL, **FAST_RETRY)


class TestGCSBackend(BackendSuite):
    protocol = "gs"

    @pytest.fixture
    def backend_url(self, gcs: FakeGcs) -> str:
        return gcs.fresh_url()

    @pytest.fixture
    def storage_options(self, gcs: FakeGcs) -> dict[str, Any]:
        return gcs.options(**GCS_SMALL)


class TestGCSBackendThroughFaults(BackendSuite):
    protocol = "gs"

    @pytest.fixture
    def backend_url(self, gcs: FakeGcs) -> str:
        return gcs.fresh_url()

    @pytest.fixture
    def storage_options(self, gcs: FakeGcs, flaky_gcs: FaultProxy) -> dict[str, Any]:
        return gcs.options(flaky_gcs.endpoint, **GCS_SMALL, **FAST_RETRY)
