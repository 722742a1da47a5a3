"""``ByteBudget``: first come first served, one wake-up per admitted waiter, cancellation safe."""

from __future__ import annotations

import asyncio

import pytest

from quire.backends import ByteBudget


def test_waiters_are_admitted_in_order_and_within_the_limit() -> None:
    async def main() -> list[int]:
        b = ByteBudget(10)
        order: list[int] = []
        await b.acquire(10)

        async def one(i: int, n: int) -> None:
            async with b.hold(n):
                order.append(i)
                assert b.used <= 10 or b.used == n  # an oversized one only alone
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(one(i, n)) for i, n in enumerate([8, 3, 12, 2, 5])]
        await asyncio.sleep(0)
        assert order == [] and b.used == 10
        await b.release(10)
        await asyncio.gather(*tasks)
        assert b.used == 0 and b.peak == 12
        return order

    # First come first served: a request that does not fit holds back those behind it.
    assert asyncio.run(main()) == [0, 1, 2, 3, 4]


def test_a_cancelled_waiter_neither_leaks_nor_blocks() -> None:
    async def main() -> None:
        b = ByteBudget(10)
        await b.acquire(6)
        big = asyncio.create_task(b.acquire(9))  # waits: 6 + 9 > 10
        small = asyncio.create_task(b.acquire(3))  # queued behind big
        await asyncio.sleep(0)
        assert not big.done() and not small.done()
        big.cancel()
        with pytest.raises(asyncio.CancelledError):
            await big
        await asyncio.wait_for(small, 1)  # big left the queue: small fits beside the 6
        assert b.used == 9
        await b.release(6)
        await b.release(3)
        assert b.used == 0

        # Granted, then cancelled before it ran: the bytes are given back.
        await b.acquire(10)
        late = asyncio.create_task(b.acquire(5))
        await asyncio.sleep(0)
        await b.release(10)  # grants late's 5 bytes
        late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await late
        assert b.used == 0

    asyncio.run(main())


def test_thousands_of_waiters_all_get_through() -> None:
    async def main() -> int:
        b = ByteBudget(1)
        await b.acquire(1)
        done = 0

        async def one() -> None:
            nonlocal done
            async with b.hold(1):
                done += 1

        tasks = [asyncio.create_task(one()) for _ in range(5000)]
        await asyncio.sleep(0)
        await b.release(1)
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
        return done

    assert asyncio.run(main()) == 5000
