"""A fork server for the multi-process tests: JAX is imported once, not once per process.

Starting a worker costs about two CPU seconds before its first line runs, nearly all of it
importing JAX, NumPy, zarr and quire; a multi-process test starts two to four workers per
launch, and the suite launches a few hundred.  On the two cores CI has, that was a tenth of
the suite's time.  So each test process (one per pytest-xdist worker) keeps one server:

* the server (this file run as a script) sets ``JAX_PLATFORMS=cpu``, imports those modules
  and stops there: no JAX backend, no thread of its own (it checks: forking a process with
  threads is unsafe);
* each ``spawn`` sends it one JSON line; it forks, and the child becomes
  ``python WORKER ARGS...`` as ``subprocess.Popen`` would start it: its own environment (set
  before anything reads it: XLA reads ``XLA_FLAGS`` when a backend starts, which the server
  never did), working folder, ``argv``, ``sys.path[0]``, stdin from ``/dev/null`` and
  stdout/stderr into the given files; it then runs the script as ``__main__`` and exits the
  way Python does, atexit handlers and all;
* the server reaps its children and reports each exit code; the parent signals a child
  directly by its pid.

A worker whose environment differs from the server's in something read at import time
(``JAX_*``, ``PYTHON*``, ``FSSPEC_*``, ...: ``IMPORT_TIME``) is started with ``Popen``
instead, as is every worker when ``QUIRE_TEST_FORK=0``.  The server ends when its stdin
closes (the test process is gone), SIGKILLing the children still running.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

# Environment variables read while the server imports: a child that needs other values than
# the server's is not forked.
IMPORT_TIME = ("JAX_", "PYTHON", "COVERAGE_", "XLA_PYTHON", "TF_", "FSSPEC_")
_PRELOAD = ("jax", "jax.numpy", "numpy", "ml_dtypes", "zarr", "numcodecs", "fsspec", "quire")


def _server_env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def _imports_differ(env: dict[str, str], server: dict[str, str]) -> bool:
    keys = {k for k in (*env, *server) if k.startswith(IMPORT_TIME)}
    return any(env.get(k) != server.get(k) for k in keys)


class Forked:
    """A forked child, seen from the test process: the part of ``Popen`` the harness uses."""

    def __init__(self, server: Server, pid: int) -> None:
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.server.cond:
            if not self.server.cond.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not reaped yet, so the pid is still the child's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


class Server:
    """The test process's handle on its fork server."""

    def __init__(self) -> None:
        self.env = _server_env()
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=self.env,
        )
        self.cond = threading.Condition()
        self.children: dict[int, Forked] = {}
        self.started: list[int] = []
        self.dead = False
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()  # "ready", or nothing when the server failed
        self.ok = first.strip() == "ready"
        if self.ok:
            threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, out: IO[str]) -> None:
        for line in out:
            msg = json.loads(line)
            with self.cond:
                if "started" in msg:
                    self.started.append(msg["started"])
                else:
                    child = self.children.get(msg["ended"])
                    if child is not None:
                        child.returncode = msg["code"]
                self.cond.notify_all()
        with self.cond:  # the server is gone: so are its children (it killed them)
            self.dead = True
            for child in self.children.values():
                if child.returncode is None:
                    child.returncode = -signal.SIGKILL
            self.cond.notify_all()

    def spawn(
        self, argv: Sequence[str], env: dict[str, str], stdout: Path, stderr: Path, cwd: Path
    ) -> Forked | None:
        """Fork ``python *argv``; ``None`` when this server can't (the caller uses Popen)."""
        if not self.ok or self.dead or _imports_differ(env, self.env):
            return None
        req = {"argv": list(argv), "env": env, "cwd": str(cwd)}
        req |= {"stdout": str(stdout), "stderr": str(stderr)}
        with self.cond:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            self.cond.wait_for(lambda: self.started or self.dead, 60)
            if not self.started:
                return None
            child = Forked(self, self.started.pop(0))
            self.children[child.pid] = child
            return child


_server: Server | None = None
_lock = threading.Lock()


def _measured() -> bool:
    """Whether coverage.py measures this process: its children are then started by Popen,
    which coverage follows (``patch = ["subprocess"]`` in pyproject.toml)."""
    cov = sys.modules.get("coverage")
    return cov is not None and cov.Coverage.current() is not None


def spawn(
    argv: Sequence[str],
    env: dict[str, str],
    stdout: Path,
    stderr: Path,
    cwd: Path | None = None,
) -> Forked | subprocess.Popen[Any]:
    """Start ``python *argv`` with ``env`` in ``cwd``, its output into the two files: forked
    from this process's server when it can be, else by ``Popen``."""
    global _server
    cwd = cwd or Path.cwd()
    if os.environ.get("QUIRE_TEST_FORK", "1") != "0" and not _measured():
        with _lock:
            if _server is None:
                _server = Server()
            child = _server.spawn(argv, env, stdout, stderr, cwd)
        if child is not None:
            return child
    with open(stdout, "w") as out, open(stderr, "w") as err:
        cmd = [sys.executable, *argv]
        return subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd)


def run(
    argv: Sequence[str], env: dict[str, str], cwd: Path, logs: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, *argv], cwd=cwd, capture_output=True, text=True)`` through
    :func:`spawn`; the output passes through ``logs/forked.{out,err}``.  A child still
    running after ``timeout`` seconds is killed and ``subprocess.TimeoutExpired`` raised."""
    out, err = logs / "forked.out", logs / "forked.err"
    p = spawn(argv, env, out, err, cwd)
    try:
        code = p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGKILL)
        p.wait()
        raise
    return subprocess.CompletedProcess([sys.executable, *argv], code, _text(out), _text(err))


def _text(path: Path) -> str:
    return path.read_text(errors="replace")


# ---- the server's side (this file run as a script) ----


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


def _serve() -> dict[str, Any] | None:
    """Import, then fork a child per request.  Returns a request in the child (which then
    becomes that worker), ``None`` in the server when its stdin closes."""
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    import quire

    quire.save  # noqa: B018  (quire's API is imported on first use)
    threading_ok = threading.active_count() == 1
    # NumPy's OpenBLAS starts its thread pool at import; it is fork-safe (pthread_atfork).
    # Anything else starting a thread here would make forking unsafe: then refuse to serve.
    if not threading_ok:
        return None
    print("ready", flush=True)
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.02 if children else None)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            print(json.dumps({"ended": pid, "code": code}), flush=True)
        if not readable:
            continue
        data = os.read(0, 1 << 16)
        if not data:  # the test process is gone
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            return None
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                return dict(json.loads(line))
            children.add(pid)
            print(json.dumps({"started": pid}), flush=True)


def _become(req: dict[str, Any]) -> str:
    """In the forked child: turn into ``python *argv`` as Popen would have started it."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    script = os.path.abspath(req["argv"][0])
    sys.argv = list(req["argv"])
    sys.path[0] = os.path.dirname(script)
    return script


if __name__ == "__main__":
    _req = _serve()
    if _req is None:
        sys.exit(0)
    _script = _become(_req)
    del _req
    import runpy

    runpy.run_path(_script, run_name="__main__")
