"""The ingress's per-tenant limiter (router/tenant_limiter.py) with a fake clock: requests in
flight, and the token bucket's reservations, refunds, refill and waits, worked out by hand
from its definition (one minute's tokens, refilled continuously)."""

from __future__ import annotations

import pytest

from loraplex.registry.models import TenantLimits
from loraplex.router.limits import IngressLimits
from loraplex.router.tenant_limiter import OverLimit, RateLimited, TenantLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def limiter() -> tuple[TenantLimiter, Clock]:
    clock = Clock()
    return TenantLimiter(clock), clock


def test_requests_in_flight_per_tenant():
    lim, _ = limiter()
    two = TenantLimits(max_requests_in_flight=2)
    first, second = lim.admit("a", two), lim.admit("a", two)
    with pytest.raises(RateLimited) as refused:
        lim.admit("a", two)
    assert refused.value.retry_after_s == 1
    assert "has 2 requests in flight" in refused.value.message
    lim.admit("b", two)  # another tenant's count is its own
    first.release()
    first.release()  # idempotent: counted once
    assert lim.in_flight("a") == 1
    lim.admit("a", two)
    second.release()
    assert lim.in_flight("a") == 1
    unlimited = TenantLimits()
    for _ in range(1000):
        lim.admit("c", unlimited)


def test_tokens_per_minute_reserve_refund_and_refill():
    lim, clock = limiter()
    limits = TenantLimits(tokens_per_minute=600)  # 10 tokens a second
    first = lim.admit("a", limits)
    first.reserve(500)  # prompt + max_tokens
    second = lim.admit("a", limits)  # 100 left: not empty, so it is let in...
    with pytest.raises(RateLimited) as refused:
        second.reserve(300)  # ...but cannot reserve 300: waits for 200 more, 20 s
    assert refused.value.retry_after_s == 20
    assert "no room for this request's 300 tokens" in refused.value.message
    second.release()
    first.release(used_tokens=120)  # it used 120 of its 500: 380 come back, 480 left
    clock.now += 2  # + 20
    third = lim.admit("a", limits)
    third.reserve(500)  # exactly what the bucket holds
    with pytest.raises(RateLimited) as empty:
        lim.admit("a", limits)  # nothing left: refused before reading anything
    assert empty.value.retry_after_s == 1  # 0.1 s for one token, rounded up to 1
    third.release(used_tokens=700)  # it used more than it reserved (the cap): 200 owed
    clock.now += 10  # + 100: still 100 short of empty
    with pytest.raises(RateLimited) as owed:
        lim.admit("a", limits)
    assert owed.value.retry_after_s == 11  # (1 - (-100)) / 10 = 10.1 -> 11
    clock.now += 3600
    lim.admit("a", limits).reserve(600)  # refilled to one minute's worth, never more


def test_a_request_larger_than_a_minute_is_refused_and_takes_nothing():
    """It used to reserve the whole bucket and run past the limit (301 tokens at 200 a
    minute); no retry can make it fit, so it is refused (400 at the ingress)."""
    lim, _ = limiter()
    limits = TenantLimits(tokens_per_minute=100)
    ticket = lim.admit("a", limits)
    with pytest.raises(OverLimit, match="more than tenant 'a''s limit of 100 tokens"):
        ticket.reserve(10_000)
    assert ticket.reserved == 0
    ticket.reserve(100)  # the bucket is whole


def test_a_changed_limit_applies_at_once():
    lim, clock = limiter()
    lim.admit("a", TenantLimits(tokens_per_minute=1000)).reserve(800)  # 200 left
    smaller = TenantLimits(tokens_per_minute=50)
    lim.admit("a", smaller).reserve(50)  # the bucket is cut to 50, all of it taken
    with pytest.raises(RateLimited) as refused:
        lim.admit("a", smaller)
    assert refused.value.retry_after_s == 2  # one token at 50 a minute: 1.2 s
    clock.now += 1
    lim.admit("a", TenantLimits(tokens_per_minute=6000)).reserve(100)  # refills at 100/s


def test_defaults_fill_what_the_record_leaves_unset():
    defaults = IngressLimits(tenant_max_requests_in_flight=8, tenant_tokens_per_minute=None)
    assert defaults.for_tenant(TenantLimits()) == TenantLimits(max_requests_in_flight=8)
    own = TenantLimits(max_requests_in_flight=2, tokens_per_minute=99)
    assert defaults.for_tenant(own) == own
    assert defaults.for_tenant(None) == TenantLimits()  # no tenant (no registry): no limit
