"""Object-store endpoints: unresolvable hosts fail fast, retries are logged at INFO, and
credentials in an ``endpoint_url`` never reach a log (issue 13).

Real servers (moto, fake-gcs-server) from ``conftest.py``; the unresolvable host is
under ``.invalid``, a top-level domain reserved never to resolve (RFC 2606).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import numpy as np
import pytest
from object_store_servers import S3_KEY, SCHEMES, STORES, FaultProxy, MotoS3

import quire
from quire._store.url import open_backend
from quire.errors import EndpointUnreachableError

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="real servers on 127.0.0.1")

NOWHERE = "http://quire-no-such-host.invalid:9000"
TREE = {"w": np.arange(64, dtype=np.float32), "step": 3}


def _options(scheme: str, endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, **STORES[scheme].server.credentials}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_unresolvable_endpoint_fails_fast_naming_it(scheme: str) -> None:
    # The default retry_deadline (120 s) applies: only the error's kind makes it fast.
    url = f"{scheme}://quire-test/ckpt"
    t0 = time.monotonic()
    with pytest.raises(EndpointUnreachableError) as info:
        quire.save(url, TREE, storage_options=_options(scheme, NOWHERE))
    assert time.monotonic() - t0 < 15
    message = str(info.value)
    assert "quire-no-such-host.invalid" in message and "endpoint_url" in message, message
    assert isinstance(info.value, ConnectionError) and isinstance(info.value, quire.QuireError)
    with pytest.raises(EndpointUnreachableError):
        quire.load(url, storage_options=_options(scheme, NOWHERE))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_retry_is_logged_at_info_with_its_reason(
    scheme: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    store = STORES[scheme]
    server: Any = request.getfixturevalue(store.fixture)
    proxy = FaultProxy((server.host, server.port), store.flavor)
    try:
        proxy.add("503", times=2, **store.data_write)
        opts = {**server.options(proxy.endpoint), "retry_backoff": 0.01}
        caplog.set_level(logging.INFO, logger="quire")
        url = server.fresh_url()
        quire.save(url, TREE, storage_options=opts)
        np.testing.assert_array_equal(quire.load(url, storage_options=opts)["w"], TREE["w"])
    finally:
        proxy.stop()
    retries = [r for r in caplog.records if "retry" in r.getMessage()]
    assert all(r.levelno == logging.INFO for r in retries)
    # Each names its reason.  The two injected 503s are among them; on a loaded 2-core
    # machine the proxy has also made the next request time out (a read of quire.json,
    # retried and logged with its ReadTimeoutError), so other retries may be there too.
    assert all(" failed (" in r.getMessage() for r in retries), [r.getMessage() for r in retries]
    injected = [r for r in retries if "503" in r.getMessage()]
    assert len(injected) >= 2, caplog.text


def test_credentials_in_the_endpoint_url_are_stripped_and_never_logged(
    moto: MotoS3, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "endpoint-secret-9f8e7d6c5b"
    endpoint = moto.endpoint.replace("http://", f"http://{S3_KEY}:{secret}@")
    opts = {**moto.options(), "endpoint_url": endpoint}
    caplog.set_level(logging.DEBUG)  # every logger: botocore, aiobotocore, s3fs, quire
    url = moto.fresh_url()
    with pytest.warns(UserWarning, match=r"endpoint_url .* carried user:password@") as warned:
        quire.save(url, TREE, storage_options=opts)
        np.testing.assert_array_equal(quire.load(url, storage_options=opts)["w"], TREE["w"])
    assert any(r.levelname == "DEBUG" for r in caplog.records)  # the libraries did log
    assert secret not in caplog.text
    assert all(secret not in str(w.message) for w in warned)
    with pytest.warns(UserWarning):
        backend = open_backend(url, opts)
    assert secret not in repr(backend.storage_options)
    # A failure's message names the endpoint without the credentials either.
    with pytest.raises(quire.CheckpointNotFoundError) as info, pytest.warns(UserWarning):
        quire.load(url + "-absent", storage_options=opts)
    assert secret not in str(info.value)
