"""The parent's half of the multi-process harness: start N worker processes, wait, collect.

Every multi-process test starts its workers here (``tests/test_*_multihost.py``); the workers
take their part from ``worker_harness.py``.  A launch:

* starts ``n`` processes of ``python WORKER ARGS...`` on this machine, each told its process
  index, the process count, the coordinator's address (a free port on 127.0.0.1) and its
  CPU device count through the environment (``QUIRE_MH_*``, ``XLA_FLAGS``, ``JAX_PLATFORMS``);
  the worker's ``worker_harness.init()`` turns them into ``jax.distributed.initialize``;
  each is forked from the test process's fork server (``core/tests/forkserver.py``: JAX
  imported once) where its environment allows, else started by ``Popen``;
* waits for every process to end (but ``stuck``, one that never will), or for ``stop_on``
  (one process's death) whichever comes
  first, under one deadline shared by all of them; the processes still running then are
  SIGKILLed (JAX's preemption notifier swallows SIGTERM);
* collects the JSON result lines the workers printed with ``worker_harness.report`` (the
  ``QUIRE-MH`` prefix) from their stdout files, and their stderr.

``Group`` keeps such processes up and feeds them one command at a time on stdin (the
generated multi-process cases, which would otherwise pay the JAX start-up per case).

``free_port`` is the one free TCP port helper of the test tree (``tests/``).
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

# core/tests/forkserver.py: tests/conftest.py puts core/tests on sys.path; a benchmark or
# CI script that imports this module (or object_store_servers) as a script gets it here.
_CORE_TESTS = str(Path(__file__).resolve().parents[2] / "core" / "tests")
if _CORE_TESTS not in sys.path:
    sys.path.append(_CORE_TESTS)
import forkserver  # noqa: E402

Proc = forkserver.Child

PREFIX = "QUIRE-MH "
# Set by the harness for every worker; a test's own environment never carries them over.
_OURS = ("XLA_FLAGS", "JAX_PLATFORMS", "QUIRE_MH_PROCESS", "QUIRE_MH_PROCESSES")


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_env(
    process: int,
    processes: int,
    coordinator: str,
    devices: int | None,
    extra: dict[str, str],
    drop: Sequence[str] = (),
) -> dict[str, str]:
    """The environment of one worker: the test's, less what the harness sets and ``drop``,
    plus ``extra`` and the harness's."""
    env = {k: v for k, v in os.environ.items() if k not in _OURS and k not in drop}
    env.update(extra)
    env.update(
        JAX_PLATFORMS="cpu",
        QUIRE_MH_PROCESS=str(process),
        QUIRE_MH_PROCESSES=str(processes),
        QUIRE_MH_COORDINATOR=coordinator,
    )
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        env["QUIRE_MH_DEVICES"] = str(devices)
    return env


def parse(text: str) -> list[dict[str, Any]]:
    """The result lines in a worker's output."""
    return [
        json.loads(line[len(PREFIX) :]) for line in text.splitlines() if line.startswith(PREFIX)
    ]


@dataclass
class Run:
    """What one launch left: every process's result lines, exit codes and stderr.

    ``returncodes[i]`` is ``-SIGKILL`` for a process still running when the launch stopped
    waiting (the deadline, or ``launch(stop_on=...)``)."""

    results: list[dict[str, Any]]
    returncodes: list[int]
    stderr: list[str]
    seconds: float

    def of(self, check: str, pid: int | None = None) -> list[dict[str, Any]]:
        """Result lines of ``check`` (of process ``pid``, or every process's), by process."""
        got = [r for r in self.results if r.get("check") == check and pid in (None, r["pid"])]
        return sorted(got, key=lambda r: r["pid"])

    def one(self, check: str, pid: int, **match: Any) -> dict[str, Any]:
        got = [r for r in self.of(check, pid) if all(r.get(k) == v for k, v in match.items())]
        assert len(got) == 1, (check, pid, match, got, self.failures())
        return got[0]

    def failures(self) -> list[Any]:
        """Result lines that report a failure, then the stderr tails of failed processes."""
        return [r for r in self.results if "failed" in r or r.get("check") == "failed"] + [
            e[-3000:] for e, rc in zip(self.stderr, self.returncodes) if rc
        ]

    def assert_ok(self) -> None:
        """Nothing failed, every process exited 0 after reporting ``done``."""
        assert not [r for r in self.results if "failed" in r or r.get("check") == "failed"], (
            self.failures()
        )
        assert self.returncodes == [0] * len(self.returncodes), (
            self.returncodes,
            self.failures(),
        )
        assert len(self.of("done")) == len(self.returncodes), self.failures()


def _watch(procs: Sequence[Proc]) -> queue.Queue[int]:
    """A queue that receives each process's index as soon as it exits."""
    ended: queue.Queue[int] = queue.Queue()

    def wait(i: int, p: Proc) -> None:
        p.wait()
        ended.put(i)

    for i, p in enumerate(procs):
        threading.Thread(target=wait, args=(i, p), daemon=True).start()
    return ended


def _kill(procs: Sequence[Proc]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)  # JAX's preemption notifier swallows SIGTERM
            p.wait()


