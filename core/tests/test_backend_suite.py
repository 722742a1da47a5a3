"""The backend conformance suite on the built-in backends (local disk, memory)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from quire._store.memory import forget
from quire.testing import BackendSuite


class TestLocalBackend(BackendSuite):
    protocol = "file"

    @pytest.fixture
    def backend_url(self, tmp_path: Path) -> str:
        return str(tmp_path / "root")


class TestLocalFileUrl(BackendSuite):
    protocol = "file"

    @pytest.fixture
    def backend_url(self, tmp_path: Path) -> str:
        return (tmp_path / "root").as_uri()


class TestMemoryBackend(BackendSuite):
    protocol = "memory"

    @pytest.fixture
    def backend_url(self) -> Iterator[str]:
        url = f"memory://quire-backend-suite/{uuid.uuid4().hex}"
        yield url
        forget(url)
