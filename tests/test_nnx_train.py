"""examples/nnx_train.py (Flax NNX + Optax + Grain on an Explicit 8-device mesh, a Checkpointer
with a local tier and async saves) survives SIGKILL: killed right after a save call, while that
step is still being written, and started again, it ends bit for bit where an uninterrupted run
ends: parameters, optimizer state, PRNG state and data position.

The uninterrupted run and the victim start together (two cores).  The kill step is drawn from a
seeded generator among the local tier's save steps.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import forkserver  # core/tests/forkserver.py
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "nnx_train.py"
STEPS = 24
SEED = 31


def _start(root: Path, *extra: str) -> forkserver.Child:
    # The example sets its own 8 CPU devices (XLA_FLAGS); it runs on the CPU here, as
    # JAX_PLATFORMS=cpu says (which also lets the fork server start it).
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return forkserver.popen(
        [str(EXAMPLE), str(root), "--steps", str(STEPS), *extra],
        stdout=forkserver.PIPE,
        stderr=forkserver.STDOUT,
        text=True,
        env=env,
        cwd=REPO,
    )


def _output(p: forkserver.Child, code: int = 0) -> str:
    out, _ = p.communicate(timeout=240)
    assert p.returncode == code, f"exit {p.returncode}, expected {code}:\n{out}"
    return out


def _losses(out: str) -> dict[int, str]:
    return {int(s): loss for s, loss in re.findall(r"^step (\d+) loss (\S+)", out, re.M)}


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nnx_train_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _final(root: Path, example: ModuleType) -> tuple[dict[str, bytes], Any]:
    """The last persistent step, read back in this process: every state leaf's bytes by key
    path, and the restored Grain iterator."""
    import jax

    import quire

    with quire.Checkpointer(root / "persistent") as ckpt:
        assert ckpt.latest_step() == STEPS
        got = ckpt.load_checkpointables(STEPS, {"state": None, "data": example.pipeline()})
    leaves = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(got["state"]):
        if jax.numpy.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        leaves[jax.tree_util.keystr(path)] = np.asarray(leaf).tobytes()
    return leaves, got["data"]


def test_killed_mid_save_and_restarted_it_resumes_bit_exactly(tmp_path: Path) -> None:
    every = 4  # examples/nnx_train.py LOCAL_EVERY
    die_at = random.Random(SEED).choice(range(2 * every, STEPS - every + 1, every))
    ref = _start(tmp_path / "ref")
    victim = _start(tmp_path / "victim", "--die-at", str(die_at))

    killed = _output(victim, -9)
    assert f"step {die_at} loss" in killed and "done at step" not in killed
    out = _output(_start(tmp_path / "victim"))
    m = re.search(r"^resumed from step (\d+) at data position (.*)$", out, re.M)
    assert m, out
    resumed = int(m.group(1))
    # The step being written at the kill may or may not have committed first.
    assert resumed % every == 0 and die_at - every <= resumed <= die_at, (resumed, die_at)
    assert m.group(2) == str({"next_index": resumed})  # one batch per step

    ref_out = _output(ref)
    ref_losses, losses = _losses(ref_out), _losses(out)
    assert sorted(ref_losses) == list(range(1, STEPS + 1))
    assert sorted(losses) == list(range(resumed + 1, STEPS + 1))
    assert all(losses[s] == ref_losses[s] for s in losses), (losses, ref_losses)
    final = re.findall(r"^final ([0-9a-f]{64})$", out, re.M)
    assert final and final == re.findall(r"^final ([0-9a-f]{64})$", ref_out, re.M)

    # The checkpoints themselves, read back here: the same bytes in every leaf, the same
    # data position.
    example = _example()
    ref_leaves, ref_it = _final(tmp_path / "ref", example)
    leaves, it = _final(tmp_path / "victim", example)
    assert len(leaves) >= 10 and leaves.keys() == ref_leaves.keys()
    assert any("rngs" in k and "key" in k for k in leaves), sorted(leaves)
    assert [k for k in leaves if leaves[k] != ref_leaves[k]] == []
    assert it.get_state() == ref_it.get_state() == {"next_index": STEPS}
    for a, b in zip(next(it).values(), next(ref_it).values()):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
