"""The public object-store toolkit's pure parts: credentials out of endpoint URLs, and DNS
failures found however deep a client library wraps them."""

from __future__ import annotations

import socket

import pytest

from quire._objstore import name_resolution_error, strip_userinfo
from quire.backends import ObjectStoreBackend


@pytest.mark.parametrize(
    ("url", "clean", "removed"),
    [
        ("http://KEY:SECRET@host:9000/p", "http://host:9000/p", ["KEY", "SECRET"]),
        ("https://user@s3.example.com", "https://s3.example.com", ["user"]),
        ("http://k:s@[::1]:9000", "http://[::1]:9000", ["k", "s"]),
        ("http://host:9000", "http://host:9000", []),
    ],
)
def test_strip_userinfo(url: str, clean: str, removed: list[str]) -> None:
    assert strip_userinfo(url) == (clean, removed)


class _Wrapper(Exception):
    def __init__(self, error: BaseException) -> None:
        super().__init__("could not connect")
        self.kwargs = {"error": error}  # as botocore's EndpointConnectionError


class _Connector(Exception):
    def __init__(self, os_error: BaseException) -> None:
        super().__init__("connector")
        self.os_error = os_error  # as aiohttp's ClientConnectorDNSError


def test_name_resolution_error_is_found_through_wrappers() -> None:
    dns = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert name_resolution_error(_Wrapper(_Connector(dns))) is dns
    try:
        try:
            raise dns
        except socket.gaierror as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as outer:
        assert name_resolution_error(outer) is dns
    assert name_resolution_error(ConnectionRefusedError()) is None


def test_subclasses_must_implement_the_request_hooks() -> None:
    class Half(ObjectStoreBackend):
        scheme = "half"

    with pytest.raises(TypeError, match="abstract"):
        Half("half://bucket/p")  # type: ignore[abstract]
