"""Ctrl-C during a large overwrite (issue 13): exit says what it waits for, a second
Ctrl-C stops quire's threads in order (no abort in native code), and the checkpoint
stays whole."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import forkserver
import numpy as np

import quire

SCRIPT = textwrap.dedent(
    """
    import faulthandler, os, signal, sys
    # Ctrl-C as in a terminal, even when the suite itself runs as a background job of a
    # non-interactive shell: such a job starts with SIGINT ignored, its children inherit
    # that, and Python then installs no KeyboardInterrupt handler at all.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np, quire
    url = sys.argv[1]
    i = 0
    # Still running long after the Ctrl-C: every thread's stack on stderr, then exit(1).
    faulthandler.dump_traceback_later(float(sys.argv[2]), exit=True)
    while True:
        i += 1
        tree = {f"w{k}": np.full(1 << 20, float(i), np.float32) for k in range(24)}
        quire.save(url, tree, overwrite=True)
        if i == 1:
            # READY once quire is loaded (its API imports JAX on first use): a Ctrl-C while
            # JAX imports can land in JAX's gc callback, where Python drops it
            # ("Exception ignored in _xla_gc_callback"), and the loop would never see it.
            print("READY", flush=True)
    """
)


# A run that has not ended this long after its Ctrl-C is stuck: it prints its threads' stacks
# and exits (faulthandler), so the failure says where it waited.
STUCK_S = 90.0


def _interrupt_once(url: str, second_after: float) -> subprocess.CompletedProcess[str]:
    p = forkserver.popen(
        ["-c", SCRIPT, url, str(STUCK_S)],
        stdout=forkserver.PIPE,
        stderr=forkserver.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "QUIRE_IO_THREADS": "4"},
    )
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "READY"
    time.sleep(1.5)  # inside an overwrite
    p.send_signal(signal.SIGINT)
    if second_after >= 0:
        time.sleep(second_after)
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    signals = _signal_state(p.pid)
    try:
        out, err = p.communicate(timeout=STUCK_S + 60)
    finally:
        if p.poll() is None:  # never left running behind the rest of the suite
            p.kill()
            p.communicate()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err + signals)


def _signal_state(pid: int) -> str:
    """The child's signal masks and pending sets per thread, a second after the last
    Ctrl-C (read from /proc; shown only if the run fails)."""
    time.sleep(1.0)
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            status = (task / "status").read_text()
        except OSError:
            continue
        keep = [ln for ln in status.splitlines() if ln.startswith(("Name", "Sig", "ShdPnd"))]
        lines.append(" ".join(" ".join(ln.split()) for ln in keep))
    return "\n--- signal state a second after the Ctrl-C:\n" + "\n".join(lines)


def test_ctrl_c_during_overwrites_exits_cleanly(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    quire.save(url, {f"w{k}": np.zeros(1 << 20, np.float32) for k in range(24)})
    codes = []
    for i, second in enumerate([-1, 0.05, 0.3, 1.2]):
        r = _interrupt_once(url, second)
        codes.append(r.returncode)
        # -SIGINT / 130 / 1: an interrupted Python; never SIGABRT or SIGSEGV from native code.
        assert "Timeout (" not in r.stderr, (
            f"still running {STUCK_S:g} s after Ctrl-C:\n{r.stderr[-12000:]}"
        )
        assert r.returncode in (-signal.SIGINT, 130, 1, 0), (i, r.returncode, r.stderr[-3000:])
        assert "terminate called" not in r.stderr, r.stderr[-3000:]
        got = quire.load(url)  # whole: one version everywhere
        assert len({float(v[0]) for v in got.values()}) == 1
        assert len({float(v[-1]) for v in got.values()}) == 1
    print("interrupt exit codes", codes)


def test_exit_says_what_it_waits_for(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    quire.save(url, {"x": 0})
    script = textwrap.dedent(
        """
        import sys, time
        import numpy as np, quire
        from quire._engine import save as _saving
        orig = _saving.save_prepared
        async def slow(*a, **k):
            import asyncio
            await asyncio.sleep(2.5)
            return await orig(*a, **k)
        _saving.save_prepared = slow
        quire.save_async(sys.argv[1], {"x": 1}, overwrite=True)
        """
    )
    r = forkserver.run(["-c", script, url], timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr
    assert "waiting at exit" in r.stderr and f"save {url}" in r.stderr, r.stderr
    assert quire.load(url)["x"] == 1
