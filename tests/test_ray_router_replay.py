"""The simulator's model of Ray Serve's routers (benchmarks/peers/ray_routers.py) against the real
thing: one request sequence through Ray 2.60's default router on a local Serve app of
multiplexed replicas, and through the model fed the same sequence. Where the model says
the choice is deterministic (one replica could win) Ray must pick that replica; elsewhere
Ray's pick must be one the model allows. The model then follows Ray's actual pick (its
per-replica LRU included), so the two stay in step for the whole sequence.

Each step waits until the replicas' model ids reached the router (pushed every 0.1 s) and
released requests finished, so the router's view is the model's."""

from __future__ import annotations

import asyncio
import random
import sys
from collections import Counter

import pytest

from loraplex.benchmarks.peers.ray_routers import (
    MultiplexLRU,
    RayRouterModel,
    RaySettings,
    RoutingContext,
)

pytest.importorskip("ray")

from loraplex.demo.lean_ray import lean_ray_serve  # noqa: E402

APP = "ray-router-replay"
REPLICAS = 3
MODELS_PER_REPLICA = 2
MAX_ONGOING = 2
SETTLE_S = 0.6  # > the 0.1 s model-id push plus the controller's broadcast


class Probe:
    """A replica of nothing but `@serve.multiplexed` (instant loads): streams its replica
    id, then holds the request open until the caller cancels it or `hold_s` passes."""

    def __init__(self, models_per_replica: int):
        from ray import serve

        async def load(model_id: str) -> str:
            return model_id

        self.load = serve.multiplexed(max_num_models_per_replica=models_per_replica)(load)

    async def __call__(self, hold_s: float):
        from ray import serve

        model = serve.get_multiplexed_model_id()
        if model:
            await self.load(model)
        yield serve.get_replica_context().replica_id.unique_id
        await asyncio.sleep(hold_s)


def replica_ids(ray) -> list[str]:
    prefix = f"SERVE_REPLICA::{APP}#Probe#"
    return sorted(
        entry["name"].removeprefix(prefix)
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["name"].startswith(prefix)
    )


@pytest.mark.ray
@pytest.mark.slow
def test_ray_router_model_makes_rays_choices():
    import ray
    from ray import cloudpickle, serve

    # Probe is defined here, and the replicas cannot import test modules: ship it by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with lean_ray_serve():
        deployment = serve.deployment(
            Probe,
            num_replicas=REPLICAS,
            max_ongoing_requests=MAX_ONGOING,
            ray_actor_options={"num_cpus": 0},
            graceful_shutdown_wait_loop_s=0.1,
            graceful_shutdown_timeout_s=1.0,
        )
        handle = serve.run(deployment.bind(MODELS_PER_REPLICA), name=APP, route_prefix=None)
        try:
            kinds = asyncio.run(_replay(handle, replica_ids(ray), steps=36, seed=7))
        finally:
            serve.delete(APP)
    # The sequence exercised each kind of decision, and every deterministic one matched.
    assert kinds["holder"] >= 5, kinds
    assert kinds["fallback"] >= 2, kinds
    assert kinds["deterministic"] >= 12, kinds


async def _replay(handle, replicas: list[str], steps: int, seed: int) -> Counter:
    assert len(replicas) == REPLICAS
    model = RayRouterModel(RaySettings(max_ongoing_requests=MAX_ONGOING), seed=seed)
    lru = {r: MultiplexLRU(MODELS_PER_REPLICA) for r in replicas}
    held: list[tuple[str, object]] = []  # (replica, stream) of requests kept open
    rng = random.Random(seed)
    kinds: Counter = Counter()
    loop = asyncio.get_running_loop()
    models = [f"m{i}" for i in range(5)]
    weights = [8, 4, 2, 1, 1]  # skewed: holders exist for most requests

    def queue_len() -> dict[str, int]:
        counts = Counter(r for r, _ in held)
        return {r: counts[r] for r in replicas}

    async def release(i: int) -> None:
        _, stream = held.pop(i)
        stream.cancel()

    for step in range(steps):
        model_id = rng.choices(models, weights)[0]
        view = {r: lru[r].reported() for r in replicas}
        ctx = RoutingContext(model_id, loop.time())
        predicted = model.route(ctx, loop.time(), view, queue_len())
        while predicted.replica is None or len(held) >= REPLICAS * MAX_ONGOING - 1:
            await release(rng.randrange(len(held)))  # Ray would back off: make room first
            await asyncio.sleep(SETTLE_S)
            ctx = RoutingContext(model_id, loop.time())
            predicted = model.route(ctx, loop.time(), view, queue_len())

        hold = rng.random() < 0.45
        stream = handle.options(stream=True, multiplexed_model_id=model_id).remote(
            60.0 if hold else 0.0
        )
        chosen = await asyncio.wait_for(anext(aiter(stream)), timeout=30)
        allowed = predicted.eligible
        assert chosen in allowed, (step, model_id, chosen, allowed, view, queue_len())
        if len(allowed) == 1:
            kinds["deterministic"] += 1
        holders = {r for r in replicas if model_id in view[r]}
        full = all(queue_len()[r] >= MAX_ONGOING for r in holders)
        kinds["holder" if holders and not full else "fallback"] += 1

        if not lru[chosen].use(model_id):  # the replica's multiplexer, loads are instant
            loaded, _ = lru[chosen].start_next_load()
            lru[chosen].loaded(loaded)
        if hold:
            held.append((chosen, stream))
        else:
            async for _ in stream:  # let it finish
                pass
        if held and rng.random() < 0.3:
            await release(rng.randrange(len(held)))
        await asyncio.sleep(SETTLE_S)

    for stream in [s for _, s in held]:
        stream.cancel()
    return kinds
