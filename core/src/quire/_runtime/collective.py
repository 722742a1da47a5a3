"""Byte exchange between a group of JAX processes, never without a deadline.

``exchange(key, group, payload, timeout)`` gives every process of ``group`` the payload of
every other one.  First a barrier over the group through JAX's distributed key-value store:
each process publishes its payload's length under ``key`` and waits, at most ``timeout``
seconds, for the others' (``blocking_key_value_get``); a process that does not arrive makes
the others raise :class:`~quire.errors.MultiProcessError` naming it.  Only then the
collective: a jitted identity from a ``(len(group), L)`` uint8 array sharded over one device
per process of the group to the same array replicated — an all-gather among those
processes only (gloo on CPU, the device interconnect on accelerators).  ``L`` is the
longest payload rounded up to a power of two, so a few compiled shapes serve every round.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from quire._runtime.multihost import _client, _first_line
from quire.errors import MultiProcessError

__all__ = ["exchange"]

_MIN_ROW = 1 << 16


def _row_bytes(n: int) -> int:
    return max(_MIN_ROW, 1 << max(0, n - 1).bit_length())


def _devices(group: Sequence[int]) -> list[Any]:
    first: dict[int, Any] = {}
    for d in jax.devices():
        p = int(d.process_index)
        if p in group and (p not in first or d.id < first[p].id):
            first[p] = d
    return [first[p] for p in group]


def _identity(x: Any) -> Any:
    return x


def exchange(
    key: str, group: Sequence[int], payload: bytes | memoryview, timeout: float, url: str
) -> list[memoryview]:
    """Every group member's payload, in ``group`` order (blocking; call it off the loop).

    Parameters
    ----------
    key : str
        A key-value-store prefix unique to this exchange, the same in every process.
    group : sequence of int
        The processes taking part, sorted; this process among them.
    payload : bytes-like
        What this process contributes.
    timeout : float
        Seconds to wait for the others at the barrier.
    url : str
        The checkpoint, for messages.

    Raises
    ------
    MultiProcessError
        A process of the group did not reach the barrier within ``timeout``.
    """
    me = jax.process_index()
    c = _client()
    c.key_value_set(f"{key}/{me}", str(len(payload)))
    deadline = time.monotonic() + timeout
    lengths: dict[int, int] = {me: len(payload)}
    for p in group:
        if p == me:
            continue
        ms = min(2**31 - 1, max(1, int((deadline - time.monotonic()) * 1000)))
        try:
            lengths[p] = int(c.blocking_key_value_get(f"{key}/{p}", ms))
        except Exception as e:
            raise MultiProcessError(
                f"{url}: process {me} waited {timeout:g}s for process {p} to join the "
                f"exchange of shared chunks (load); it did not (is it stalled or dead, or "
                f"loading another tree?): {_first_line(e)}"
            ) from e
    width = _row_bytes(max(lengths.values()))
    devs = _devices(group)
    mesh = Mesh(np.array(devs), ("p",))
    row = np.zeros((1, width), np.uint8)
    row[0, : len(payload)] = np.frombuffer(payload, np.uint8)
    mine = jax.device_put(row, devs[list(group).index(me)])
    arr = jax.make_array_from_single_device_arrays(
        (len(group), width), NamedSharding(mesh, PartitionSpec("p")), [mine]
    )
    out = jax.jit(_identity, out_shardings=NamedSharding(mesh, PartitionSpec()))(arr)
    table = np.asarray(out.addressable_data(0))
    # every member has passed the barrier (it took part in the collective): drop our key
    try:
        c.key_value_delete(f"{key}/{me}")
    except Exception:  # pragma: no cover - cleanup only
        pass
    flat = memoryview(table.tobytes() if not table.flags.c_contiguous else table.data).cast("B")
    return [flat[i * width : i * width + lengths[p]] for i, p in enumerate(group)]
