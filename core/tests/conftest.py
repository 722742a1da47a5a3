from __future__ import annotations

import os

# Eight CPU devices for sharding tests; must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest


@pytest.fixture(params=["file", "memory"])
def url(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> str:
    """A fresh checkpoint URL on each first-party backend."""
    if request.param == "file":
        return str(tmp_path / "ckpt")
    import uuid

    return f"memory://quire-tests/{uuid.uuid4().hex}"
