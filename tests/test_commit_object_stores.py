"""The commit-protocol model (``core/tests/test_commit_model.py``) on S3 (moto) and GCS
(fake-gcs-server): save, overwrite, delete, crashed saves and GC against a model.

Both servers enforce the commit's preconditions (moto ``If-None-Match`` / ``If-Match`` on
PutObject, fake-gcs-server ``ifGenerationMatch`` on the multipart uploads quire-gcs
commits with), so the conditional create and the compare-and-swap of ``quire.json`` are
exercised for real on both.  Few examples and steps: each step is several HTTP round trips.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from object_store_servers import SCHEMES, STORES

import quire

_spec = importlib.util.spec_from_file_location(
    "_quire_commit_model", Path(__file__).parent.parent / "core" / "tests" / "test_commit_model.py"
)
assert _spec is not None and _spec.loader is not None
_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_model)

_SETTINGS = settings(
    max_examples=4, stateful_step_count=8, deadline=None, suppress_health_check=list(HealthCheck)
)


def _run_machine(server: Any, protocol: str) -> None:
    class Machine(_model.CommitMachine):  # type: ignore[name-defined,misc]
        def make_root(self) -> str:
            return str(server.fresh_url())

    with quire.Context(storage_options={protocol: server.options()}):
        test = Machine.TestCase
        test.settings = _SETTINGS
        test().runTest()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_commit_model(scheme: str, request: pytest.FixtureRequest) -> None:
    _run_machine(request.getfixturevalue(STORES[scheme].fixture), scheme)
