"""One ledger of every tenant's limits for all the ingress replicas: each ingress admits
from a share it holds, and asks the ledger only when its share runs out.

A pool is one tenant's one limit: `requests` (requests in flight, a fixed count) or
`tokens` (tokens per minute, a bucket of one minute's tokens refilled continuously). The
ledger holds what no ingress holds (`free`) and what each ingress holds (`held`), and keeps

    free + sum(held) <= capacity

so a tenant's requests in flight across the cluster never pass its limit, and its tokens
obey the bound one ingress gave before: at most capacity · (1 + t/60) over any t seconds. A
share is granted in batches (a need, rounded up to a fraction of the capacity), given back
when an ingress no longer needs it, and taken back from a client whose lease lapsed (no
message for `lease_s`: a dead ingress's share comes back then).

What an ingress reports is a `Message`: the changes to its holdings and to the free part
since its last one (`deltas`: a request's tokens leave the pool when reserved; unused ones
come back to `free`, capped, as the single bucket refunded them), and its whole holdings
(`snapshot`), which a ledger that does not know it (restarted, or its lease lapsed) takes
instead. Messages are numbered: a snapshot includes the deltas of its own and earlier
messages, so a later-arriving earlier message is not counted twice. A new ledger that hears
from a client which had spoken to an earlier one (its first message here is not its first)
replaced a ledger that died: other clients may hold shares it has not heard of yet, so it
grants nothing until every live client has had time to report (`recover_s`); a borrow waits
that out.

`ShareLedger` is the pure bookkeeping with an injected clock; `LedgerService` adds the waits:
a client's `poll` returns at once when the ledger wants a share back, and a `borrow` that the
free part cannot cover asks every other client to give back what it does not use and waits
for them (at most `reclaim_s`), so a request that fits the limit cluster-wide is not refused
because another ingress holds the room.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["requests", "tokens"]
Key = tuple[str, Kind]  # (tenant, kind)
GRANT_FRACTION = 2  # a grant is at least capacity / (2 x clients): few asks, room for others
LEASES_PER_SYNC = 10  # a client silent for 10 report periods has lost its shares
RECOVER_SYNCS = 3  # a live client reports within two report periods of a ledger's start


@dataclass(frozen=True, slots=True)
class Message:
    """What a client reports with each call. deltas: per pool, (change to its holdings,
    change to the free part); snapshot: per pool, (its whole holdings, the capacity)."""

    client: str
    seq: int
    deltas: dict[Key, tuple[float, float]]
    snapshot: dict[Key, tuple[float, int]]


@dataclass(frozen=True, slots=True)
class Grant:
    amount: int
    wait_s: float  # when amount is 0: how long until the free part could cover the need
    answered: bool = True  # False: the ledger could not check (unreachable, or recovering)


@dataclass(slots=True)
class _Pool:
    capacity: int
    free: float
    updated: float
    held: dict[str, float] = field(default_factory=dict)

    def room(self) -> float:
        return self.capacity - sum(self.held.values())

    def refill(self, now: float, per_minute: bool) -> None:
        gained = (now - self.updated) * self.capacity / 60 if per_minute else 0.0
        self.free = min(self.room(), self.free + gained)
        self.updated = now


@dataclass(slots=True)
class _Client:
    seen: float
    registered_seq: int  # deltas of messages up to this one are in its snapshot


class ShareLedger:
    def __init__(
        self, lease_s: float, clock: Callable[[], float] = time.monotonic, recover_s: float = 0.0
    ) -> None:
        self.lease_s = lease_s
        self.recover_s = recover_s
        self.clock = clock
        self.started = clock()
        self.recovered_at = self.started  # no grant before this
        self.pools: dict[Key, _Pool] = {}
        self.clients: dict[str, _Client] = {}

    def recovering_s(self) -> float:
        """How long until this ledger has heard from every live client (0: it has)."""
        return max(0.0, self.recovered_at - self.clock())

    def report(self, message: Message) -> None:
        """Take a client's message: its deltas, or its snapshot when it is new here."""
        now = self.clock()
        self.expire(now)
        client = self.clients.get(message.client)
        if client is None:
            replaced = message.seq > 1 and now - self.started < self.lease_s
            if replaced and self.recovered_at <= self.started:  # the first sign of it
                self.recovered_at = now + self.recover_s
            self.clients[message.client] = _Client(now, message.seq)
            for key, (held, capacity) in message.snapshot.items():
                pool = self._pool(key, capacity, now)
                pool.held[message.client] = held
                pool.free = min(pool.free, pool.room())  # may be < 0: nothing is granted
            return
        client.seen = now
        if message.seq <= client.registered_seq:
            return
        for key, (d_held, d_free) in message.deltas.items():
            pool = self.pools.get(key)
            if pool is None:  # forgotten while the client held nothing of it
                pool = self._pool(key, int(message.snapshot.get(key, (0, 1))[1]), now)
            pool.refill(now, key[1] == "tokens")
            held = pool.held.get(message.client, 0.0) + d_held
            if held > 0:
                pool.held[message.client] = held
            else:
                pool.held.pop(message.client, None)
            pool.free = min(pool.room(), pool.free + d_free)
            self._forget_if_whole(key, pool)

    def grant(self, client: str, key: Key, capacity: int, need: int) -> Grant:
        """Up to a batch of the pool for `client`, at least `need`; nothing if the free part
        cannot cover `need` (Grant.wait_s: until the refill could)."""
        now = self.clock()
        if now < self.recovered_at:
            return Grant(0, self.recovered_at - now, answered=False)
        pool = self._pool(key, capacity, now)
        per_minute = key[1] == "tokens"
        pool.refill(now, per_minute)
        if pool.free < need:
            if not per_minute:
                return Grant(0, 1.0)
            return Grant(0, (need - pool.free) * 60 / pool.capacity)
        batch = math.ceil(pool.capacity / (GRANT_FRACTION * max(1, len(self.clients))))
        amount = int(min(pool.free, max(need, batch)))
        pool.free -= amount
        pool.held[client] = pool.held.get(client, 0.0) + amount
        return Grant(amount, 0.0)

    def holders(self, key: Key, but: str) -> list[str]:
        pool = self.pools.get(key)
        return [] if pool is None else [c for c in pool.held if c != but]

    def expire(self, now: float) -> list[str]:
        """Drop the clients whose lease lapsed, their holdings back to the free parts."""
        gone = [c for c, s in self.clients.items() if now - s.seen > self.lease_s]
        for name in gone:
            del self.clients[name]
            for key, pool in list(self.pools.items()):
                held = pool.held.pop(name, None)
                if held is not None:
                    pool.refill(now, key[1] == "tokens")
                    pool.free = min(pool.room(), pool.free + held)
                    self._forget_if_whole(key, pool)
        return gone

    def _pool(self, key: Key, capacity: int, now: float) -> _Pool:
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = _Pool(capacity, capacity, now)
        elif pool.capacity != capacity:  # the tenant's limit changed: at once, as one bucket
            if key[1] == "requests":
                pool.free += capacity - pool.capacity
            pool.capacity = capacity
            pool.refill(now, key[1] == "tokens")
        return pool

    def _forget_if_whole(self, key: Key, pool: _Pool) -> None:
        if not pool.held and pool.free >= pool.capacity:  # as good as a new one
            del self.pools[key]