def launch(
    worker: Path,
    n: int,
    args: Sequence[str],
    logs: Path,
    *,
    name: str,
    devices: int | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    env_of: Callable[[int], dict[str, str]] | None = None,
    drop: Sequence[str] = (),
    stop_on: int | None = None,
    stuck: int | None = None,
) -> Run:
    """Run ``python worker *args`` as ``n`` processes of ``devices`` CPU devices each.

    Waits until every process has ended, or ``timeout`` seconds (one deadline for all), or
    process ``stop_on`` has ended (a victim: the others are then killed as a job would be), or
    every process but ``stuck`` has ended (one stuck on purpose, never reaching its end);
    then SIGKILLs the processes still running.  Their output goes to
    ``logs/<name>-<i>.out`` / ``.err``.  ``env`` is added to every process's environment,
    ``env_of(i)`` to process ``i``'s; the variables named in ``drop`` are removed.
    """
    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    stems = [logs / f"{name}-{port}-{i}" for i in range(n)]
    procs: list[Proc] = []
    t0 = time.monotonic()
    try:
        for i, stem in enumerate(stems):
            own = {**(env or {}), **(env_of(i) if env_of else {})}
            penv = worker_env(i, n, f"127.0.0.1:{port}", devices, own, drop)
            with open(f"{stem}.out", "w") as out, open(f"{stem}.err", "w") as err:
                argv = [str(worker), *args]
                procs.append(forkserver.popen(argv, env=penv, stdout=out, stderr=err))
        ended, left = _watch(procs), set(range(n)) - {stuck}
        while left:
            try:
                i = ended.get(timeout=max(0.0, timeout - (time.monotonic() - t0)))
            except queue.Empty:
                break
            left.discard(i)
            if i == stop_on:
                break
    finally:
        _kill(procs)
    codes = [p.returncode for p in procs]  # every one has ended: killed ones -SIGKILL
    seconds = time.monotonic() - t0
    results: list[dict[str, Any]] = []
    for stem in stems:
        results += parse(Path(f"{stem}.out").read_text())
    stderr = [Path(f"{stem}.err").read_text() for stem in stems]
    return Run(results, codes, stderr, seconds)


class GroupDied(Exception):
    """A process of a ``Group`` ended, or did not answer in time."""


class Group:
    """``n`` worker processes of ``devices`` CPU devices each, kept up and fed commands.

    Each command is one JSON line on every process's stdin; each process answers with one
    result line (``worker_harness.report``) on stdout.  A process that dies or does not
    answer within ``answer_s`` ends the group (``GroupDied``); ``ensure()`` starts it again.
    """

    def __init__(
        self, worker: Path, n: int, devices: int, logs: Path, *, answer_s: float = 240.0
    ) -> None:
        self.worker, self.n, self.devices, self.logs = worker, n, devices, logs
        self.answer_s = answer_s
        self.procs: list[Proc] = []
        self.started = 0

    @property
    def label(self) -> str:
        return f"{self.n}x{self.devices}"

    def _err(self, i: int) -> Path:
        return self.logs / f"{self.label}-{self.started}-{i}.err"

    def start(self) -> list[dict[str, Any]]:
        """Start the processes; their answers to ``{"op": "hello"}``."""
        port = free_port()
        self.started += 1
        for i in range(self.n):
            penv = worker_env(i, self.n, f"127.0.0.1:{port}", self.devices, {})
            with open(self._err(i), "w") as err:
                p = forkserver.popen(
                    [str(self.worker)], env=penv, stdin=forkserver.PIPE,
                    stdout=forkserver.PIPE, stderr=err, text=True,
                )  # fmt: skip
                self.procs.append(p)
        return self.ask({"op": "hello"})

    def ensure(self) -> list[dict[str, Any]] | None:
        """Start the group unless every process of it is running: the answers to ``hello``
        when it started, ``None`` when it was up."""
        if self.procs and all(p.poll() is None for p in self.procs):
            return None
        self.stop()
        return self.start()

    def ask(self, cmd: dict[str, Any]) -> list[dict[str, Any]]:
        """Send ``cmd`` to every process; their answers, by process index."""
        line = json.dumps(cmd) + "\n"
        try:
            for p in self.procs:
                assert p.stdin is not None
                p.stdin.write(line)
                p.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            self.stop()
            raise GroupDied(f"{self.label}: a process is gone ({e})") from e
        deadline = time.monotonic() + self.answer_s
        out: list[dict[str, Any] | None] = [None] * self.n
        outs: list[IO[str] | None] = [p.stdout for p in self.procs]
        while any(a is None for a in out):
            waiting = [f for f, a in zip(outs, out) if a is None]
            ready, _, _ = select.select(waiting, [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                self.stop()
                raise GroupDied(f"{self.label}: no answer to {cmd['op']} in {self.answer_s} s")
            for f in ready:
                i = outs.index(f)
                assert f is not None
                text = f.readline()
                if not text:
                    tail = self._stderr_tail(i)
                    self.stop()
                    raise GroupDied(f"{self.label}: process {i} died:\n{tail}")
                if text.startswith(PREFIX):
                    out[i] = json.loads(text[len(PREFIX) :])
        return [a for a in out if a is not None]

    def _stderr_tail(self, i: int) -> str:
        try:
            return self._err(i).read_text()[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Ask every process to quit; SIGKILL those that have not within 10 s."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    assert p.stdin is not None
                    p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                    p.stdin.flush()
                except (BrokenPipeError, OSError):
                    pass
        t = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, t - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)  # JAX's preemption notifier swallows SIGTERM
                p.wait()
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()
        self.procs = []
