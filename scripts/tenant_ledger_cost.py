"""What the cluster-wide tenant limits cost a request at the ingress: admit, reserve and
release of one request (router/tenant_limiter.py), timed one by one, side by side with the
limiter before the ledger (each ingress alone; its source taken from git, OLD_COMMIT).

    common     a tenant well inside its limits: each ingress admits from its share
    contended  a tenant at its in-flight limit with the free room at the other ingress:
               every request asks the ledger, which takes the room back from the other

The two-ingress cases run two limiters against one ledger actor on a local Ray cluster
started here (and stopped at the end). Prints p50 and p90 in microseconds per case.

    RAY_AUTH_MODE=disabled .venv/bin/python scripts/tenant_ledger_cost.py [N]
"""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray

from loraplex.registry.models import TenantLimits
from loraplex.router.ledger_actor import RayLedger
from loraplex.router.tenant_limiter import TenantLimiter

OLD_COMMIT = "4968d97"
ROOT = Path(__file__).resolve().parents[1]
COMMON = TenantLimits(max_requests_in_flight=256, tokens_per_minute=10**9)


def old_limiter_class() -> type:
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{OLD_COMMIT}:router/tenant_limiter.py"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "old_tenant_limiter.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_tenant_limiter", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.TenantLimiter


def quantiles(samples: list[float]) -> str:
    us = sorted(s * 1e6 for s in samples)
    return f"p50 {statistics.median(us):8.1f} us   p90 {us[int(0.9 * len(us))]:8.1f} us"


async def timed_new(limiters: list[TenantLimiter], limits: TenantLimits, n: int) -> list[float]:
    out = []
    for i in range(n):
        lim = limiters[i % len(limiters)]
        t = time.perf_counter()
        ticket = await lim.admit("t", limits)
        await ticket.reserve(100)
        ticket.release(100)
        out.append(time.perf_counter() - t)
    return out


def timed_old(n: int) -> list[float]:
    lim = old_limiter_class()()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        ticket = lim.admit("t", COMMON)
        ticket.reserve(100)
        ticket.release(100)
        out.append(time.perf_counter() - t)
    return out


async def contended(a: TenantLimiter, b: TenantLimiter, n: int) -> list[float]:
    """One slot left, its room at `a`; each request arrives at the ingress that does not
    hold it."""
    one = TenantLimits(max_requests_in_flight=2)
    keep = await b.admit("t", one)  # one request stays in flight throughout
    out = []
    for i in range(n):
        here = b if i % 2 else a
        t = time.perf_counter()
        ticket = await here.admit("t", one)
        out.append(time.perf_counter() - t)
        ticket.release()
    keep.release()
    return out


async def main(n: int) -> None:
    local = TenantLimiter()
    sync_s = 1.0
    a, b = (
        TenantLimiter(RayLedger(sync_s), sync_s=sync_s),
        TenantLimiter(RayLedger(sync_s), sync_s=sync_s),
    )
    tasks = [asyncio.create_task(x.run()) for x in (local, a, b)]
    await timed_new([a, b], COMMON, 50)  # warm: the actor started, first shares taken
    rounds = {
        "old (each ingress alone)": [],
        "new, one ingress": [],
        "new, two ingresses + Ray ledger": [],
    }
    for _ in range(4):  # interleaved, so that machine load hits all alike
        rounds["old (each ingress alone)"] += timed_old(n // 4)
        rounds["new, one ingress"] += await timed_new([local], COMMON, n // 4)
        rounds["new, two ingresses + Ray ledger"] += await timed_new([a, b], COMMON, n // 4)
    for name, samples in rounds.items():
        print(f"common     {name:34s} {quantiles(samples)}  (n={len(samples)})")
    print(
        f"contended  {'new, two ingresses + Ray ledger':34s} {quantiles(await contended(a, b, n // 4))}  (n={n // 4})"
    )
    for t in tasks:
        t.cancel()


if __name__ == "__main__":
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000))
    finally:
        ray.shutdown()
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
