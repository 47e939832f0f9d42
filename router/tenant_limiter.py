"""Per-tenant admission at the ingress: requests in flight and tokens per minute. A pure
object with an injected clock; the ingress calls it on its event loop.

Tokens per minute is a token bucket holding one minute's tokens, refilled continuously:
a request is let in while the bucket is not empty, reserves its prompt tokens plus its
max_tokens once it is tokenized (refused if the bucket cannot cover that), and gets back
what it did not use when it ends. Over any window of t seconds a tenant thus uses at most
tokens_per_minute · (1 + t/60) tokens, and a tenant under its limit never waits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.registry.models import TenantLimits

_IN_FLIGHT_RETRY_S = 1  # a request in flight ends at an unknown time: ask again soon


class RateLimited(Exception):
    """A tenant over one of its limits: answered 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = max(1, math.ceil(retry_after_s))  # HTTP's delay-seconds


@dataclass(slots=True)
class _Bucket:
    capacity: int  # tokens per minute
    level: float
    updated: float

    def refill(self, now: float, capacity: int) -> None:
        if capacity != self.capacity:  # the tenant's limit changed
            self.level = min(self.level, capacity)
            self.capacity = capacity
        self.level = min(self.capacity, self.level + (now - self.updated) * self.capacity / 60)
        self.updated = now

    def wait_s(self, tokens: float) -> float:
        return (tokens - self.level) * 60 / self.capacity


class TenantLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._in_flight: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def admit(self, tenant: str, limits: TenantLimits) -> Ticket:
        """A ticket for one request of `tenant`; RateLimited when the tenant already has
        `max_requests_in_flight` requests, or its token bucket is empty. Release the ticket
        when the request ends, whatever way it ends."""
        cap = limits.max_requests_in_flight
        in_flight = self.in_flight(tenant)
        if cap is not None and in_flight >= cap:
            raise RateLimited(
                f"tenant {tenant!r} has {in_flight} requests in flight, its limit "
                f"(max_requests_in_flight); retry when one has finished",
                _IN_FLIGHT_RETRY_S,
            )
        bucket = self._bucket(tenant, limits.tokens_per_minute)
        if bucket is not None and bucket.level < 1:
            raise RateLimited(_tokens_message(tenant, bucket.capacity), bucket.wait_s(1))
        self._in_flight[tenant] = in_flight + 1
        return Ticket(self, tenant, limits.tokens_per_minute)

    def _bucket(self, tenant: str, tokens_per_minute: int | None) -> _Bucket | None:
        if tokens_per_minute is None:
            self._buckets.pop(tenant, None)
            return None
        now = self.clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(tokens_per_minute, tokens_per_minute, now)
        bucket.refill(now, tokens_per_minute)
        return bucket

    def _release(self, ticket: Ticket, used_tokens: int) -> None:
        left = self._in_flight[ticket.tenant] - 1
        if left:
            self._in_flight[ticket.tenant] = left
        else:
            del self._in_flight[ticket.tenant]
        bucket = self._bucket(ticket.tenant, ticket.tokens_per_minute)
        if bucket is None:
            return
        bucket.level = min(bucket.capacity, bucket.level + ticket.reserved - used_tokens)
        if not left and bucket.level >= bucket.capacity:  # as good as a new one: forget it
            del self._buckets[ticket.tenant]


class OverLimit(Exception):
    """A request that can never fit its tenant's tokens per minute (its prompt plus
    max_tokens are more than a minute's worth): 400, since no retry helps."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Ticket:
    """One admitted request's hold on its tenant's limits."""

    def __init__(self, limiter: TenantLimiter, tenant: str, tokens_per_minute: int | None):
        self.limiter = limiter
        self.tenant = tenant
        self.tokens_per_minute = tokens_per_minute
        self.reserved = 0
        self.released = False

    def reserve(self, tokens: int) -> None:
        """Take the request's most tokens (prompt + max_tokens) from the bucket; OverLimit
        if they are more than a minute's worth (a reservation capped at the bucket let one
        request run past the limit: 301 tokens at 200 per minute), RateLimited, with the
        wait until the bucket holds them, if it cannot now."""
        bucket = self.limiter._bucket(self.tenant, self.tokens_per_minute)
        if bucket is None:
            return
        need = tokens
        if need > bucket.capacity:
            raise OverLimit(
                f"this request's {need} tokens (prompt + max_tokens) are more than tenant "
                f"{self.tenant!r}'s limit of {bucket.capacity} tokens per minute; lower "
                "max_tokens"
            )
        if bucket.level < need:
            message = _tokens_message(self.tenant, bucket.capacity, need)
            raise RateLimited(message, bucket.wait_s(need))
        bucket.level -= need
        self.reserved += need

    def release(self, used_tokens: int = 0) -> None:
        """The request ended having used `used_tokens` (prompt + generated); idempotent."""
        if self.released:
            return
        self.released = True
        self.limiter._release(self, used_tokens)


def _tokens_message(tenant: str, per_minute: int, need: int | None = None) -> str:
    what = f"this request's {need} tokens (prompt + max_tokens)" if need else "more tokens"
    return (
        f"tenant {tenant!r} is at its limit of {per_minute} tokens per minute "
        f"(tokens_per_minute): no room for {what} yet"
    )
