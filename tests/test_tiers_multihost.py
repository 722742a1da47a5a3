"""quire.LocalTier with two real JAX processes (jax.distributed on 127.0.0.1): refused.

The local tier supports one process so far (docs/tiers.md, "Limits"); with several, a
Checkpointer with ``local=`` must fail at once with ``NotImplementedError`` on every process,
and write nothing under either tier.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = """
import json, os, sys
import jax
pid, port, root, local = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=60)
import quire
try:
    quire.Checkpointer(root, local=quire.LocalTier(local))
    out = {"error": None}
except NotImplementedError as e:
    out = {"error": type(e).__name__, "message": str(e)}
print("RESULT " + json.dumps(out), flush=True)
jax.distributed.shutdown()
"""


def test_two_processes_refuse_the_local_tier(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    root, local = tmp_path / "persistent", tmp_path / "local"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(i), str(port), str(root), str(local)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line.removeprefix("RESULT ")))
    for r in results:
        assert r["error"] == "NotImplementedError"
        assert "one JAX process so far, not 2" in r["message"]
    assert not local.exists()
    assert not root.exists() or not any(root.iterdir())
