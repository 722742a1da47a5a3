"""A fork server for the tests that start Python processes: JAX is imported once, not once per
process.

A fresh ``python`` that imports JAX, NumPy, zarr and quire spends about two CPU seconds
before its first line runs; the suite starts several hundred (the workers of the
multi-process tests, the processes killed at every backend call, the docs' scripts).  On
the two cores CI has, that was a tenth of the suite's time.  So each test process keeps one
server, started on first use:

* the server (this file run as a script) sets ``JAX_PLATFORMS=cpu``, imports those modules
  and stops there: no JAX backend, no thread of its own (it checks: forking a process with
  threads is unsafe);
* :func:`popen` sends it one message over a Unix socket, with the child's stdin, stdout and
  stderr as file descriptors (``SCM_RIGHTS``); it forks, and the child becomes
  ``python SCRIPT ARGS...`` or ``python -c CODE ARGS...`` as ``subprocess.Popen`` would
  start it: its own environment (set before anything reads it: XLA reads ``XLA_FLAGS``
  when a backend starts, which the server never did), working folder, ``argv``,
  ``sys.path[0]`` and standard streams; it runs as ``__main__`` and exits the way Python
  does, atexit handlers and all;
* the server reaps its children and reports each exit code; the test process signals a
  child directly by its pid.

:func:`popen` falls back to ``subprocess.Popen`` (a fresh interpreter) when the child's
environment differs from the server's in something read at import time (:data:`IMPORT_TIME`:
``JAX_*``, ``PYTHON*``, ``FSSPEC_*``, ...), when coverage.py measures the test process (it
follows ``Popen``, not a fork), and for every child with ``QUIRE_TEST_FORK=0``.  The server
ends when its socket closes (the test process is gone), SIGKILLing the children still
running.  Tests that need a fresh interpreter (import time, start-up) use ``Popen``.
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

#: Environment variables read while the server imports: a child that needs other values than
#: the server's is started by ``Popen``.
IMPORT_TIME = ("JAX_", "PYTHON", "COVERAGE_", "XLA_PYTHON", "TF_", "FSSPEC_")
_PRELOAD = ("jax", "jax.numpy", "numpy", "ml_dtypes", "zarr", "numcodecs", "fsspec", "quire")
PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL


def _server_env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def _imports_differ(env: dict[str, str], server: dict[str, str]) -> bool:
    keys = {k for k in (*env, *server) if k.startswith(IMPORT_TIME)} - {"PYTHONUNBUFFERED"}
    return any(env.get(k) != server.get(k) for k in keys)


class Forked:
    """A forked child, seen from the test process: ``Popen``'s ``pid``, ``returncode``,
    ``stdin``/``stdout``/``stderr``, ``poll``, ``wait``, ``send_signal``, ``kill`` and
    ``communicate``."""

    def __init__(self, server: _Server, pid: int, args: list[str]) -> None:
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None
        self.stdin: IO[Any] | None = None
        self.stdout: IO[Any] | None = None
        self.stderr: IO[Any] | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.server.cond:
            if not self.server.cond.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self.server.cond:
            if self.returncode is None:  # not reaped yet, so the pid is still the child's
                try:
                    os.kill(self.pid, sig)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Read stdout and stderr (those that are pipes) to their ends, then wait."""
        if self.stdin is not None:
            self.stdin.close()
        got: dict[str, Any] = {}

        def drain(name: str, f: IO[Any]) -> None:
            got[name] = f.read()
            f.close()

        readers = [
            threading.Thread(target=drain, args=(name, f), daemon=True)
            for name, f in (("out", self.stdout), ("err", self.stderr))
            if f is not None
        ]
        for t in readers:
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return got.get("out"), got.get("err")


class _Server:
    """The test process's handle on its fork server."""

    def __init__(self) -> None:
        self.env = _server_env()
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno())], pass_fds=[theirs.fileno()],
            env=self.env, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        theirs.close()
        self.cond = threading.Condition()
        self.children: dict[int, Forked] = {}
        self.started: list[int] = []
        self.dead = False
        self.ok = self.sock.recv(64) == b"ready"  # nothing when the server could not serve
        if self.ok:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while msg := self.sock.recv(1 << 16):
            got = json.loads(msg)
            with self.cond:
                if "started" in got:
                    self.started.append(got["started"])
                elif (child := self.children.pop(got["ended"], None)) is not None:
                    child.returncode = got["code"]
                self.cond.notify_all()
        with self.cond:  # the server is gone, and so are its children (it killed them)
            self.dead = True
            for child in self.children.values():
                child.returncode = -signal.SIGKILL
            self.children.clear()
            self.cond.notify_all()

    def fork(
        self, argv: list[str], env: dict[str, str], cwd: Path, fds: list[int]
    ) -> Forked | None:
        """A child forked with ``fds`` as its stdin, stdout and stderr; None when this
        server can't start it (the caller uses Popen)."""
        if not self.ok or self.dead or _imports_differ(env, self.env):
            return None
        req = json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}).encode()
        with self.cond:
            socket.send_fds(self.sock, [req], fds)
            self.cond.wait_for(lambda: self.started or self.dead, 60)
            if not self.started:
                return None
            child = Forked(self, self.started.pop(0), [sys.executable, *argv])
            self.children[child.pid] = child  # before its end can be read
            return child


#: What :func:`popen` returns.
Child = Forked | subprocess.Popen[Any]

_server: _Server | None = None
_lock = threading.Lock()


def _measured() -> bool:
    """Whether coverage.py measures this process (it follows ``Popen``, not a fork)."""
    cov = sys.modules.get("coverage")
    return cov is not None and cov.Coverage.current() is not None


