"""Coordination of a save across JAX processes, through JAX's distributed key-value store.

Every process calls the same quire operations in the same order (the SPMD contract), so
a per-process operation counter names each operation identically everywhere.  For one
save:

1. the primary publishes the txid; the others wait for it (``agree_txid``);
2. every process writes the chunks it owns, then publishes its status and a digest of
   each leaf record it computed (``report``);
3. the primary collects every status within the timeout — a failed, disagreeing or
   silent process aborts the save — commits, and publishes the outcome (``decide``);
4. the others wait for the outcome and raise if the save was aborted (``outcome``).

With one process all of this is a no-op.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import secrets
import threading
from typing import Any

from quire._io import run_blocking
from quire.errors import QuireError

_seq_lock = threading.Lock()
_seq = itertools.count(1)


class MultiProcessError(QuireError):
    """Another process failed, disagreed, or stopped responding during a collective save."""


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise MultiProcessError(
            "several JAX processes but no distributed client: call jax.distributed.initialize()"
        )
    return client


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


class Coordinator:
    """One collective operation (see the module docstring)."""

    def __init__(self, url: str, what: str, *, primary: int, timeout: float | None) -> None:
        import jax

        self.index = jax.process_index()
        self.count = jax.process_count()
        self.primary = primary
        self.timeout_ms = int((timeout if timeout is not None else 3600.0) * 1000)
        self.active = self.count > 1
        self.url = url
        with _seq_lock:
            n = next(_seq)
        self.key = f"quire/{n}/{hashlib.sha256(url.encode()).hexdigest()[:12]}/{what}"
        if self.active and not 0 <= primary < self.count:
            raise MultiProcessError(f"primary process {primary} is not in 0..{self.count - 1}")

    @property
    def is_primary(self) -> bool:
        return self.index == self.primary

    def agree_txid(self) -> str:
        """The operation's txid, chosen by the primary (blocking; called in the caller)."""
        if not self.active:
            return secrets.token_hex(8)
        c = _client()
        if self.is_primary:
            txid = secrets.token_hex(8)
            c.key_value_set(f"{self.key}/txid", txid)
            return txid
        try:
            return str(c.blocking_key_value_get(f"{self.key}/txid", self.timeout_ms))
        except Exception as e:
            raise MultiProcessError(
                f"{self.url}: process {self.index} timed out waiting for primary process "
                f"{self.primary} to start the save ({e})"
            ) from e

    async def report(self, error: str | None, digests: dict[str, str] | None = None) -> None:
        if not self.active:
            return
        status = json.dumps({"error": error, "digests": digests or {}})
        await run_blocking(_client().key_value_set, f"{self.key}/status/{self.index}", status)

    async def collect(self, mine: dict[str, str]) -> str | None:
        """Primary: wait for every status; return why the save must abort, or None."""
        c = _client()
        for i in range(self.count):
            if i == self.index:
                continue
            try:
                raw = await run_blocking(
                    c.blocking_key_value_get, f"{self.key}/status/{i}", self.timeout_ms
                )
            except Exception as e:
                return f"process {i} did not finish writing within the timeout ({e})"
            st = json.loads(raw)
            if st["error"]:
                return f"process {i} failed: {st['error']}"
            theirs: dict[str, str] = st["digests"]
            for path, d in mine.items():
                if theirs.get(path) != d:
                    return (
                        f"leaf {path!r} differs between process {self.index} and process {i} "
                        "(non-array leaves and array shapes/dtypes must agree on every process)"
                    )
            extra = set(theirs) - set(mine)
            if extra:
                return f"process {i} has leaves process {self.index} lacks: {sorted(extra)[:5]}"
        return None

    async def decide(self, outcome: str) -> None:
        if self.active:
            await run_blocking(_client().key_value_set, f"{self.key}/outcome", outcome)

    async def outcome(self) -> str:
        try:
            return str(
                await run_blocking(
                    _client().blocking_key_value_get, f"{self.key}/outcome", self.timeout_ms
                )
            )
        except Exception as e:
            return f"abort: primary process {self.primary} did not decide within the timeout ({e})"
