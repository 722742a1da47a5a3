"""The tests' fork server (``forkserver.py``) starts a Python child as ``Popen`` would: its
own argv (a script or ``-c``), environment, working folder and standard streams (files or
pipes), JAX's device count read from its own ``XLA_FLAGS``, its exit code or signal, and
``Popen`` itself when the environment differs in what the server read while importing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork, SCM_RIGHTS")

SCRIPT = """
import json, os, sys
import jax
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
                  "mine": os.environ.get("MINE"), "devices": len(jax.devices()),
                  "main": __name__, "ppid": os.getppid()}), flush=True)
print("to stderr", file=sys.stderr)
if sys.argv[1:] == ["echo"]:
    for line in sys.stdin:
        print("got", line.strip(), flush=True)
sys.exit(int(os.environ.get("CODE", "0")))
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", **extra}


def test_a_forked_script_is_the_program_it_was_asked_to_be(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text(SCRIPT)
    work = tmp_path / "elsewhere"
    work.mkdir()
    for devices, code in ((2, 0), (3, 7)):
        env = _env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", MINE="x")
        with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
            p = forkserver.popen([tmp_path / "w.py", "a", "b"], env={**env, "CODE": str(code)},
                                 cwd=work, stdout=out, stderr=err, fork=True)  # fmt: skip
        assert isinstance(p, forkserver.Forked)  # forked, not started by Popen
        assert p.wait(120) == code, (tmp_path / "err").read_text()
        got = json.loads((tmp_path / "out").read_text())
        assert got["argv"] == ["a", "b"] and got["mine"] == "x" and got["main"] == "__main__"
        assert got["cwd"] == str(work) and got["path0"] == str(tmp_path)
        assert got["devices"] == devices  # XLA_FLAGS read by the child, not the server
        assert got["ppid"] != os.getpid()  # the server's child
        assert "to stderr" in (tmp_path / "err").read_text()


def test_pipes_signals_and_dash_c(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text(SCRIPT)
    p = forkserver.popen([tmp_path / "w.py", "echo"], env=_env(), stdin=forkserver.PIPE,
                         stdout=forkserver.PIPE, stderr=forkserver.STDOUT, text=True,
                         fork=True)  # fmt: skip
    assert isinstance(p, forkserver.Forked) and p.stdin and p.stdout
    assert json.loads(p.stdout.readline())["argv"] == ["echo"]
    assert p.stdout.readline() == "to stderr\n"  # stderr into the same pipe
    p.stdin.write("one\n")
    assert p.stdout.readline() == "got one\n"
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.1)
    p.send_signal(signal.SIGKILL)
    assert p.wait(30) == -signal.SIGKILL
    code = "import sys, quire; print(sys.argv, __name__); sys.exit(3)"
    done = forkserver.run(["-c", code, "x"], env=_env(), cwd=tmp_path, timeout=120)
    assert done.returncode == 3 and done.stdout == "['-c', 'x'] __main__\n", done.stderr
    (tmp_path / "w.py").write_text("raise SystemExit('bye')")
    done = forkserver.run([tmp_path / "w.py"], env=_env(), timeout=120)
    assert done.returncode == 1 and done.stderr == "bye\n"


def test_an_environment_read_at_import_gets_a_fresh_interpreter(tmp_path: Path) -> None:
    """``JAX_ENABLE_X64`` is read while JAX imports: the server's import can't serve it."""
    (tmp_path / "w.py").write_text(SCRIPT)
    p = forkserver.popen([tmp_path / "w.py"], env=_env(JAX_ENABLE_X64="1"), stdout=forkserver.PIPE,
                         fork=True)  # fmt: skip
    assert isinstance(p, subprocess.Popen)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and json.loads(out)["ppid"] == os.getpid()


def test_a_benchmark_imports_the_test_servers_without_the_conftest() -> None:
    """Benchmarks and CI scripts put ``tests/`` on ``sys.path`` and import the harness and
    the object-store servers as scripts, with no conftest to add ``core/tests``: the
    harness finds the fork server itself (bench_tiers_multi failed with
    ModuleNotFoundError: forkserver)."""
    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys; sys.path.insert(0, 'tests'); "
        "import object_store_servers, multihost.harness as h; print(h.forkserver.__file__)"
    )
    out = subprocess.run(  # a fresh interpreter: nothing imported, no conftest's sys.path
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(root / "core" / "tests" / "forkserver.py")
