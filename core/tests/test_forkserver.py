"""The multi-process harness's fork server (``tests/multihost/forkserver.py``) starts a worker
as ``Popen`` would: its own argv, environment, working folder and output files, JAX's
device count read from its own ``XLA_FLAGS``, its exit code or signal, and ``Popen`` itself
when the environment differs in what the server read while importing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multihost import forkserver

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork, /proc")

SCRIPT = """
import json, os, sys
import jax
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
                  "mine": os.environ.get("MINE"), "devices": len(jax.devices()),
                  "main": __name__, "ppid": os.getppid()}))
print("to stderr", file=sys.stderr)
if sys.argv[1:] == ["sleep"]:
    import time; time.sleep(600)
sys.exit(int(os.environ.get("CODE", "0")))
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", **extra}


def test_a_forked_worker_is_the_script_it_was_asked_to_be(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text(SCRIPT)
    work = tmp_path / "elsewhere"
    work.mkdir()
    for devices, code in ((2, 0), (3, 7)):
        env = _env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", MINE="x")
        out, err = tmp_path / f"{devices}.out", tmp_path / f"{devices}.err"
        p = forkserver.spawn([str(tmp_path / "w.py"), "a", "b"], {**env, "CODE": str(code)},
                             out, err, work)  # fmt: skip
        assert isinstance(p, forkserver.Forked)  # forked, not started by Popen
        assert p.wait(120) == code, err.read_text()
        got = json.loads(out.read_text())
        assert got["argv"] == ["a", "b"] and got["mine"] == "x" and got["main"] == "__main__"
        assert got["cwd"] == str(work) and got["path0"] == str(tmp_path)
        assert got["devices"] == devices  # XLA_FLAGS read by the child, not the server
        assert got["ppid"] != os.getpid()  # the server's child
        assert "to stderr" in err.read_text()


def test_a_killed_worker_reports_the_signal_and_run_captures_output(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text(SCRIPT)
    out, err = tmp_path / "k.out", tmp_path / "k.err"
    p = forkserver.spawn([str(tmp_path / "w.py"), "sleep"], _env(), out, err, tmp_path)
    deadline = time.monotonic() + 60
    while not out.exists() or not out.read_text():  # it is asleep once it has printed
        assert time.monotonic() < deadline and p.poll() is None, err.read_text()
        time.sleep(0.02)
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.1)
    p.send_signal(signal.SIGKILL)
    assert p.wait(30) == -signal.SIGKILL
    done = forkserver.run([str(tmp_path / "w.py")], _env(CODE="3"), tmp_path, tmp_path, 120)
    assert done.returncode == 3 and "to stderr" in done.stderr
    assert json.loads(done.stdout)["argv"] == []


def test_an_environment_read_at_import_gets_a_fresh_interpreter(tmp_path: Path) -> None:
    """``JAX_ENABLE_X64`` is read while JAX imports: the server's import can't serve it."""
    (tmp_path / "w.py").write_text(SCRIPT)
    out, err = tmp_path / "x.out", tmp_path / "x.err"
    p = forkserver.spawn([str(tmp_path / "w.py")], _env(JAX_ENABLE_X64="1"), out, err)
    assert isinstance(p, subprocess.Popen)
    assert p.wait(120) == 0, err.read_text()
    assert json.loads(out.read_text())["ppid"] == os.getpid()
