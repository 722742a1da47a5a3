"""quire.LocalTier over a real S3 (moto behind a request-logging proxy), with kill -9.

A child process runs a training loop (local tier every step, persistent tier on S3 every 4
steps) and SIGKILLs itself right after ``save`` of step 7 returns (the local write and commit
are then in flight).  A restart in this process then:

* with the local directory intact: restores the newest step committed in any tier,
  bit-identical to the state an uninterrupted run has at that step, with 0 GET requests for
  objects of the persistent tier's steps (counted at the proxy);
* with the local directory wiped: restores step 4 from the persistent tier (promoted from the
  local tier's bytes), bit-identical, reading its objects from S3.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from object_store_servers import FaultProxy, MotoS3

import quire
from quire.policies import EveryNSteps

STATE = """
import numpy as np, jax, jax.numpy as jnp
def state(step):
    rng = np.random.default_rng(step)
    return {
        "params": {"w": jnp.asarray(rng.standard_normal((128, 64), dtype=np.float32)),
                   "b": jnp.asarray(rng.standard_normal(64, dtype=np.float32))},
        "opt": rng.integers(0, 1 << 30, 1000, dtype=np.int64),
        "step": step,
    }
"""

CHILD = (
    STATE
    + """
import json, os, signal, sys
import quire
from quire.policies import EveryNSteps
cfg = json.loads(sys.argv[1])
c = quire.Checkpointer(cfg["persistent"], save_policy=EveryNSteps(4),
                       storage_options=cfg["options"],
                       local=quire.LocalTier(cfg["local"], save_policy=EveryNSteps(1)))
for step in range(1, 8):
    c.save(step, state(step))
    if step == 6:
        c.wait()  # step 4's promotion has landed; step 7 is the one in flight at the kill
    if step == 7:
        os.kill(os.getpid(), signal.SIGKILL)
"""
)


@pytest.fixture(scope="module")
def proxy(moto: MotoS3) -> Iterator[FaultProxy]:
    p = FaultProxy((moto.host, moto.port), "s3")
    yield p
    p.stop()


def state(step: int) -> dict[str, Any]:
    ns: dict[str, Any] = {}
    exec(STATE, ns)
    return ns["state"](step)  # type: ignore[no-any-return]


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for x, y in zip(
        [a["params"]["w"], a["params"]["b"], a["opt"]],
        [b["params"]["w"], b["params"]["b"], b["opt"]],
    ):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    assert a["step"] == b["step"]


def step_gets(proxy: FaultProxy, prefix: str) -> list[Any]:
    """GET requests for objects inside the persistent tier's step directories."""
    return [e for e in proxy.requests("GET", rf"/{prefix}/step_\d+/") if "?list-type" not in e[1]]


def run_child(tmp_path: Path, moto: MotoS3, proxy: FaultProxy) -> tuple[str, dict[str, Any]]:
    url = moto.fresh_url()
    cfg = {
        "persistent": url,
        "local": str(tmp_path / "local"),
        "options": moto.options(proxy.endpoint),
    }
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), json.dumps(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    return url, cfg


def test_kill_during_local_save_restores_from_local_with_no_persistent_gets(
    tmp_path: Path, moto: MotoS3, proxy: FaultProxy
) -> None:
    url, cfg = run_child(tmp_path, moto, proxy)
    prefix = url.split("/", 3)[3]
    abstract = state(0)
    proxy.clear()
    with quire.Checkpointer(
        url,
        save_policy=EveryNSteps(4),
        storage_options=cfg["options"],
        local=quire.LocalTier(cfg["local"], save_policy=EveryNSteps(1)),
    ) as c:
        step = c.latest_step()
        # Step 7 was killed mid-save: it is there only if its local commit landed first.
        assert step in (6, 7), c.steps()
        assert c.tiers_of(4) == ("local", "persistent") and c.tiers_of(6) == ("local",)
        same(c.load(step, abstract), state(step))
    assert step_gets(proxy, prefix) == []
    # Sanity of the count: the same restore from the persistent tier does GET step objects.
    proxy.clear()
    with quire.Checkpointer(url, storage_options=cfg["options"]) as plain:
        same(plain.load(4, abstract), state(4))
    assert len(step_gets(proxy, prefix)) >= 2


def test_wiped_local_dir_restores_the_promoted_step(
    tmp_path: Path, moto: MotoS3, proxy: FaultProxy
) -> None:
    url, cfg = run_child(tmp_path, moto, proxy)
    shutil.rmtree(cfg["local"])
    with quire.Checkpointer(
        url,
        save_policy=EveryNSteps(4),
        storage_options=cfg["options"],
        local=quire.LocalTier(cfg["local"], save_policy=EveryNSteps(1)),
    ) as c:
        assert c.latest_step() == 4 and c.tiers_of(4) == ("persistent",)
        same(c.load(None, state(0)), state(4))
        # Training goes on: the next saves land in a fresh local tier again.
        c.save(5, state(5))
        c.wait()
        assert c.tiers_of(5) == ("local",)


def test_persistent_tier_counts_a_step_only_after_its_commit(
    tmp_path: Path, moto: MotoS3, proxy: FaultProxy
) -> None:
    url = moto.fresh_url()
    opts = moto.options(proxy.endpoint)
    proxy.clear()
    # The promotion's commit (the conditional PUT of the step's quire.json) is held.
    held = proxy.add("hold", method="PUT", path=r"/step_00000002/quire\.json")
    c = quire.Checkpointer(
        url, save_policy=EveryNSteps(2), storage_options=opts,
        local=quire.LocalTier(tmp_path / "local", save_policy=EveryNSteps(1)),
    )  # fmt: skip
    try:
        c.save(1, state(1))
        c.save(2, state(2))
        proxy.wait_arrivals(held, 1, timeout=60)
        # The local commit is done; the data is on S3; the persistent commit is not.
        c._tier.inner.wait()  # type: ignore[union-attr]
        assert c.tiers_of(2) == ("local",) and c.latest_step() == 2
        with quire.Checkpointer(url, storage_options=opts) as other:
            assert other.steps() == []
    finally:
        proxy.release(held)
    c.close()
    assert c.tiers_of(2) == ("local", "persistent")
    with quire.Checkpointer(url, storage_options=opts) as other:
        assert other.steps() == [2]


def test_unreachable_persistent_tier_fails_promotions_not_local_saves(
    tmp_path: Path, moto: MotoS3, proxy: FaultProxy
) -> None:
    url = moto.fresh_url()
    opts = moto.options(proxy.endpoint, retry_deadline=1)
    proxy.clear()
    c = quire.Checkpointer(
        url, save_policy=EveryNSteps(2), storage_options=opts,
        local=quire.LocalTier(tmp_path / "local", save_policy=EveryNSteps(1)),
    )  # fmt: skip
    down = proxy.add("503", times=-1)  # every request to S3 fails from now on
    c.save(1, state(1))
    c.save(2, state(2))
    with pytest.raises(Exception) as err:
        c.wait()
    assert "promotion of step 2" in "".join(getattr(err.value, "__notes__", []))
    assert c.tiers_of(1) == ("local",) and c.tiers_of(2) == ("local",)
    c.save(3, state(3))  # the loop goes on with the local tier
    c.wait()
    assert c.latest_step() == 3
    same(c.load(None, state(0)), state(3))
    proxy.release(down)
    proxy.clear()
    c.close()
