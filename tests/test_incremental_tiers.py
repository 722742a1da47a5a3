"""Incremental promotion (``Checkpointer(root, incremental=True, local=quire.LocalTier(...))``):
a step promoted from the local tier to the persistent one uploads only the chunks the
persistent tier's previous step does not store (``quire._tiers.promotion``); every
persistent step still loads bit-identically and verifies.  On a local directory and on S3
(moto), where the bytes the server stores are counted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import quire
from quire._cli.main import main as cli
from quire._format import root as _root
from quire.policies import EveryNSteps, LatestN

N_FROZEN = 9


def name(step: int) -> str:
    return _root.DEFAULT_STEP_FORMAT.format(step)


def rand(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((128, 256)).astype(np.float32)


def trees(n: int) -> list[dict[str, Any]]:
    """A fine-tune: 90 % of the bytes frozen (the same arrays), 10 % new every step."""
    frozen = {f"layer{i}": jnp.asarray(rand(100 + i)) for i in range(N_FROZEN)}
    return [{"frozen": frozen, "lora": jnp.asarray(rand(s)), "step": s} for s in range(n)]


def same(a: Any, b: Any) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
    )


def promote_steps(
    url: str, local: Path, stored: Any, ts: list[dict[str, Any]], **kw: Any
) -> list[int]:
    """Save every tree (local every step, persistent every step); bytes each promotion
    adds to the persistent tier (``stored()``: what it holds)."""
    grew = []
    with quire.Checkpointer(
        url,
        incremental=True,
        keep=LatestN(2),
        local=quire.LocalTier(local, save_policy=EveryNSteps(1), keep=LatestN(2)),
        **kw,
    ) as ck:
        for s, t in enumerate(ts):
            before = stored()
            ck.save(s, t)
            ck.wait()
            grew.append(stored() - before)
        assert ck.tiers_of(len(ts) - 1) == ("local", "persistent")
    return grew


def test_promotion_uploads_only_what_the_persistent_tier_lacks(tmp_path: Path) -> None:
    root = tmp_path / "persistent"

    def stored() -> int:
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())

    ts = trees(4)
    grew = promote_steps(str(root), tmp_path / "local", stored, ts)
    assert all(g <= 0.12 * grew[0] for g in grew[1:]), grew
    rec = json.loads((root / name(3) / "quire.json").read_text())
    (lent,) = rec["indexes"][0]["borrowed"]
    assert lent.startswith(f"../{name(0)}/")  # the frozen bytes: step 0's pack
    for s in (2, 3):  # retention kept the last two; step 0's pack with them
        url = str(root / name(s))
        assert same(quire.load(url), ts[s])
        assert cli(["verify", url]) == 0
    # a plain copy (the behaviour before) would have uploaded everything again
    assert grew[1] < 0.2 * grew[0]


def test_incremental_promotion_on_s3(moto: Any, tmp_path: Path) -> None:
    url = moto.fresh_url()
    bucket, prefix = url[len("s3://") :].split("/", 1)
    client = moto.client()

    def stored() -> int:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sum(o["Size"] for page in pages for o in page.get("Contents", []))

    ts = trees(3)
    grew = promote_steps(url, tmp_path / "local", stored, ts, storage_options=moto.options())
    assert grew[1] <= 0.12 * grew[0] and grew[2] <= 0.12 * grew[0], grew
    for s in (1, 2):
        got = quire.load(f"{url}/{name(s)}", storage_options=moto.options())
        assert same(got, ts[s])
        report = quire.verify(f"{url}/{name(s)}", storage_options=moto.options())
        assert not report.problems


def test_crash_during_promotion_leaves_every_persistent_step_whole(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A process killed at the n-th backend write of a save (the local save or the
    promotion after it), for every n up to past the promotion's end: the restarted run
    promotes on, and every committed persistent step loads bit-identically and verifies;
    a gc then frees nothing a step uses."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "core" / "tests"))
    from test_incremental_machine import Faults

    faults = Faults()
    faults.install(monkeypatch)
    ts = trees(40)
    want: dict[int, dict[str, Any]] = {}
    root = tmp_path / "persistent"

    def open_ck() -> quire.Checkpointer:
        return quire.Checkpointer(
            root,
            incremental=True,
            keep=LatestN(2),
            gc_grace_period=None,
            local=quire.LocalTier(tmp_path / "local", save_policy=EveryNSteps(1), keep=LatestN(2)),
        )

    ck = open_ck()
    ck.save(0, ts[0])
    ck.wait()
    want[0] = ts[0]
    step = 0
    for n in range(1, 16):  # a save is about 11 write calls: 5 to 11 are the promotion
        step += 1
        faults.at = faults.calls + n
        try:
            ck.save(step, ts[step])
            ck.wait()
        except Exception:
            pass
        try:
            ck.close()
        except Exception:
            pass
        faults.at = None
        if (root / name(step) / "quire.json").exists():
            want[step] = ts[step]
        ck = open_ck()  # the restarted run
        step += 1
        ck.save(step, ts[step])  # promoted from a new run: borrows after a resume
        ck.wait()
        want[step] = ts[step]
        for s in sorted(want):
            if (root / name(s) / "quire.json").exists():
                url = str(root / name(s))
                assert same(quire.load(url), want[s]), (n, s)
                assert not quire.verify(url).problems, (n, s)
    ck.gc(0)
    ck.close()
    kept = [s for s in sorted(want) if (root / name(s) / "quire.json").exists()]
    assert kept == [step - 1, step]
    for s in kept:
        assert same(quire.load(str(root / name(s))), want[s])
        assert not quire.verify(str(root / name(s))).problems
