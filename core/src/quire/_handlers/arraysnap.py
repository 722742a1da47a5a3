"""What ``save_async`` blocks on for array leaves: every owned shard made safe from the caller.

Found for the installed JAX (0.10, XLA:CPU) and kept true by ``core/tests/test_async_safety.py``:

* Holding the ``jax.Array`` (or its shards' ``.data``) protects nothing: a jitted step that
  donates it deletes every array over that buffer and writes its output in place, and
  ``delete()`` frees the buffer.
* ``numpy.asarray`` of a shard on a CPU device is a read-only view of the device buffer
  that holds an external reference to it: while the view lives, a donating step does not
  donate the array (its output goes to a new buffer, the input stays valid) and
  ``delete()`` keeps the memory.  Once the view is dropped, donation works again.  On
  other devices (and for dtypes the view cannot express, e.g. int4) ``numpy.asarray`` is a
  fresh host array: the transfer's own bytes.
* A numpy leaf is the caller's mutable memory: it is copied, into a staging buffer
  (:data:`quire._runtime.hostbuf.staging`) reused across saves.
* With ``pinned_staging`` (on GPU by default), each shard this process writes is first
  copied by ``jax.device_put`` into its device's ``pinned_host`` memory, every transfer
  started before any is waited for; the bytes are read from those copies, which are
  quire's own: the caller may donate or delete the originals as soon as the call returns.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from quire._handlers.arrayplan import ArrayPlan, _const, _plan
from quire._handlers.base import SaveEntry
from quire._runtime.config import current
from quire._runtime.hostbuf import staging
from quire._runtime.ioloop import pool

_Job = tuple[ArrayPlan, int, Callable[[], "np.ndarray | None"]]

log = logging.getLogger("quire")


def _pinned_memory(device: Any) -> bool:
    try:
        return any(m.kind == "pinned_host" for m in device.addressable_memories())
    except Exception:  # broad: no memory spaces here, so no pinned staging: shards read as is
        return False


def _stager(a: Any, pinned: bool | None) -> Callable[[Any], Any] | None:
    """``stage(shard)``: the shard copied into its device's ``pinned_host`` memory (one
    asynchronous ``device_put`` per shard, made once), or None to read shards as they are."""
    if not isinstance(a, jax.Array) or pinned is False:
        return None
    devices = a.sharding.device_set
    if pinned is None and not all(getattr(d, "platform", "") == "gpu" for d in devices):
        return None
    if not all(_pinned_memory(d) for d in devices):
        return None
    copies: dict[tuple[Any, ...], Any] = {}

    def stage(shard: Any) -> Any:
        key = (shard.device.id, *((s.start, s.stop, s.step) for s in shard.index))
        if key not in copies:
            to = jax.sharding.SingleDeviceSharding(shard.device, memory_kind="pinned_host")
            try:
                copies[key] = jax.device_put(shard.data, to)
            except Exception as e:  # a dtype or layout the platform cannot stage there
                log.debug("pinned staging of a %s shard failed (%s); read as it is", a.dtype, e)
                data = shard.data
                data.copy_to_host_async()
                copies[key] = data
        return copies[key]

    return stage


def snapshot_plans(arrays: Sequence[Any], entries: Sequence[SaveEntry]) -> list[ArrayPlan]:
    """The save plans of ``arrays`` (the entries' values as arrays), every owned shard a
    constant the caller can no longer change: a protected view, the transfer's host array,
    a fresh cast, or a staging copy."""
    pinned = current().pinned_staging
    stagers = [_stager(a, pinned) for a in arrays]
    for a, stage in zip(arrays, stagers):
        if isinstance(a, jax.Array) and stage is None:
            try:
                a.copy_to_host_async()  # every shard's transfer starts now, all at once
            except Exception:  # broad: only starts copies early; numpy.asarray still reads
                pass
    # With pinned staging the plans start one device_put per shard they write, all before
    # any is read (``run`` below).
    plans = [
        _plan(a, e.storage, e.path, e.writers, stage)
        for a, e, stage in zip(arrays, entries, stagers)
    ]
    limit = current().byte_budget
    jobs: list[_Job] = []
    for a, plan in zip(arrays, plans):
        for i, (coords, f) in enumerate(plan.owned):
            if isinstance(a, jax.Array) and not plan.allocates:
                plan.owned[i] = (coords, _const(f()))  # on CPU: a view, ~10 µs, no thread hop
            elif isinstance(a, jax.Array) or plan.allocates:
                jobs.append((plan, i, f))  # a transfer's host array, or a fresh cast
            else:  # the caller's own bytes: a staging buffer, taken in this thread
                src = f()
                dst = staging.take(src.shape, src.dtype, limit)
                jobs.append((plan, i, functools.partial(np.copyto, dst, src)))
                plan.owned[i] = (coords, _const(dst))

    def run(job: _Job) -> None:
        plan, i, f = job
        got = f()
        if got is not None:
            plan.owned[i] = (plan.owned[i][0], _const(got))

    # Transfers, casts and copies release the GIL: run them on every core.
    list(pool().map(run, jobs))
    for plan in plans:
        plan.allocates = False  # every chunk is now a constant
    return plans
