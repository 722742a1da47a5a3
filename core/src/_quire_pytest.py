"""quire's pytest plugin (entry point ``pytest11: quire``), loaded by pytest at start-up.

It lives outside the ``quire`` package on purpose: a pytest plugin is imported before
any ``conftest.py``, and importing ``quire`` imports JAX, which reads ``JAX_PLATFORMS``
and similar settings once, at import — a project's conftest must still be able to set
them.  Everything here imports quire lazily.

What it gives every test session:

* assertion rewriting for the conformance suites in :mod:`quire.testing`;
* ``quire_url``: a fresh checkpoint URL on each first-party backend (folder, memory);
* ``quire_fresh_registry``: quire's plugin caches cleared before and after the test (for
  tests that install or register plugins).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.register_assert_rewrite("quire.testing")


@pytest.fixture(params=["file", "memory"])
def quire_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh checkpoint URL: a local folder, then a ``memory://`` prefix."""
    if request.param == "file":
        yield str(tmp_path / "ckpt")
        return
    url = f"memory://quire-tests/{uuid.uuid4().hex}"
    yield url
    from quire._store.memory import forget

    forget(url)


@pytest.fixture
def quire_fresh_registry() -> Iterator[None]:
    """Clear quire's entry-point and handler caches around the test."""
    from quire._runtime.registry import clear_caches

    clear_caches()
    yield
    clear_caches()
