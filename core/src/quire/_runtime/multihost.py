"""Coordination of a save across JAX processes, through JAX's distributed key-value store.

Every process calls the same quire operations in the same order (the SPMD contract), so
a per-process operation counter names each operation identically everywhere.  For one
operation with key ``K`` (``quire/<n>/<url hash>/<what>``):

1. the primary publishes the txid at ``K/txid``; the others wait for it (``agree_txid``);
2. every process writes the chunks it owns.  The primary then publishes a digest of each
   leaf record it computed at ``K/digests`` and one digest of them all at ``K/digest``;
   every other process reads the 16-character ``K/digest`` (and the map only when it
   differs, to name the key path), and publishes a small status at ``K/status/<i>``: its
   error, the disagreement, or nothing (``report``);
3. the primary polls ``K/status/`` until every process has reported, one has failed, or the
   timeout has passed since it finished its own writes; then it claims the outcome
   ``K/outcome`` with a create-if-absent: ``commit`` (and commits, then publishes
   ``K/result``) or ``abort: <why>`` (``collect`` / ``decide``);
4. the others wait for the outcome — twice the timeout, as the primary's own wait starts
   only once it has written its shards — and raise if the save was aborted.  A process
   that gives up waiting claims ``K/outcome`` as an abort itself; the create-if-absent
   makes the commit and the give-up mutually exclusive, so no process ever reports an
   abort for a save that the primary commits (``outcome``).

After a commit, the processes count themselves in ``K/acks`` once they have read the
result; the last one deletes ``K``, so that a long run does not fill the coordination
service's memory (an aborted operation leaves its few small keys behind).  After an
abort the primary removes the data written under the txid once every process has
reported (or the timeout has passed), so that it finds every process's objects.  With one
process all of this is a no-op.

What JAX itself does when a process dies: the coordination service (hosted by process 0)
notices a missing heartbeat after ``heartbeat_timeout_seconds`` (100 s by default) and then
terminates every other process; when process 0 dies, the others terminate at once.  In
either case no commit happens unless every process had reported success.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import secrets
import threading
import time
from typing import Any

from quire._runtime.ioloop import run_blocking
from quire.errors import MultiProcessError

__all__ = ["COMMIT", "Coordinator", "MultiProcessError", "digest"]

_seq_lock = threading.Lock()
_seq = itertools.count(1)

COMMIT = "commit"


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


def _combined(digests: dict[str, str]) -> str:
    return digest(sorted(digests.items()))


def _display(path: str) -> str:
    """A digest key as users know it: the key path of the saved tree."""
    return path.removeprefix("pytree:")


def _exists(e: Exception) -> bool:
    return "ALREADY_EXISTS" in str(e)


def _timed_out(e: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(e)


class Coordinator:
    """One collective operation (see the module docstring)."""

    def __init__(
        self,
        url: str,
        what: str,
        *,
        primary: int,
        timeout: float | None,
        name: str | None = None,
    ) -> None:
        """``name``: a coordination name shared by every process when their ``url`` s differ
        (a local tier: one root per process); the caller makes it unique per operation (no
        per-process operation counter is used then, so it may be created in any thread)."""
        import jax

        self.index = jax.process_index()
        self.count = jax.process_count()
        self.primary = primary
        self.timeout = timeout if timeout is not None else 365 * 86400.0
        self.active = self.count > 1
        self.url = url
        if name is not None:
            self.key = f"quire/n/{hashlib.sha256(name.encode()).hexdigest()[:16]}/{what}"
        else:
            with _seq_lock:
                n = next(_seq)
            self.key = f"quire/{n}/{hashlib.sha256(url.encode()).hexdigest()[:12]}/{what}"
        self._claimed = False
        self.decided = False  # the primary has announced the outcome
        self._deadline = 0.0
        if self.active and not 0 <= primary < self.count:
            raise MultiProcessError(f"primary process {primary} is not in 0..{self.count - 1}")

    @property
    def is_primary(self) -> bool:
        return self.index == self.primary

    def _ms(self, deadline: float) -> int:
        # (JAX takes a 32-bit millisecond count: cap "forever" at 24 days.)
        return min(2**31 - 1, max(1, int((deadline - time.monotonic()) * 1000)))

    # -------------------------------------------------------------------- 1. the txid
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
            return str(c.blocking_key_value_get(f"{self.key}/txid", self._ms_from_now()))
        except Exception as e:
            raise MultiProcessError(
                f"{self.url}: process {self.index} waited {self.timeout:g}s for primary process "
                f"{self.primary} to start the save; it did not (is every process saving the "
                f"same checkpoints in the same order?): {_first_line(e)}"
            ) from e

    def _ms_from_now(self) -> int:
        return self._ms(time.monotonic() + self.timeout)

    # -------------------------------------------------------------------- 2. statuses
    async def report(self, error: str | None, digests: dict[str, str] | None = None) -> None:
        """Publish this process's result: the primary its digests, the others a status."""
        if not self.active:
            return
        c = _client()
        if self.is_primary:
            self._deadline = time.monotonic() + self.timeout
            if error:
                await run_blocking(c.key_value_set, f"{self.key}/digest", "error")
                return
            # The full map first: a process that finds another combined digest reads it.
            body = json.dumps(digests or {})
            await run_blocking(c.key_value_set, f"{self.key}/digests", body)
            await run_blocking(c.key_value_set, f"{self.key}/digest", _combined(digests or {}))
            return
        # The others wait for the primary's writes and its collection of the statuses.
        self._deadline = time.monotonic() + 2 * self.timeout
        if error is None:
            error = await self._compare(digests or {})
        status = json.dumps({"error": error})
        await run_blocking(c.key_value_set, f"{self.key}/status/{self.index}", status)

    async def _compare(self, mine: dict[str, str]) -> str | None:
        """Why this process disagrees with the primary, or None."""
        c = _client()
        try:
            combined = await run_blocking(
                c.blocking_key_value_get, f"{self.key}/digest", self._ms(self._deadline)
            )
        except Exception as e:  # broad: reported as this process's failure: the save aborts
            return f"no digest from primary process {self.primary}: {_first_line(e)}"
        if combined == "error":
            return None  # the primary failed; it aborts the save
        if combined == _combined(mine):
            return None
        theirs: dict[str, str] = json.loads(
            await run_blocking(c.key_value_try_get, f"{self.key}/digests")
        )
        for path in sorted(set(mine) | set(theirs)):
            if path not in theirs:
                return (
                    f"process {self.index} has leaf {_display(path)!r}, which primary process "
                    f"{self.primary} lacks (every process must save the same tree)"
                )
            if path not in mine:
                return (
                    f"process {self.index} lacks leaf {_display(path)!r}, which primary process "
                    f"{self.primary} has (every process must save the same tree)"
                )
            if mine[path] != theirs[path]:
                if path.endswith("<structure>"):
                    return (
                        f"the tree structure differs between process {self.index} and primary "
                        f"process {self.primary} (containers or their keys differ)"
                    )
                return (
                    f"leaf {_display(path)!r} differs between process {self.index} and primary "
                    f"process {self.primary} (non-array leaves and array shapes, dtypes and "
                    "shardings must agree on every process)"
                )
        return None  # pragma: no cover - equal dicts have equal combined digests

    # -------------------------------------------------------------------- 3. the primary
    async def collect(self, mine: dict[str, str]) -> str | None:
        """Primary: wait for every status; return why the save must abort, or None.

        When every process succeeded, claims the outcome ``commit``: from then on no
        other process can abort the save.
        """
        c = _client()
        others = {i for i in range(self.count) if i != self.index}
        prefix = f"{self.key}/status/"
        delay = 0.005
        got: dict[int, dict[str, Any]] = {}
        while True:
            entries = await run_blocking(c.key_value_dir_get, prefix)
            for k, v in entries:
                got.setdefault(int(k.rsplit("/", 1)[-1]), json.loads(v))
            failed = sorted(i for i, st in got.items() if st.get("error"))
            if failed:
                i = failed[0]
                return f"process {i} failed: {got[i]['error']}"
            if others <= set(got):
                break
            if time.monotonic() >= self._deadline:
                silent = sorted(others - set(got))
                shown = ", ".join(map(str, silent[:10])) + (", ..." if len(silent) > 10 else "")
                return (
                    f"process(es) {shown} did not report within {self.timeout:g}s of primary "
                    f"process {self.index} finishing its writes (dead, stuck, or not saving "
                    "this checkpoint)"
                )
            await asyncio.sleep(min(delay, max(0.0, self._deadline - time.monotonic())))
            delay = min(delay * 1.5, 0.5)
        try:
            await run_blocking(c.key_value_set, f"{self.key}/outcome", COMMIT)
        except Exception as e:
            if not _exists(e):
                raise
            why = str(await run_blocking(c.key_value_try_get, f"{self.key}/outcome"))
            return why.removeprefix("abort: ")
        self._claimed = True
        return None

    async def decide(self, outcome: str) -> None:
        """Primary: publish ``ok:<json>`` or ``abort: <why>``."""
        if not self.active:
            return
        self.decided = True
        c = _client()
        if self._claimed:
            await run_blocking(c.key_value_set, f"{self.key}/result", outcome)
            return
        try:
            await run_blocking(c.key_value_set, f"{self.key}/outcome", outcome)
        except Exception as e:
            if not _exists(e):  # a process that gave up already aborted the save
                raise
        await self._settle()

    async def _settle(self) -> None:
        """Primary, after an abort: give the other processes until the deadline to stop
        writing, so that the clean-up that follows finds all their objects."""
        c = _client()
        others = {i for i in range(self.count) if i != self.index}
        while time.monotonic() < self._deadline:
            entries = await run_blocking(c.key_value_dir_get, f"{self.key}/status/")
            if len(entries) >= len(others):
                return
            await asyncio.sleep(0.1)

    # -------------------------------------------------------------------- 4. the others
    async def outcome(self) -> str:
        """The others: ``ok:<json>`` or ``abort: <why>``; raises when the outcome is unknown."""
        c = _client()
        key = f"{self.key}/outcome"
        try:
            out = str(await run_blocking(c.blocking_key_value_get, key, self._ms(self._deadline)))
        except Exception as e:
            if not _timed_out(e):
                raise MultiProcessError(
                    f"{self.url}: process {self.index} lost the coordination service while "
                    f"waiting for primary process {self.primary}: {_first_line(e)}"
                ) from e
            why = (
                f"abort: process {self.index} waited {2 * self.timeout:g}s for primary process "
                f"{self.primary} to decide, and gave up"
            )
            try:
                await run_blocking(c.key_value_set, key, why)
                return why
            except Exception as e2:
                if not _exists(e2):
                    raise
            out = str(await run_blocking(c.key_value_try_get, key))
        if out != COMMIT:
            return out
        try:
            res = str(
                await run_blocking(
                    c.blocking_key_value_get, f"{self.key}/result", self._ms_from_now()
                )
            )
        except Exception as e:
            raise MultiProcessError(
                f"{self.url}: primary process {self.primary} started the commit but did not "
                f"report its result within {self.timeout:g}s; the checkpoint is committed iff "
                f"its quire.json exists: {_first_line(e)}"
            ) from e
        await self._ack()
        return res

    async def _ack(self) -> None:
        """Count this process as done; the last one removes the operation's keys."""
        c = _client()
        try:
            n = await run_blocking(c.key_value_increment, f"{self.key}/acks", 1)
            if n >= self.count - 1:
                await run_blocking(c.key_value_delete, self.key)
        except Exception:  # broad: only memory in the coordination service is at stake
            pass


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
