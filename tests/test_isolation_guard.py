"""The isolation guard (``isolation_guard.py``) turns state a test leaves behind into an error
of that test: run on a throw-away test file in a pytest of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LEAKY = """
import logging, os
import fsspec.config
import quire  # its loggers exist before the tests run

def test_sets_an_environment_variable():
    os.environ["QUIRE_ISOLATION_PROBE"] = "left behind"

def test_raises_a_log_level():
    logging.getLogger("quire").setLevel(logging.DEBUG)

def test_changes_fsspec_config():
    fsspec.config.conf.setdefault("s3", {})["anon"] = True

def test_restores_what_it_changes(monkeypatch):
    monkeypatch.setenv("QUIRE_ISOLATION_PROBE_2", "restored")

def test_leaves_work_on_quires_loop():
    import asyncio
    from quire._runtime import ioloop
    ioloop.submit(asyncio.sleep(3600))
"""


def test_the_guard_names_each_leak_and_spares_clean_tests(tmp_path: Path) -> None:
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("QUIRE_ISOLATION_PROBE", None)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "isolation_guard", "-p", "no:cacheprovider",
         "-q", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_leaky.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "4 errors" in text and "5 passed" in text, text
    assert "os.environ['QUIRE_ISOLATION_PROBE']: None -> 'left behind'" in text, text
    assert "logger 'quire' level 0 -> 10" in text, text
    assert "fsspec.config.conf" in text, text
    assert "still running on quire's event loop" in text and "sleep" in text, text
    assert "test_restores_what_it_changes" not in text.split("short test summary")[-1], text
