"""Per-tenant admission at the ingress: requests in flight and tokens per minute, held for
the whole cluster by one ledger (router/tenant_ledger.py). The ingress calls it on its event
loop.

Each ingress admits from the share of a tenant's limits it holds: a request is let in while
the tenant has fewer requests in flight here than its share of `max_requests_in_flight`, and
while its share of the tokens is not empty; once tokenized it takes its prompt plus its
max_tokens from that share (refused if the tenant's whole minute could not cover them) and,
when it ends, gives back what it did not use. Only when a share runs out does the ingress
ask the ledger (a hop; the ledger takes room back from other ingresses that do not use it).
Every `sync_s` it reports to the ledger and gives back half of each share it is not using.

Tokens per minute is a bucket holding one minute's tokens, refilled continuously: over any
window of t seconds a tenant uses at most tokens_per_minute · (1 + t/60) tokens across the
cluster, and its requests in flight across the cluster never pass max_requests_in_flight.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from loraplex.registry.models import TenantLimits
from loraplex.router.tenant_ledger import Grant, Key, Kind, LedgerService, Message

log = logging.getLogger(__name__)

_IN_FLIGHT_RETRY_S = 1  # a request in flight ends at an unknown time: ask again soon


class RateLimited(Exception):
    """A tenant over one of its limits: answered 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: float, status: int = 429) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = max(1, math.ceil(retry_after_s))  # HTTP's delay-seconds
        self.status = status  # 503: the cluster's ledger did not answer, not the tenant's doing


class OverLimit(Exception):
    """A request that can never fit its tenant's tokens per minute (its prompt plus
    max_tokens are more than a minute's worth): 400, since no retry helps."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Ledger(Protocol):
    """LedgerService's calls: in this process, or through router/ledger_actor.py."""

    async def borrow(self, message: Message, key: Key, capacity: int, need: int) -> Grant: ...

    async def poll(self, message: Message, wait_s: float) -> list[Key]: ...


@dataclass(slots=True)
class _Holding:
    """One tenant's at this ingress: its share of each limit and what it uses of them."""

    in_flight: int = 0
    requests: int = 0  # share of max_requests_in_flight (in flight included)
    requests_cap: int = 0
    tokens: int = 0  # share of the token bucket, not yet reserved
    tokens_cap: int = 0
    borrowing: int = 0  # asks of the ledger under way (their grants land here)

    def idle(self) -> bool:
        return not (self.in_flight or self.requests or self.tokens or self.borrowing)


