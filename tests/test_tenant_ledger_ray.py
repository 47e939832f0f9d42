"""The tenants' ledger as the Ray actor the ingress replicas share (router/ledger_actor.py),
on a real local Ray: two limiters in this driver stand for two ingresses. A share is taken
back from one ingress for the other through the actor; and when the actor dies, the next
call creates a new one, which learns each ingress's shares from its next report, so the limit
still holds: a ledger starting empty would have let four more in, and one that granted before
hearing from both would have let in what the other holds."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from loraplex.demo.lean_ray import lean_ray_serve
from loraplex.registry.models import TenantLimits
from loraplex.router.tenant_limiter import RateLimited, TenantLimiter

pytestmark = pytest.mark.ray

SYNC_S = 0.1
FOUR = TenantLimits(max_requests_in_flight=4)


async def refused(lim: TenantLimiter) -> bool:
    try:
        (await lim.admit("t", FOUR)).release()
    except RateLimited:
        return True
    return False


async def replaced(name: str, timeout_s: float = 60.0) -> None:
    """Until a new actor of that name answers (a loaded machine starts one in seconds)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(SYNC_S)
        try:
            await ray.get_actor(name).__ray_ready__.remote()
            return
        except (ValueError, ray.exceptions.RayError):  # not created yet, or the dead one
            continue
    raise TimeoutError(f"no new {name} within {timeout_s} s")


def test_the_limit_holds_through_the_actor_and_across_its_restart():
    import ray

    from loraplex.router.ledger_actor import RayLedger

    async def run() -> None:
        name = f"ledger-{uuid.uuid4().hex[:8]}"
        a = TenantLimiter(RayLedger(SYNC_S, name), sync_s=SYNC_S)
        b = TenantLimiter(RayLedger(SYNC_S, name), sync_s=SYNC_S)
        reports = [asyncio.create_task(lim.run()) for lim in (a, b)]
        try:
            at_a = [await a.admit("t", FOUR) for _ in range(3)]
            at_b = await b.admit("t", FOUR)  # room a held, given back through the actor
            assert await refused(a) and await refused(b)

            ray.kill(ray.get_actor(name))
            await replaced(name)  # the first limiter's retried report created a new one
            await asyncio.sleep(10 * SYNC_S)  # each limiter's report fails, then re-registers
            assert await refused(a) and await refused(b)  # the new ledger knows the shares

            at_a.pop().release()
            again = await b.admit("t", FOUR)  # the freed room, taken back from a
            assert await refused(a)
            for ticket in [*at_a, at_b, again]:
                ticket.release()
        finally:
            for task in reports:
                task.cancel()

    with lean_ray_serve(num_cpus=1):
        asyncio.run(run())
