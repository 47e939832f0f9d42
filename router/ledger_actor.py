"""The tenants' ledger (router/tenant_ledger.py) as one named Ray actor that every ingress
replica of the app shares. The first ingress to look it up creates it; it lives as long as
that ingress (no actor outlives the app). When a call fails (the actor died with its owner,
or is restarting), the next call looks it up again, creating it if it is gone, and the new
ledger learns each ingress's holdings from its next message's snapshot.
"""

from __future__ import annotations

import ray
from ray.exceptions import RayError

from loraplex.router.tenant_ledger import Grant, Key, LedgerService, Message

LEDGER_NAME = "loraplex-tenant-ledger"


@ray.remote(num_cpus=0)
class LedgerActor:
    def __init__(self, sync_s: float) -> None:
        self.service = LedgerService.for_sync(sync_s)

    async def borrow(self, message: Message, key: Key, capacity: int, need: int) -> Grant:
        return await self.service.borrow(message, key, capacity, need)

    async def poll(self, message: Message, wait_s: float) -> list[Key]:
        return await self.service.poll(message, wait_s)


class RayLedger:
    """The ingress's side of the actor (router/tenant_limiter.py's `Ledger`)."""

    def __init__(self, sync_s: float, name: str = LEDGER_NAME) -> None:
        self.sync_s = sync_s
        self.name = name
        self._handle = None

    def _actor(self):  # noqa: ANN202 (Ray's ActorHandle is untyped)
        if self._handle is None:
            options = LedgerActor.options(name=self.name, get_if_exists=True)
            self._handle = options.remote(self.sync_s)
        return self._handle

    async def borrow(self, message: Message, key: Key, capacity: int, need: int) -> Grant:
        try:
            return await self._actor().borrow.remote(message, key, capacity, need)
        except RayError:
            self._handle = None
            raise

    async def poll(self, message: Message, wait_s: float) -> list[Key]:
        try:
            return await self._actor().poll.remote(message, wait_s)
        except RayError:
            self._handle = None
            raise
