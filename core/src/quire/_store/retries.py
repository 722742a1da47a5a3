"""Retries of an object store's requests: transient failures repeated with jittered
exponential backoff until a deadline (:class:`RetryPolicy`, :func:`retrying`,
:class:`RetriesExhausted`).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How long transient failures are retried.

    Attempt ``n`` (from 0) that fails transiently is followed by a pause drawn uniformly
    from ``[b/2, b]``, ``b = min(max_backoff, backoff * 2**n)`` ("equal jitter": clients
    that failed together do not retry together), unless that pause would end past
    ``deadline`` seconds after the first attempt.

    Parameters
    ----------
    deadline : float
        Seconds after the first attempt past which no retry starts.
    backoff : float
        The first pause's upper bound, in seconds (doubled per attempt).
    max_backoff : float
        The largest pause, in seconds.
    """

    deadline: float = 120.0
    backoff: float = 0.1
    max_backoff: float = 10.0

    @classmethod
    def pop_from(cls, options: dict[str, Any]) -> RetryPolicy:
        """The policy set by ``retry_*`` keys of ``options`` (removed from it).

        Parameters
        ----------
        options : dict
            Storage options; ``retry_deadline``, ``retry_backoff`` and ``retry_max_backoff`` are popped.
        """
        d = cls()
        return cls(
            deadline=float(options.pop("retry_deadline", d.deadline)),
            backoff=float(options.pop("retry_backoff", d.backoff)),
            max_backoff=float(options.pop("retry_max_backoff", d.max_backoff)),
        )

    def pause(self, attempt: int) -> float:
        """The jittered pause after failed attempt number ``attempt`` (from 0).

        Parameters
        ----------
        attempt : int
            The failed attempt's number, from 0.
        """
        b = min(self.max_backoff, self.backoff * 2.0 ** min(attempt, 60))
        return random.uniform(b / 2, b)


class RetriesExhausted(Exception):
    """Transient failures lasted past the deadline; ``last`` is the final one.

    Parameters
    ----------
    attempts : int
        How many attempts were made.
    elapsed : float
        Seconds since the first attempt.
    last : BaseException
        The final transient failure.
    """

    def __init__(self, attempts: int, elapsed: float, last: BaseException) -> None:
        super().__init__(f"{attempts} attempts in {elapsed:.1f}s")
        self.attempts = attempts
        self.elapsed = elapsed
        self.last = last


async def retrying(
    attempt: Callable[[int], Awaitable[T]],
    policy: RetryPolicy,
    is_transient: Callable[[BaseException], bool],
    on_retry: Callable[[int, float, BaseException], None] | None = None,
) -> T:
    """``await attempt(n)`` for n = 0, 1, ... until it returns or fails for good.

    Parameters
    ----------
    attempt : callable
        One try; ``n`` tells it that an earlier one may have reached the server before
        its reply was lost.
    policy : RetryPolicy
        Backoff and deadline.
    is_transient : callable
        Whether a failure may heal when repeated.
    on_retry : callable, optional
        ``on_retry(n, pause, error)`` before each pause (to log it).

    Returns
    -------
    What ``attempt`` returned.

    Raises
    ------
    RetriesExhausted
        Transient failures lasted past ``policy.deadline``.
    Exception
        A non-transient failure, as it was raised.
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    n = 0
    while True:
        try:
            return await attempt(n)
        except Exception as e:
            if not is_transient(e):
                raise
            pause = policy.pause(n)
            elapsed = loop.time() - start
            if elapsed + pause > policy.deadline:
                raise RetriesExhausted(n + 1, elapsed, e) from e
            if on_retry is not None:
                on_retry(n + 1, pause, e)
        await asyncio.sleep(pause)
        n += 1
