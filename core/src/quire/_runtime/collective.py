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

``ring_shift(key, payload, shift, timeout)`` moves one payload per process along the process
ring: process ``i`` sends to ``(i + shift) % n`` and receives from ``(i - shift) % n`` (peer
copies of a local tier).  The same barrier first (every process publishes its length and
waits for all the others'), then a jitted ``ppermute`` of a ``(n, W)`` uint8 array with one
row per process, ``W`` a power of two at most ``round_bytes``; a payload longer than ``W``
goes in ``ceil(longest / W)`` rounds, so each process holds one row to send and one received
row on its device at a time, besides the bytes it returns.

``kv_exchange(key, group, payload, timeout, url, what)`` gives every process of ``group``
every other one's small payload through the key-value store alone: no collective, so
nothing to compile (a JAX all-gather compiles once per process start, 15-80 ms on a loaded
CPU host).  For agreements and barriers of a few kilobytes, not for bulk bytes.

``kv_broadcast(key, payload, source, timeout, url, what)`` gives every process ``source``'s
small payload once every process has arrived (a barrier, then a broadcast), through the
key-value store alone, in a few requests per process (not one per pair: a save decision
asks it at every training step).  It leaves no keys behind round after round: ``drop``
names the previous round's, which ``source`` deletes once every process has arrived at the
next one (each has read it then).
"""

from __future__ import annotations

import base64
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from quire._runtime.multihost import _client, _first_line
from quire.errors import MultiProcessError

__all__ = ["RING_ROUND_BYTES", "exchange", "kv_broadcast", "kv_exchange", "ring_shift"]

_MIN_ROW = 1 << 16

#: Default bytes per process and round of :func:`ring_shift` (a power of two).
RING_ROUND_BYTES = 16 << 20


def _row_bytes(n: int) -> int:
    return max(_MIN_ROW, 1 << max(0, n - 1).bit_length())


def _devices(group: Sequence[int]) -> list[Any]:
    first: dict[int, Any] = {}
    for d in jax.devices():
        p = int(d.process_index)
        if p in group and (p not in first or d.id < first[p].id):
            first[p] = d
    return [first[p] for p in group]


#: What a malformed value in the key-value store suggests.
_FOREIGN = "does another program write to the run's coordination service?"


def _lengths(
    c: Any,
    key: str,
    group: Sequence[int],
    mine: int,
    timeout: float,
    missing: Callable[[int], str],
    terms: str = "",
) -> dict[int, int]:
    """The barrier: publish this process's length under ``key``, read every other one's.

    Raises :class:`MultiProcessError` with ``missing(p)`` (plus JAX's reason) for the first
    process ``p`` whose length does not arrive within ``timeout`` seconds in all, or when a
    process published other ``terms`` (the call's parameters every process must share) or
    something that is not a length.
    """
    me = jax.process_index()
    c.key_value_set(f"{key}/{me}", f"{mine} {terms}".rstrip())
    deadline = time.monotonic() + timeout
    lengths: dict[int, int] = {me: mine}
    for p in group:
        if p == me:
            continue
        ms = min(2**31 - 1, max(1, int((deadline - time.monotonic()) * 1000)))
        try:
            got = str(c.blocking_key_value_get(f"{key}/{p}", ms))
        except Exception as e:
            raise MultiProcessError(f"{missing(p)}: {_first_line(e)}") from e
        length, _, theirs = got.partition(" ")
        if theirs != terms:
            raise MultiProcessError(
                f"{key!r}: process {p} called with {theirs or 'nothing'}, process {me} with "
                f"{terms or 'nothing'}; every process must pass the same"
            )
        if not (length.isascii() and length.isdigit()) or len(length) > 20:
            raise MultiProcessError(
                f"{key!r}: process {p} published the malformed length {length[:40]!r}; quire "
                f"publishes a byte count: {_FOREIGN}"
            )
        lengths[p] = int(length)
    return lengths


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
    lengths = _lengths(
        c,
        key,
        group,
        len(payload),
        timeout,
        lambda p: (
            f"{url}: process {me} waited {timeout:g}s for process {p} to join the "
            "exchange of shared chunks (load); it did not (is it stalled or dead, or "
            "loading another tree?)"
        ),
    )
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
    except Exception:  # broad: coordination memory only  # pragma: no cover
        pass
    flat = memoryview(table.tobytes() if not table.flags.c_contiguous else table.data).cast("B")
    return [flat[i * width : i * width + lengths[p]] for i, p in enumerate(group)]


def kv_exchange(
    key: str, group: Sequence[int], payload: bytes, timeout: float, url: str, what: str
) -> list[bytes]:
    """Every group member's (small) payload, in ``group`` order, through the key-value
    store only (blocking; call it off the loop).  Also a barrier: it returns once every
    member has published.

    Each process publishes ``payload`` under ``key/<its index>`` (base64) and waits, at
    most ``timeout`` seconds in all, for the others'.  The keys stay in the store (a
    process cannot know when the others have read its own): keep payloads small, and
    ``key`` unique to the call and the same in every process.

    Raises
    ------
    MultiProcessError
        A member published nothing within ``timeout``, or something that is not base64
        (the message names it, ``url`` and ``what`` the processes were doing).
    """
    me = jax.process_index()
    c = _client()
    c.key_value_set(f"{key}/{me}", base64.b64encode(payload).decode("ascii"))
    deadline = time.monotonic() + timeout
    out: list[bytes] = []
    for p in group:
        if p == me:
            out.append(bytes(payload))
            continue
        ms = min(2**31 - 1, max(1, int((deadline - time.monotonic()) * 1000)))
        try:
            got = c.blocking_key_value_get(f"{key}/{p}", ms)
        except Exception as e:
            raise MultiProcessError(
                f"{url}: {what}: process {me} waited {timeout:g}s for process {p}; it did "
                f"not take part (is it stalled or dead?): {_first_line(e)}"
            ) from e
        try:
            out.append(base64.b64decode(str(got), validate=True))
        except ValueError as e:  # binascii.Error
            raise MultiProcessError(
                f"{url}: {what}: process {p} published a malformed payload under {key!r} "
                f"({e}); quire publishes base64: {_FOREIGN}"
            ) from None
    return out


_ABORT = "abort:"


def kv_broadcast(
    key: str,
    payload: bytes,
    source: int,
    timeout: float,
    url: str,
    what: str,
    *,
    drop: str | None = None,
) -> bytes:
    """Process ``source``'s (small) payload, on every process, once every process has
    arrived (blocking; call it off the loop).  Every JAX process calls it with the same
    ``key``, ``source`` and ``drop``.

    Each other process publishes that it arrived (``key/<index>``) and waits, at most twice
    ``timeout`` seconds (``source`` may wait ``timeout`` for a third one first), for
    ``key/out``.  ``source`` waits at most ``timeout`` for every arrival, then publishes its
    payload there (or, when a process did not arrive, why it gave up: every waiting process
    raises that too), and deletes ``drop``.

    Parameters
    ----------
    key : str
        A key-value-store prefix unique to this round, the same in every process.
    payload : bytes
        What ``source`` sends (the others' is ignored).
    source : int
        The process whose payload every process gets.
    timeout : float
        Seconds ``source`` waits for every other process to arrive.
    url, what : str
        The checkpoint and what the processes are doing, for messages.
    drop : str, optional
        The previous round's ``key``: every process has read it once all arrived here.

    Raises
    ------
    MultiProcessError
        A process did not arrive within ``timeout`` (the message names every such process,
        on every process that waited), or ``source`` did not answer within twice it.
    """
    me = jax.process_index()
    n = jax.process_count()
    c = _client()
    fix = (
        "is it stalled or dead, or not calling this at the same point as the others? "
        "quire.configure(timeout=...) sets the deadline"
    )
    if me != source:
        c.key_value_set(f"{key}/{me}", "")
        ms = min(2**31 - 1, max(1, int(2 * timeout * 1000)))
        try:
            got = str(c.blocking_key_value_get(f"{key}/out", ms))
        except Exception as e:
            raise MultiProcessError(
                f"{url}: {what}: process {me} waited {2 * timeout:g}s for process {source}'s "
                f"answer; process {source} did not answer ({fix}): {_first_line(e)}"
            ) from e
        if got.startswith(_ABORT):
            raise MultiProcessError(got.removeprefix(_ABORT).strip())
        try:
            return base64.b64decode(got, validate=True)
        except ValueError as e:  # binascii.Error
            raise MultiProcessError(
                f"{url}: {what}: process {source} published a malformed answer under {key!r} "
                f"({e}); quire publishes base64: {_FOREIGN}"
            ) from None
    deadline = time.monotonic() + timeout
    others = [p for p in range(n) if p != me]
    while True:
        arrived = {k.rsplit("/", 1)[-1] for k, _ in c.key_value_dir_get(f"{key}/")}
        missing = [p for p in others if str(p) not in arrived]
        if not missing:
            break
        ms = int((deadline - time.monotonic()) * 1000)
        try:
            if ms <= 0:
                raise TimeoutError("deadline passed")
            c.blocking_key_value_get(f"{key}/{missing[0]}", min(2**31 - 1, ms))
        except Exception as e:
            arrived = {k.rsplit("/", 1)[-1] for k, _ in c.key_value_dir_get(f"{key}/")}
            missing = [p for p in others if str(p) not in arrived]
            if not missing:  # the last one arrived right at the deadline
                break
            shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
            who = f"process {shown}" if len(missing) == 1 else f"processes {shown}"
            why = (
                f"{url}: {what}: {who} did not take part within {timeout:g}s of process {me} "
                f"({fix})"
            )
            c.key_value_set(f"{key}/out", f"{_ABORT} {why}")
            raise MultiProcessError(f"{why}: {_first_line(e)}") from e
    c.key_value_set(f"{key}/out", base64.b64encode(payload).decode("ascii"))
    if drop is not None:
        try:
            c.key_value_delete(drop)
        except Exception:  # broad: coordination memory only  # pragma: no cover
            pass
    return bytes(payload)


@functools.lru_cache(maxsize=32)
def _shifter(devices: tuple[Any, ...], shift: int) -> tuple[Mesh, Callable[[Any], Any]]:
    """The mesh of ``devices`` (one per process) and a jitted ppermute by ``shift`` on it
    (cached: one trace per process ring and shift, one compile per row width)."""
    n = len(devices)
    mesh = Mesh(np.array(devices), ("p",))
    perm = [(i, (i + shift) % n) for i in range(n)]

    def move(x: Any) -> Any:
        return jax.lax.ppermute(x, "p", perm)

    spec = PartitionSpec("p")
    return mesh, jax.jit(jax.shard_map(move, mesh=mesh, in_specs=spec, out_specs=spec))


def ring_shift(
    key: str,
    payload: bytes | memoryview,
    shift: int,
    timeout: float,
    *,
    round_bytes: int = RING_ROUND_BYTES,
) -> bytes:
    """Send ``payload`` to process ``(i + shift) % n``; return process ``(i - shift) % n``'s.

    Every JAX process calls it with the same ``key``, ``shift`` and ``round_bytes``
    (blocking; call it off quire's event loop).  With one process, or a shift that is a
    multiple of the process count, it returns this process's own payload.

    Parameters
    ----------
    key : str
        A key-value-store prefix unique to this call, the same in every process.
    payload : bytes-like
        What this process sends (any length, zero included).
    shift : int
        Ring distance to the receiver (negative shifts go the other way).
    timeout : float
        Seconds to wait at the barrier for every other process.
    round_bytes : int
        Bytes per process and round (rounded down to a power of two, at least 64 KiB):
        longer payloads go in several rounds, so the device memory held is two rows of
        this size.

    Returns
    -------
    bytes
        The payload of process ``(i - shift) % n``, whole.

    Raises
    ------
    MultiProcessError
        A process did not reach the barrier within ``timeout`` (the message names it).
        A process that dies during the collective itself is JAX's to detect: its
        coordination service terminates the others (``docs/peers.md``).
    """
    n = jax.process_count()
    me = jax.process_index()
    view = memoryview(payload).cast("B")
    if n == 1 or shift % n == 0:
        return bytes(view)
    group = list(range(n))
    lengths = _lengths(
        _client(),
        key,
        group,
        len(view),
        timeout,
        lambda p: (
            f"ring shift {key!r}: process {me} waited {timeout:g}s for process {p} to "
            "join the peer copy; it did not (is it stalled or dead, or running another step?)"
        ),
        f"shift={shift % n},round_bytes={round_bytes}",
    )
    longest = max(lengths.values())
    cap = 1 << max(_MIN_ROW.bit_length() - 1, int(round_bytes).bit_length() - 1)
    width = min(cap, _row_bytes(longest))
    rounds = max(1, -(-longest // width))
    devs = _devices(group)
    mesh, move = _shifter(tuple(devs), shift % n)
    sharding = NamedSharding(mesh, PartitionSpec("p"))
    source = (me - shift) % n
    want = lengths[source]
    parts: list[Any] = []
    for r in range(rounds):
        lo = r * width
        piece = view[lo : lo + width]
        if len(piece) == width:  # a full row: no padding, no copy here
            row = np.frombuffer(piece, np.uint8).reshape(1, width)
        else:
            row = np.zeros((1, width), np.uint8)
            row[0, : len(piece)] = np.frombuffer(piece, np.uint8)
        mine = jax.device_put(row, devs[me])
        arr = jax.make_array_from_single_device_arrays((n, width), sharding, [mine])
        got = np.asarray(move(arr).addressable_data(0))
        del arr, mine
        take = max(0, min(width, want - lo))
        if take:
            parts.append(got[0, :take])
    # every process has passed the barrier (it took part in the collective): drop our key
    try:
        _client().key_value_delete(f"{key}/{me}")
    except Exception:  # broad: coordination memory only  # pragma: no cover
        pass
    return b"".join(parts)