class LedgerService:
    """The ledger's calls, as the ingresses make them (in this process, or through the Ray
    actor of router/ledger_actor.py)."""

    def __init__(self, ledger: ShareLedger, reclaim_s: float) -> None:
        """`reclaim_s`: the longest a borrow waits for others to give back room."""
        self.ledger = ledger
        self.reclaim_s = reclaim_s
        self._wanted: dict[str, set[Key]] = {}  # pools each client is asked to give back
        self._wake: dict[str, asyncio.Event] = {}
        self._told: set[str] = set()  # asked, and not yet answered
        self._reported = asyncio.Condition()

    @classmethod
    def for_sync(cls, sync_s: float, clock: Callable[[], float] = time.monotonic) -> LedgerService:
        """The ledger of clients that report every `sync_s`: a lease of ten reports, a
        borrow waits at most one report for room, and a replacement ledger three reports
        for every live client's holdings."""
        ledger = ShareLedger(LEASES_PER_SYNC * sync_s, clock, RECOVER_SYNCS * sync_s)
        return cls(ledger, reclaim_s=sync_s)

    async def poll(self, message: Message, wait_s: float) -> list[Key]:
        """Report; then wait up to `wait_s` for the ledger to want shares back. Returns the
        pools to give back (all that is not in use) in the next message."""
        self.ledger.report(message)
        for gone in [c for c in self._wake if c not in self.ledger.clients]:  # lease lapsed
            del self._wake[gone]
            self._wanted.pop(gone, None)
            self._told.discard(gone)
        client = message.client
        self._told.discard(client)
        async with self._reported:
            self._reported.notify_all()
        wake = self._wake.setdefault(client, asyncio.Event())
        if not self._wanted.get(client):
            try:
                await asyncio.wait_for(wake.wait(), wait_s)
            except TimeoutError:
                pass
        wake.clear()
        wanted = self._wanted.pop(client, set())
        if wanted:
            self._told.add(client)
        return sorted(wanted)

    async def borrow(self, message: Message, key: Key, capacity: int, need: int) -> Grant:
        """At least `need` of the pool for the client, or nothing once every other holder
        has given back what it does not use (or `reclaim_s` passed)."""
        self.ledger.report(message)
        if wait_s := self.ledger.recovering_s():  # replacing a dead ledger
            await asyncio.sleep(wait_s)
        client = message.client
        grant = self.ledger.grant(client, key, capacity, need)
        asked = self.ledger.holders(key, but=client)
        if grant.amount or not asked:
            return grant
        for other in asked:
            self._wanted.setdefault(other, set()).add(key)
            self._wake.setdefault(other, asyncio.Event()).set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.reclaim_s

        def answered() -> bool:
            return all(c not in self._wanted and c not in self._told for c in asked) or not any(
                c in self.ledger.clients for c in asked
            )

        async with self._reported:
            while not answered() and loop.time() < deadline:
                try:
                    await asyncio.wait_for(self._reported.wait(), deadline - loop.time())
                except TimeoutError:
                    break
                grant = self.ledger.grant(client, key, capacity, need)
                if grant.amount:
                    return grant
        return self.ledger.grant(client, key, capacity, need)
