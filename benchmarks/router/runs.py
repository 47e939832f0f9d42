"""One measured run of `loraplex bench router`: a request stream through one Serve app on a
real local Ray, open loop, and what its replicas counted meanwhile. For the failover
workload a replica is killed mid-run and the run waits until Serve has replaced it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loraplex.replica.protocol import GenerateRequest, ReplicaFailed

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from loraplex.router.serve_backend import ServeBackend

COUNTERS = (
    "loads",
    "reads",
    "load_seconds",
    "hits",
    "evictions",
    "preemptions",
    "steps",
    "step_seconds",
)


@contextlib.contextmanager
def no_client_gc() -> Iterator[None]:
    """The load generator's garbage collector off for a timed window, on again (and run)
    after it. Requests are timed from their scheduled arrival by this process, which also
    reads every stream and hosts the Ray driver: its gen-2 collections took ~150 ms every
    ~40 s (a stall watch on every process of a fairness run), and a request sent or read in
    one counted the client's pause as the system's TTFT (two requests 148 ms apart both
    answered ~300 ms late, in about one fairness run in three)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


@dataclass(frozen=True, slots=True)
class BenchRequest:
    at_s: float  # arrival, from the start of the run
    adapter: str | None  # None: the base model
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Outcome:
    at_s: float
    ttft_s: float | None = None
    latency_s: float | None = None
    tokens: int = 0
    error: str | None = None
    stream_failed: bool = False  # the replica died after the first chunk


async def drive(
    backend: ServeBackend,
    requests: list[BenchRequest],
    tag: str,
    timeout_s: float,
    kill: tuple[float, Any] | None = None,
) -> tuple[list[Outcome], float]:
    """Send each request at its arrival (open loop); `kill` = (at_s, callable) runs the
    callable in a thread at that time. The arrivals count from after `no_client_gc`'s
    collection: counted from before it, the collection (~0.25 s in the router bench's
    driver) was in the TTFT of every request due meanwhile (the first 4-6 of every run,
    0.15-0.27 s against 0.007 s in their replay: the p99 of the warm routers' runs)."""
    start = math.nan  # set once the collector has run, before any request is sent

    async def one(i: int, r: BenchRequest) -> Outcome:
        arrival = start + r.at_s
        await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
        outcome = Outcome(r.at_s)
        request = GenerateRequest(
            request_id=f"{tag}-{i}",
            prompt_token_ids=r.prompt,
            adapter=r.adapter,
            params={"max_tokens": r.max_tokens, "temperature": 0.0, "ignore_eos": True},
        )
        try:
            async with asyncio.timeout(timeout_s):
                async for piece in backend.generate(request):
                    if outcome.ttft_s is None:
                        outcome.ttft_s = time.perf_counter() - arrival
                    outcome.tokens += len(piece["new_token_ids"])
            outcome.latency_s = time.perf_counter() - arrival
        except ReplicaFailed as e:
            outcome.stream_failed = outcome.ttft_s is not None
            outcome.error = repr(e)
        except Exception as e:  # counted and reported, never hidden
            outcome.error = repr(e)
        return outcome

    async def killer() -> None:
        at, action = kill
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        await asyncio.to_thread(action)

    tasks = [one(i, r) for i, r in enumerate(requests)]
    if kill is not None:
        tasks.append(killer())
    with no_client_gc():
        start = time.perf_counter()
        outcomes = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start  # nor the collection after it
    return [o for o in outcomes if isinstance(o, Outcome)], elapsed


def replica_actors(app: str, deployment: str) -> dict[str, Any]:
    """Live replica actors of a deployment, by replica id."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return {
        entry["name"].removeprefix(prefix): ray.get_actor(
            entry["name"], namespace=entry["namespace"]
        )
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["name"].startswith(prefix)
    }


def counters(app: str, deployment: str) -> dict[str, dict[str, float] | None]:
    """Each live replica's cumulative counters (the "bench" entry of its routing stats);
    None for a replica that did not answer twice within 30 s (one that just died, or one
    too busy), so that a run can say its counts miss it."""
    import ray

    actors = replica_actors(app, deployment)
    out: dict[str, dict[str, float] | None] = {}
    for rid, actor in actors.items():
        out[rid] = None
        for _ in range(2):
            try:
                out[rid] = ray.get(actor.record_routing_stats.remote(), timeout=30)["bench"]
                break
            except Exception as e:  # counted below, never hidden
                log.warning("counters of %s/%s: %r", app, rid, e)
    return out


def delta(before: dict, after: dict) -> dict[str, float]:
    """Counters summed over replicas, this run's share: replicas gone since `before` are
    lost with what they counted (the failover run), new ones count from 0.
    `counters_unread`: live replicas whose counters could not be read before or after the
    run, whose share is missing from the sums."""
    total = dict.fromkeys(COUNTERS, 0.0)
    total["counters_unread"] = float(
        sum(1 for v in before.values() if v is None) + sum(1 for v in after.values() if v is None)
    )
    for rid, now in after.items():
        was = before.get(rid) or {}
        if now is None or (rid in before and before[rid] is None):
            continue
        for key in COUNTERS:
            total[key] += now.get(key, 0) - was.get(key, 0)
    return total


def kill_one(app: str, deployment: str, seed: int) -> str:
    """Kill one replica actor (the first by id, after a seeded shuffle): Serve replaces it."""
    import random

    import ray

    actors = replica_actors(app, deployment)
    victim = random.Random(seed).choice(sorted(actors))
    ray.kill(actors[victim], no_restart=True)
    return victim


def wait_for_replicas(app: str, deployment: str, n: int, timeout_s: float = 180.0) -> float:
    """Wait until the deployment runs `n` healthy replicas again; the seconds it took."""
    from ray import serve

    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        status = serve.status().applications.get(app)
        if status is not None:
            dep = status.deployments.get(deployment)
            running = dep.replica_states.get("RUNNING", 0) if dep else 0
            if running >= n and dep.status == "HEALTHY":
                return time.perf_counter() - start
        time.sleep(0.5)
    raise TimeoutError(f"{app}: fewer than {n} replicas after {timeout_s:.0f} s")