def _stream(spec: Any, mode: str) -> tuple[int, int | None]:
    """(the child's fd, the parent's end of a pipe or None) for a stdin/stdout/stderr spec:
    None (inherit), DEVNULL, PIPE, a file object or an fd."""
    if spec is None:
        return (0 if mode == "r" else 1 if mode == "w" else 2), None
    if spec == DEVNULL:
        return os.open(os.devnull, os.O_RDONLY if mode == "r" else os.O_WRONLY), None
    if spec == PIPE:
        r, w = os.pipe()
        return (r, w) if mode == "r" else (w, r)
    return (spec if isinstance(spec, int) else spec.fileno()), None


def popen(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    stdin: Any = DEVNULL,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    fork: bool | None = None,
) -> Child:
    """``subprocess.Popen([sys.executable, *argv], ...)`` for a Python child: forked from this
    test process's server where it can be (see the module's docstring), else by ``Popen``.
    ``stdin``/``stdout``/``stderr`` as ``Popen`` takes them (``PIPE``, ``DEVNULL``,
    ``STDOUT`` for stderr, a file, None: inherited), except that stdin is ``/dev/null``
    unless given.  ``fork``: None decides as the module says, True forks whenever the
    environment allows (coverage or ``QUIRE_TEST_FORK`` notwithstanding: the fork
    server's own tests), False starts a fresh interpreter."""
    global _server
    argv, env = [str(a) for a in argv], dict(os.environ if env is None else env)
    where = Path(cwd) if cwd is not None else Path.cwd()
    if fork is None:
        fork = os.environ.get("QUIRE_TEST_FORK", "1") != "0" and not _measured()
    if fork:
        ends = [_stream(stdin, "r"), _stream(stdout, "w")]
        ends.append((ends[1][0], None) if stderr == STDOUT else _stream(stderr, "e"))
        with _lock:
            if _server is None:
                _server = _Server()
            child = _server.fork(argv, env, where, [fd for fd, _ in ends])
        for (fd, _), spec in zip(ends, (stdin, stdout, stderr)):
            if spec in (PIPE, DEVNULL):
                os.close(fd)  # the child's end: it has its copy now
        if child is not None:
            names, modes = ("stdin", "stdout", "stderr"), ("wb", "rb", "rb")
            for (_, mine), name, mode in zip(ends, names, modes):
                if mine is not None:
                    f: IO[Any] = open(mine, mode, buffering=0 if mode == "wb" else -1)  # noqa: SIM115
                    if text:
                        f = io.TextIOWrapper(f, write_through=True, line_buffering=True)  # type: ignore[arg-type]
                    setattr(child, name, f)
            return child
        for _, mine in ends:
            if mine is not None:
                os.close(mine)
    return subprocess.Popen(
        [sys.executable, *argv], env=env, cwd=where, stdin=stdin, stdout=stdout,
        stderr=stderr, text=text,
    )  # fmt: skip


def run(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)``
    through :func:`popen`; a child still running at ``timeout`` is killed and
    ``subprocess.TimeoutExpired`` raised."""
    p = popen(argv, env=env, cwd=cwd, stdout=PIPE, stderr=PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    assert p.returncode is not None
    return subprocess.CompletedProcess([sys.executable, *argv], p.returncode, out, err)


# ---- the server's side (this file run as a script) ----


def _serve(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """Import, then fork a child per request.  Returns the request and its descriptors in
    the child (which then becomes that program), ``None`` in the server at the end."""
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    import quire

    quire.save  # noqa: B018  (quire's API is imported on first use)
    # NumPy's OpenBLAS starts its thread pool at import; it is fork-safe (pthread_atfork).
    # Anything else starting a thread here would make forking unsafe: then refuse to serve.
    if threading.active_count() != 1:
        return None
    sock.send(b"ready")
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.02 if children else None)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            sock.send(json.dumps({"ended": pid, "code": code}).encode())
        if not readable:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        if not msg:  # the test process is gone
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            return json.loads(msg), fds
        for fd in fds:
            os.close(fd)
        children.add(pid)
        sock.send(json.dumps({"started": pid}).encode())


def _become(req: dict[str, Any], fds: list[int]) -> tuple[str, str | None]:
    """In the forked child: turn into ``python *argv`` as Popen would have started it.
    Returns (the script's path or ``-c``, the code of ``-c``)."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    if "tempfile" in sys.modules:  # its folder is found again, in this child's TMPDIR
        sys.modules["tempfile"].tempdir = None
    # Standard streams as Python makes them at start-up for these descriptors.
    raw = bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        mode = "rb" if fd == 0 else "wb"
        buffered = open(fd, mode, buffering=0 if raw and fd else -1, closefd=False)  # noqa: SIM115
        line = fd == 2 or os.isatty(fd)
        stream = io.TextIOWrapper(buffered, line_buffering=line, write_through=raw and fd > 0)
        setattr(sys, name, stream)
    argv = list(req["argv"])
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        return "-c", argv[1]
    script = os.path.abspath(argv[0])
    sys.argv = argv
    sys.path[0] = os.path.dirname(script)
    return script, None


if __name__ == "__main__":
    _got = _serve(socket.socket(fileno=int(sys.argv[1])))
    if _got is None:
        sys.exit(0)
    _script, _code = _become(*_got)
    del _got
    if _code is not None:
        _main = type(sys)("__main__")
        sys.modules["__main__"] = _main
        exec(compile(_code, "<string>", "exec"), _main.__dict__)
    else:
        import runpy

        runpy.run_path(_script, run_name="__main__")
