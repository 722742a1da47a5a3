"""examples/train_loop.py survives preemption and SIGKILL: stopped twice and restarted, it
ends with exactly (bit for bit) the state of an uninterrupted run.

The uninterrupted run and the victim start together (two cores).  The victim sleeps a little
per step so that it is still training when its output shows a committed checkpoint; it then
gets SIGTERM (it saves the next step and exits), is started again, gets SIGKILL (possibly in
the middle of a save), and is started a third time: each start resumes from the latest
committed step.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import forkserver  # core/tests/forkserver.py
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_loop.py"
STEPS = 300


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("XLA_FLAGS", None)  # one device, as a user would run it
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start(root: Path, *extra: str, steps: int = STEPS) -> forkserver.Child:
    return forkserver.popen(
        [str(EXAMPLE), str(root), "--steps", str(steps), *extra],
        stdout=forkserver.PIPE,
        stderr=forkserver.STDOUT,
        text=True,
        env=_env(),
        cwd=REPO,
    )


def _finish(p: forkserver.Child, timeout: float = 120) -> str:
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"exit {p.returncode}:\n{out}"
    return out


def _final_state(root: Path) -> Any:
    import quire

    with quire.Checkpointer(root / "train") as ckpt:
        assert ckpt.latest_step() == STEPS
        return ckpt.load(STEPS)


def _assert_bit_equal(a: Any, b: Any) -> None:
    import jax

    la, ta = jax.tree.flatten_with_path(a)
    lb, tb = jax.tree.flatten_with_path(b)
    assert str(ta) == str(tb)
    for (path, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert x.tobytes() == y.tobytes(), f"{jax.tree_util.keystr(path)} differs"


def _signal_when_committed(
    p: forkserver.Child, min_committed: int, sig: signal.Signals
) -> tuple[int, str]:
    """Send ``sig`` once ``p`` reports a committed step >= ``min_committed``.

    Returns (the step ``p`` had reached, its whole output).
    """
    seen: list[str] = []
    sent_at: list[int] = []

    def watch() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            seen.append(line)
            m = re.match(r"step (\d+) loss \S+ committed (\d+)", line)
            if m and int(m.group(2)) >= min_committed and not sent_at:
                p.send_signal(sig)
                sent_at.append(int(m.group(1)))

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    p.wait(timeout=120)
    t.join(timeout=10)
    out = "".join(seen)
    assert sent_at, f"the run ended before it got {sig.name}:\n{out}"
    assert sent_at[0] < STEPS
    return sent_at[0], out


def test_preempt_kill_and_resume_is_bit_exact(tmp_path: Path) -> None:
    ref_root, victim_root = tmp_path / "ref", tmp_path / "victim"
    ref = _start(ref_root)

    # 1. Preempted (SIGTERM): it saves at the next step and exits cleanly.
    victim = _start(victim_root, "--sleep", "0.01")
    at, out = _signal_when_committed(victim, 25, signal.SIGTERM)
    assert victim.returncode == 0, out
    m = re.search(r"preempted: saved step (\d+), exiting", out)
    assert m, out
    preempted = int(m.group(1))
    assert at <= preempted < STEPS and f"done at step {preempted}" in out

    # 2. Resumed from the preemption save, then killed with SIGKILL.
    victim = _start(victim_root, "--sleep", "0.01")
    killed_at, out = _signal_when_committed(victim, preempted + 1, signal.SIGKILL)
    assert victim.returncode == -signal.SIGKILL, out
    assert f"resumed from step {preempted}" in out

    # 3. Resumed again: it runs to the end.  Meanwhile another run continues from the
    # reference run's checkpoint with only its params (its optimizer state ignored).
    ref_out = _finish(ref)
    assert f"done at step {STEPS}" in ref_out
    other = tmp_path / "finetune"
    finetune = _start(other, "--every", "10", "--init-from", str(ref_root / "train"), steps=10)
    out = _finish(_start(victim_root))
    m = re.search(r"resumed from step (\d+)", out)
    assert m, out
    # (It may have committed a later step between the line we saw and the kill.)
    assert preempted < int(m.group(1)) < STEPS, (out, killed_at)
    assert f"done at step {STEPS}" in out

    _assert_bit_equal(_final_state(ref_root), _final_state(victim_root))

    # The keep policy, LatestN(2) | BestN(1, val_loss), in both runs.
    import quire

    for root in (ref_root, victim_root):
        with quire.Checkpointer(root / "train") as c:
            steps = c.steps()
            assert steps[-2:] == [STEPS - 25, STEPS] and len(steps) <= 3, steps
            assert c.best_step("val_loss", mode="min") in steps
    # The params-only checkpoints: the latest and every 100th, with only the params.
    with quire.Checkpointer(victim_root / "params") as p:
        assert p.steps() == [100, 200, 300]
        assert set(p.load(300)) == {"params"}
        _assert_bit_equal(p.load(300)["params"], _final_state(ref_root)["params"])

    out = _finish(finetune)
    assert f"initialised params from {ref_root / 'train'} step {STEPS}" in out
    with quire.Checkpointer(other / "train") as c:
        assert c.steps() == [10]
        first = c.load(10)
    # It started from the reference run's params, not from a fresh init.
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_loop_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    w = np.asarray(first["params"]["layer0"]["w"])
    w_ref = np.asarray(_final_state(ref_root)["params"]["layer0"]["w"])
    w_fresh = np.asarray(example.init_params()["layer0"]["w"])
    assert np.abs(w - w_ref).max() < np.abs(w - w_fresh).max() / 4
