"""The incremental state machine (core/tests/test_incremental_machine.py) on S3: moto's
server, with the crash injected at the N-th write call of the S3 backend (every later write
call raises too: a killed process writes nothing more).  A few sequences in the default
lane, more in the slow lane; moto makes each step cost tens of requests."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "core" / "tests"))
from test_incremental_machine import run_machine


def _s3_backend() -> type:
    from quire_s3._backend import S3Backend

    return S3Backend


def test_incremental_state_machine_on_moto(
    moto: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    run_machine(
        monkeypatch,
        2,
        tmp_path,
        backend=_s3_backend(),
        fresh_url=moto.fresh_url,
        options=moto.options(),
    )


@pytest.mark.slow
def test_incremental_state_machine_on_moto_slow(
    moto: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    run_machine(
        monkeypatch,
        25,
        tmp_path,
        backend=_s3_backend(),
        fresh_url=moto.fresh_url,
        options=moto.options(),
    )