class TenantLimiter:
    def __init__(
        self,
        ledger: Ledger | None = None,
        *,
        sync_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`ledger`: the cluster's (None: one in this process, for an ingress alone)."""
        self.sync_s = sync_s
        self.ledger = ledger or LedgerService.for_sync(sync_s, clock)
        self.client = uuid.uuid4().hex
        self._held: dict[str, _Holding] = {}
        self._deltas: dict[Key, tuple[float, float]] = {}
        self._seq = 0
        self._asking: dict[Key, asyncio.Future[Grant]] = {}

    def in_flight(self, tenant: str) -> int:
        held = self._held.get(tenant)
        return 0 if held is None else held.in_flight

    async def admit(self, tenant: str, limits: TenantLimits) -> Ticket:
        """A ticket for one request of `tenant`; RateLimited when the tenant already has
        `max_requests_in_flight` requests in the cluster, or its token bucket is empty.
        Release the ticket when the request ends, whatever way it ends."""
        held = self._held.setdefault(tenant, _Holding())
        self._follow_limits(tenant, held, limits)
        cap = limits.max_requests_in_flight
        while cap is not None and held.in_flight >= held.requests:
            grant = await self._borrow(tenant, held, "requests", cap, 1)
            if not grant.amount and held.in_flight >= held.requests:
                self._forget_if_idle(tenant)
                raise _refused(grant) or RateLimited(
                    f"tenant {tenant!r} is at its limit of {cap} requests in flight across "
                    "the cluster (max_requests_in_flight); retry when one has finished",
                    _IN_FLIGHT_RETRY_S,
                )
        per_minute = limits.tokens_per_minute
        while per_minute is not None and held.tokens < 1:
            grant = await self._borrow(tenant, held, "tokens", per_minute, 1)
            if not grant.amount and held.tokens < 1:
                self._forget_if_idle(tenant)
                raise _refused(grant) or RateLimited(
                    _tokens_message(tenant, per_minute), grant.wait_s
                )
        held.in_flight += 1
        return Ticket(self, tenant, per_minute)

    async def _reserve(self, ticket: Ticket, need: int) -> None:
        per_minute = ticket.tokens_per_minute
        assert per_minute is not None
        held = self._held[ticket.tenant]
        if need > per_minute:
            raise OverLimit(
                f"this request's {need} tokens (prompt + max_tokens) are more than tenant "
                f"{ticket.tenant!r}'s limit of {per_minute} tokens per minute; lower "
                "max_tokens"
            )
        while held.tokens < need:
            grant = await self._borrow(
                ticket.tenant, held, "tokens", per_minute, need - held.tokens
            )
            if not grant.amount and held.tokens < need:
                message = _tokens_message(ticket.tenant, per_minute, need)
                raise _refused(grant) or RateLimited(message, grant.wait_s)
        held.tokens -= need  # reserved: out of the pool, as used
        self._delta((ticket.tenant, "tokens"), -need, 0)
        ticket.reserved += need

    def _release(self, ticket: Ticket, used_tokens: int) -> None:
        held = self._held[ticket.tenant]
        held.in_flight -= 1
        if ticket.reserved:
            self._delta((ticket.tenant, "tokens"), 0, ticket.reserved - used_tokens)
        self._forget_if_idle(ticket.tenant)

    def _follow_limits(self, tenant: str, held: _Holding, limits: TenantLimits) -> None:
        """A changed limit applies at once: what is not in use of a share taken under the
        old one goes back, and the next ask carries the new capacity."""
        cap = limits.max_requests_in_flight or 0
        if cap != held.requests_cap:
            spare = held.requests - held.in_flight
            if spare > 0:
                held.requests -= spare
                self._delta((tenant, "requests"), -spare, spare)
            held.requests_cap = cap
        cap = limits.tokens_per_minute or 0
        if cap != held.tokens_cap:
            if held.tokens > 0:
                self._delta((tenant, "tokens"), -held.tokens, held.tokens)
                held.tokens = 0
            held.tokens_cap = cap

    async def _borrow(
        self, tenant: str, held: _Holding, kind: Kind, capacity: int, need: int
    ) -> Grant:
        """Ask the ledger for more of a share; what it grants lands in `held` before any
        caller resumes. One ask per pool at a time: a request that finds one under way waits
        for it and its caller checks again, so a burst of first requests makes one ask, not
        one each. (They used to ask at once; over Ray the replies can come back in any order,
        and a burst of 16 at a cluster's start was refused when a nothing-left reply landed
        before the ask that had taken the room.)"""
        key = (tenant, kind)
        asking = self._asking.get(key)
        if asking is None or asking.done():  # done: its grant is in `held` already
            held.borrowing += 1  # now, not when the task starts: `held` is kept meanwhile
            asking = self._asking[key] = asyncio.ensure_future(self._ask(held, key, capacity, need))
        try:
            return await asyncio.shield(asking)  # a caller that gives up leaves the grant here
        finally:
            if asking.done() and self._asking.get(key) is asking:
                del self._asking[key]

    async def _ask(self, held: _Holding, key: Key, capacity: int, need: int) -> Grant:
        try:
            grant = await self.ledger.borrow(self._message(), key, capacity, need)
        except Exception:  # the ledger is restarting: refuse what the shares do not cover
            log.warning("the tenant ledger did not answer a borrow", exc_info=True)
            return Grant(0, self.sync_s, answered=False)
        finally:
            held.borrowing -= 1
        if key[1] == "requests":
            held.requests += grant.amount
        else:
            held.tokens += grant.amount
        return grant

    async def run(self) -> None:
        """Report to the ledger every `sync_s` (the lease), giving back half of what each
        tenant does not use, or all of it when the ledger asks; until cancelled."""
        wanted: list[Key] = []
        while True:
            self._give_back(wanted)
            try:
                wanted = await self.ledger.poll(self._message(), self.sync_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("the tenant ledger did not answer; retrying", exc_info=True)
                wanted = []
                await asyncio.sleep(self.sync_s)

    def _give_back(self, wanted: list[Key]) -> None:
        everything = set(wanted)
        for tenant, held in list(self._held.items()):
            spare = held.requests - held.in_flight
            if spare > 0:
                back = spare if (tenant, "requests") in everything else math.ceil(spare / 2)
                held.requests -= back
                self._delta((tenant, "requests"), -back, back)
            if held.tokens > 0:
                back = held.tokens if (tenant, "tokens") in everything else held.tokens // 2
                back = back or held.tokens  # the last token too
                held.tokens -= back
                self._delta((tenant, "tokens"), -back, back)
            self._forget_if_idle(tenant)

    def _delta(self, key: Key, d_held: float, d_free: float) -> None:
        held, free = self._deltas.get(key, (0.0, 0.0))
        self._deltas[key] = (held + d_held, free + d_free)

    def _message(self) -> Message:
        """The deltas since the last message (taken) and the holdings after them."""
        self._seq += 1
        deltas, self._deltas = self._deltas, {}
        snapshot: dict[Key, tuple[float, int]] = {}
        for tenant, held in self._held.items():
            if held.requests:
                snapshot[(tenant, "requests")] = (held.requests, held.requests_cap)
            if held.tokens:
                snapshot[(tenant, "tokens")] = (held.tokens, held.tokens_cap)
        return Message(self.client, self._seq, deltas, snapshot)

    def _forget_if_idle(self, tenant: str) -> None:
        held = self._held.get(tenant)
        if held is not None and held.idle():
            del self._held[tenant]


class Ticket:
    """One admitted request's hold on its tenant's limits."""

    def __init__(self, limiter: TenantLimiter, tenant: str, tokens_per_minute: int | None):
        self.limiter = limiter
        self.tenant = tenant
        self.tokens_per_minute = tokens_per_minute
        self.reserved = 0
        self.released = False

    async def reserve(self, tokens: int) -> None:
        """Take the request's most tokens (prompt + max_tokens) from the bucket; OverLimit
        if they are more than a minute's worth (a reservation capped at the bucket let one
        request run past the limit: 301 tokens at 200 per minute), RateLimited, with the
        wait until the bucket holds them, if it cannot now."""
        if self.tokens_per_minute is not None:
            await self.limiter._reserve(self, tokens)

    def release(self, used_tokens: int = 0) -> None:
        """The request ended having used `used_tokens` (prompt + generated); idempotent."""
        if self.released:
            return
        self.released = True
        self.limiter._release(self, used_tokens)


def _refused(grant: Grant) -> RateLimited | None:
    """The refusal when the ledger did not answer: the limit could not be checked beyond
    this ingress's share, which is the server's fault, not the tenant's (503, not 429)."""
    if grant.answered:
        return None
    return RateLimited(
        "the cluster's tenant ledger did not answer, so this request could not be checked "
        "against its tenant's limits; retry shortly",
        grant.wait_s,
        status=503,
    )


def _tokens_message(tenant: str, per_minute: int, need: int | None = None) -> str:
    what = f"this request's {need} tokens (prompt + max_tokens)" if need else "more tokens"
    return (
        f"tenant {tenant!r} is at its limit of {per_minute} tokens per minute "
        f"(tokens_per_minute): no room for {what} yet"
    )
