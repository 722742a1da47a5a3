"""Readers during an overwrite on S3 (moto) and GCS (fake-gcs-server), issues 13 and 39: a
load racing an overwriting writer process loads a whole version or raises
CheckpointChangedError, never CorruptCheckpointError."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from object_store_servers import SCHEMES, STORES

import quire
from quire.errors import CheckpointChangedError, CorruptCheckpointError

WRITER = textwrap.dedent(
    """
    import json, os, sys, time
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np, quire
    url, opts, seconds = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
    # The clock starts once imported (a loaded machine may take seconds to import jax), and
    # the writer overwrites at least twice whatever the machine's speed.
    until = time.time() + seconds
    i = 1
    while i <= 2 or time.time() < until:
        quire.save(url, {f"w{k}": np.full(64, float(i), np.float32) for k in range(8)},
                   overwrite=True, storage_options=opts)
        i += 1
    print("SAVES", i - 1)
    """
)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_reader_looping_against_an_overwriting_writer(
    scheme: str, request: pytest.FixtureRequest
) -> None:
    store = request.getfixturevalue(STORES[scheme].fixture)
    url, opts = store.fresh_url(), store.options()
    quire.save(url, {f"w{k}": np.zeros(64, np.float32) for k in range(8)}, storage_options=opts)
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, url, json.dumps(opts), "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    counts = {"ok": 0, "changed": 0, "corrupt": 0, "torn": 0}
    errors: list[str] = []
    try:
        while writer.poll() is None:
            try:
                got = quire.load(url, storage_options=opts)
            except CheckpointChangedError:
                counts["changed"] += 1
                continue
            except CorruptCheckpointError as e:
                counts["corrupt"] += 1
                errors.append(str(e))
                continue
            counts["ok" if len({float(v[0]) for v in got.values()}) == 1 else "torn"] += 1
    finally:
        out, err = writer.communicate(timeout=120)
    saves = int(out.split("SAVES")[1]) if "SAVES" in out else 0
    print(f"{url.split(':')[0]} reader-during-overwrite: {saves} overwrites, loads {counts}")
    assert writer.returncode == 0, err[-2000:]
    assert counts["corrupt"] == 0 and counts["torn"] == 0, (counts, errors[:3])
    assert counts["ok"] > 0 and saves > 1, (counts, saves)
