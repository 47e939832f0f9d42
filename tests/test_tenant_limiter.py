"""The ingress's per-tenant limiter (router/tenant_limiter.py) with a fake clock: requests in
flight, and the token bucket's reservations, refunds, refill and waits, worked out by hand
from its definition (one minute's tokens, refilled continuously). One ingress alone (its
ledger in its own process), then two sharing one ledger (router/tenant_ledger.py), in this
process; tests/test_e2e_tenant_limits.py holds them across two ingress replicas on Ray."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from loraplex.registry.models import TenantLimits
from loraplex.router.limits import IngressLimits
from loraplex.router.tenant_ledger import LedgerService, Message, ShareLedger
from loraplex.router.tenant_limiter import OverLimit, RateLimited, TenantLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def limiter() -> tuple[TenantLimiter, Clock]:
    clock = Clock()
    return TenantLimiter(clock=clock), clock


def run(test: Callable[[], Awaitable[None]]) -> Callable[[], None]:
    """An async test, run on its own event loop."""

    def sync() -> None:
        asyncio.run(test())

    sync.__name__, sync.__doc__ = test.__name__, test.__doc__
    return sync


@run
async def test_requests_in_flight_per_tenant():
    lim, _ = limiter()
    two = TenantLimits(max_requests_in_flight=2)
    first, second = await lim.admit("a", two), await lim.admit("a", two)
    with pytest.raises(RateLimited) as refused:
        await lim.admit("a", two)
    assert refused.value.retry_after_s == 1
    assert "at its limit of 2 requests in flight" in refused.value.message
    await lim.admit("b", two)  # another tenant's count is its own
    first.release()
    first.release()  # idempotent: counted once
    assert lim.in_flight("a") == 1
    await lim.admit("a", two)
    second.release()
    assert lim.in_flight("a") == 1
    unlimited = TenantLimits()
    for _ in range(1000):
        await lim.admit("c", unlimited)


@run
async def test_tokens_per_minute_reserve_refund_and_refill():
    lim, clock = limiter()
    limits = TenantLimits(tokens_per_minute=600)  # 10 tokens a second
    first = await lim.admit("a", limits)
    await first.reserve(500)  # prompt + max_tokens
    second = await lim.admit("a", limits)  # 100 left: not empty, so it is let in...
    with pytest.raises(RateLimited) as refused:
        await second.reserve(300)  # ...but cannot reserve 300: waits for 200 more, 20 s
    assert refused.value.retry_after_s == 20
    assert "no room for this request's 300 tokens" in refused.value.message
    second.release()
    first.release(used_tokens=120)  # it used 120 of its 500: 380 come back, 480 left
    clock.now += 2  # + 20
    third = await lim.admit("a", limits)
    await third.reserve(500)  # exactly what the bucket holds
    with pytest.raises(RateLimited) as empty:
        await lim.admit("a", limits)  # nothing left: refused before reading anything
    assert empty.value.retry_after_s == 1  # 0.1 s for one token, rounded up to 1
    third.release(used_tokens=700)  # it used more than it reserved (the cap): 200 owed
    clock.now += 10  # + 100: still 100 short of empty
    with pytest.raises(RateLimited) as owed:
        await lim.admit("a", limits)
    assert owed.value.retry_after_s == 11  # (1 - (-100)) / 10 = 10.1 -> 11
    clock.now += 3600
    await (await lim.admit("a", limits)).reserve(600)  # refilled to one minute's worth, never more


@run
async def test_a_request_larger_than_a_minute_is_refused_and_takes_nothing():
    """It used to reserve the whole bucket and run past the limit (301 tokens at 200 a
    minute); no retry can make it fit, so it is refused (400 at the ingress)."""
    lim, _ = limiter()
    limits = TenantLimits(tokens_per_minute=100)
    ticket = await lim.admit("a", limits)
    with pytest.raises(OverLimit, match="more than tenant 'a''s limit of 100 tokens"):
        await ticket.reserve(10_000)
    assert ticket.reserved == 0
    await ticket.reserve(100)  # the bucket is whole


@run
async def test_a_changed_limit_applies_at_once():
    lim, clock = limiter()
    await (await lim.admit("a", TenantLimits(tokens_per_minute=1000))).reserve(800)  # 200 left
    smaller = TenantLimits(tokens_per_minute=50)
    await (await lim.admit("a", smaller)).reserve(50)  # the bucket is cut to 50, all of it taken
    with pytest.raises(RateLimited) as refused:
        await lim.admit("a", smaller)
    assert refused.value.retry_after_s == 2  # one token at 50 a minute: 1.2 s
    clock.now += 1
    await (await lim.admit("a", TenantLimits(tokens_per_minute=6000))).reserve(
        100
    )  # refills at 100/s


def test_defaults_fill_what_the_record_leaves_unset():
    defaults = IngressLimits(tenant_max_requests_in_flight=8, tenant_tokens_per_minute=None)
    assert defaults.for_tenant(TenantLimits()) == TenantLimits(max_requests_in_flight=8)
    own = TenantLimits(max_requests_in_flight=2, tokens_per_minute=99)
    assert defaults.for_tenant(own) == own
    assert defaults.for_tenant(None) == TenantLimits()  # no tenant (no registry): no limit


# ---------------------------------------------------------------- two ingresses, one ledger

SYNC_S = 0.05  # report period of the two limiters below (real time: the waits are real)


def two_ingresses(clock: Clock) -> tuple[TenantLimiter, TenantLimiter, LedgerService]:
    ledger = LedgerService.for_sync(SYNC_S, clock)
    return (
        TenantLimiter(ledger, sync_s=SYNC_S, clock=clock),
        TenantLimiter(ledger, sync_s=SYNC_S, clock=clock),
        ledger,
    )


def reporting(*limiters: TenantLimiter) -> list[asyncio.Task]:
    return [asyncio.create_task(lim.run()) for lim in limiters]


def held(ledger: LedgerService, tenant: str, kind: str) -> float:
    pool = ledger.ledger.pools.get((tenant, kind))
    return 0.0 if pool is None else sum(pool.held.values())


@run
async def test_requests_in_flight_are_counted_across_ingresses():
    """Four in flight for the tenant, wherever they arrive: each ingress alone used to let
    four in. A request that fits cluster-wide is let in at either ingress, even when the
    other holds the room (it gives it back when asked)."""
    a, b, ledger = two_ingresses(Clock())
    tasks = reporting(a, b)
    four = TenantLimits(max_requests_in_flight=4)
    at_a = [await a.admit("t", four) for _ in range(3)]
    at_b = await b.admit("t", four)  # a holds all four: it gives back its spare one
    for lim in (a, b):
        with pytest.raises(RateLimited, match="at its limit of 4 requests in flight"):
            await lim.admit("t", four)
    assert held(ledger, "t", "requests") <= 4
    at_a[0].release()
    again = await b.admit("t", four)  # the room a freed, taken at b
    with pytest.raises(RateLimited):
        await a.admit("t", four)
    for ticket in [*at_a, at_b, again]:
        ticket.release()
    assert [await a.admit("t", four) for _ in range(4)]  # all four back at one ingress
    for task in tasks:
        task.cancel()


@run
async def test_tokens_per_minute_are_one_bucket_across_ingresses():
    """600 tokens a minute, taken 100 at a time alternately at two ingresses: six requests,
    then both refuse (each alone let six in); a refund at one ingress serves the other."""
    clock = Clock()
    a, b, ledger = two_ingresses(clock)
    tasks = reporting(a, b)
    limits = TenantLimits(tokens_per_minute=600)
    tickets = []
    for i in range(6):
        ticket = await (a if i % 2 else b).admit("t", limits)
        await ticket.reserve(100)
        tickets.append(ticket)
    assert a._held["t"].tokens + b._held["t"].tokens == 0  # all 600 reserved
    for lim in (a, b):
        with pytest.raises(RateLimited, match="no room for more tokens"):
            await lim.admit("t", limits)  # the bucket is empty: refused before the body
    tickets[0].release(used_tokens=0)  # at b: its 100 tokens come back to the ledger
    await asyncio.sleep(3 * SYNC_S)  # b's next report carries them
    await (await a.admit("t", limits)).reserve(100)
    for task in tasks:
        task.cancel()


@run
async def test_a_silent_ingress_loses_its_share_when_its_lease_lapses():
    clock = Clock()
    a, b, ledger = two_ingresses(clock)
    four = TenantLimits(max_requests_in_flight=4)
    stuck = [await a.admit("t", four) for _ in range(4)]  # a dies with these in flight
    (b_reports,) = reporting(b)
    with pytest.raises(RateLimited):
        await b.admit("t", four)
    clock.now += ledger.ledger.lease_s + 1  # a sent nothing for a lease
    assert [await b.admit("t", four) for _ in range(4)]
    assert stuck and "t" in a._held  # a never gave them back
    b_reports.cancel()


def test_a_restarted_ledger_learns_the_holdings_from_the_snapshots():
    """A new ledger takes a client's snapshot as its holdings, and skips the deltas of
    messages the snapshot already includes (sent earlier, arriving later)."""
    ledger = ShareLedger(lease_s=10, clock=Clock())
    key = ("t", "requests")
    ledger.report(Message("a", seq=5, deltas={key: (-1.0, 1.0)}, snapshot={key: (3.0, 4)}))
    assert ledger.pools[key].held == {"a": 3.0} and ledger.pools[key].free == 1
    ledger.report(Message("a", seq=4, deltas={key: (-2.0, 2.0)}, snapshot={}))  # in seq 5's
    assert ledger.pools[key].held == {"a": 3.0}
    assert ledger.grant("b", key, 4, 2).amount == 0  # only one is free
    ledger.report(Message("a", seq=6, deltas={key: (-2.0, 2.0)}, snapshot={key: (1.0, 4)}))
    assert ledger.pools[key].free == 3 and ledger.grant("b", key, 4, 3).amount == 3


def test_a_replacement_ledger_grants_nothing_until_every_client_could_report():
    """A ledger whose first message from a client is not that client's first replaced one
    that died: b's share is unknown to it until b reports, so a's ask for the one place a's
    snapshot leaves free waits for that (the limit is four; b holds one). A first ledger
    (messages numbered from one) and a client back after its lease lapsed do not wait."""
    clock = Clock()
    key = ("t", "requests")
    ledger = ShareLedger(lease_s=10, clock=clock, recover_s=3)
    ledger.report(Message("a", seq=9, deltas={}, snapshot={key: (3.0, 4)}))
    refused = ledger.grant("a", key, 4, 1)
    assert (refused.amount, refused.answered, refused.wait_s) == (0, False, 3)
    clock.now += 1
    ledger.report(Message("b", seq=7, deltas={}, snapshot={key: (1.0, 4)}))
    assert ledger.recovering_s() == 2  # from the first sign of a restart, not each one
    clock.now += 2
    full = ledger.grant("a", key, 4, 1)
    assert (full.amount, full.answered) == (0, True)

    first = ShareLedger(lease_s=10, clock=clock, recover_s=3)
    first.report(Message("a", seq=1, deltas={}, snapshot={}))
    assert first.grant("a", key, 4, 1).amount == 2
    clock.now += 11  # past the first lease: a client back after its own lapsed
    first.report(Message("c", seq=40, deltas={}, snapshot={}))
    assert first.recovering_s() == 0


@run
async def test_a_borrow_from_a_replacement_ledger_waits_for_the_other_shares():
    """Through the service: the borrow made in the restart's window comes back refused
    for the room b holds, not granted from a ledger that had not heard of b."""
    service = LedgerService(ShareLedger(lease_s=10, recover_s=0.2), reclaim_s=0.1)
    key = ("t", "requests")
    a = Message("a", seq=9, deltas={}, snapshot={key: (3.0, 4)})
    borrowing = asyncio.create_task(service.borrow(a, key, 4, 1))
    await asyncio.sleep(0.05)
    await service.poll(Message("b", seq=7, deltas={}, snapshot={key: (1.0, 4)}), 0)
    grant = await borrowing
    assert (grant.amount, grant.answered) == (0, True)


class ReplyingInReverse:
    """The cluster's ledger as Ray can deliver it: each ask is answered by a real
    LedgerService, but the replies are held until `burst` asks are out (or 0.2 s passed)
    and come back last first (an actor's replies are not ordered across calls)."""

    def __init__(self, burst: int) -> None:
        self.service = LedgerService.for_sync(SYNC_S, Clock())
        self.burst = burst
        self.asks = 0
        self._held: list[asyncio.Future[None]] = []

    async def borrow(self, message: Message, key, capacity: int, need: int):
        grant = await self.service.borrow(message, key, capacity, need)
        self.asks += 1
        turn = asyncio.get_running_loop().create_future()
        self._held.append(turn)
        if len(self._held) == 1:
            asyncio.get_running_loop().call_later(0.2, self._reply)
        if len(self._held) >= self.burst:
            self._reply()
        await turn
        return grant

    def _reply(self) -> None:
        for turn in reversed(self._held):
            turn.set_result(None)
        self._held.clear()

    async def poll(self, message: Message, wait_s: float):
        return await self.service.poll(message, wait_s)


@run
async def test_a_burst_of_first_requests_is_let_in_whatever_order_the_ledger_replies():
    """16 requests at a cluster's start, limit 256: each used to ask the ledger at once; the
    first two asks took 128 each and the other 14 got nothing, and when those replies came
    back first (as over Ray) 14 requests were refused with 429 "256 requests in flight"
    with none in flight (a fresh-clone CI run). One ask is made now, and every request is
    let in."""
    ledger = ReplyingInReverse(burst=16)
    lim = TenantLimiter(ledger, sync_s=SYNC_S)
    limits = TenantLimits(max_requests_in_flight=256)
    tickets = await asyncio.gather(*(lim.admit("demo", limits) for _ in range(16)))
    assert lim.in_flight("demo") == 16
    assert ledger.asks == 1  # not one per request
    for ticket in tickets:
        ticket.release()


class Unreachable:
    async def borrow(self, message: Message, key, capacity: int, need: int):
        raise ConnectionError("the ledger's actor is restarting")

    async def poll(self, message: Message, wait_s: float):
        raise ConnectionError("the ledger's actor is restarting")


@run
async def test_an_unreachable_ledger_is_a_503_not_the_tenants_429():
    """Not the tenant's doing: it used to read "tenant 'a' has 4 requests in flight" with
    none in flight."""
    lim = TenantLimiter(Unreachable(), sync_s=SYNC_S)
    with pytest.raises(RateLimited) as refused:
        await lim.admit("a", TenantLimits(max_requests_in_flight=4))
    assert refused.value.status == 503
    assert "ledger did not answer" in refused.value.message
    assert lim.in_flight("a") == 0
