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
import quire
quire.save  # quire's API loads on first use (and makes its loggers): before the tests run

def test_sets_an_environment_variable():
    os.environ["QUIRE_ISOLATION_PROBE"] = "left behind"

def test_raises_a_log_level():
    logging.getLogger("quire").setLevel(logging.DEBUG)

def test_changes_fsspec_config():
    fsspec.config.conf.setdefault("s3", {})["anon"] = True

def test_restores_what_it_changes(monkeypatch):
    monkeypatch.setenv("QUIRE_ISOLATION_PROBE_2", "restored")

def test_leaves_a_pooled_connection_checked_out():
    from quire._runtime import ioloop
    from quire.backends import ObjectStoreBackend

    class Pool:  # a client whose one connection a reply nobody read still holds
        busy = 1

    class LeakyBackend(ObjectStoreBackend):
        new_client = classmethod(lambda cls, options: Pool())
        connections_in_use = staticmethod(lambda client: client.busy)
        async def close_client(client): ...
        async def stat(self, key): ...
        async def read_range(self, key, start, end): ...
        async def read_range_into(self, key, start, views, length): ...
        async def list_page(self, prefix, token, limit, delimiter): ...
        async def put_small(self, key, views, total): ...
        async def put_large(self, key, views, total): ...
        async def put_if_absent(self, key, data): ...
        async def replace_if_match(self, key, data, version): ...
        async def delete(self, keys): ...

    async def use(b):
        return b.client  # the shared client, on quire's loop

    ioloop.submit(use(LeakyBackend("leaky://bucket/p"))).result(timeout=30)

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
    assert "5 errors" in text and "6 passed" in text, text
    assert "os.environ['QUIRE_ISOLATION_PROBE']: None -> 'left behind'" in text, text
    assert "logger 'quire' level 0 -> 10" in text, text
    assert "fsspec.config.conf" in text, text
    assert "still running on quire's event loop" in text and "sleep" in text, text
    assert "LeakyBackend client" in text and "1 connection(s) checked out" in text, text
    assert "test_restores_what_it_changes" not in text.split("short test summary")[-1], text
