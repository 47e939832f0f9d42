"""The Serve deployment with `tp: 2` on a real local Ray: the replica is rank 0 and rank 1 is
a Ray actor in the replica's placement group (options from the cluster config), gloo on
CPU. Oracle: the offline tp = 1 engine's greedy tokens. Then rank 1 is killed: the replica
fails its requests and its health check (so Serve replaces it) instead of hanging, and the
replacement serves again."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from loraplex.cluster.config import LoraplexConfig
from loraplex.demo.lean_ray import lean_ray_serve
from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine
from loraplex.replica.protocol import GenerateRequest
from loraplex.replica.sampling import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "loraplex-tp-test"
PROMPT = [17, 230, 41, 998, 5, 77, 301, 12]
MAX_TOKENS = 8


def _request() -> GenerateRequest:
    return GenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=list(PROMPT),
        adapter=None,
        params={"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True},
    )


async def _tokens(handle) -> list[int]:
    tokens: list[int] = []
    async with asyncio.timeout(120):
        async for chunk in handle.options(stream=True).generate.remote(_request()):
            tokens += chunk["new_token_ids"]
    return tokens


def test_serve_deployment_with_tp2(demo_assets):
    ray = pytest.importorskip("ray")
    from ray import serve

    from loraplex.replica.deployment import deployment

    config = LoraplexConfig.model_validate(
        {
            "model": str(demo_assets.model),
            "engine": {"dtype": "float32", "pool_mib": 16, "page_kib": 64, "max_num_seqs": 4},
            "replicas": {"num_replicas": 1, "num_cpus": 0.5, "tp": 2},
        }
    )
    options = config.serve_options()
    assert options["placement_group_bundles"] == [{"CPU": 0.5}, {"CPU": 1}]
    engine_config = config.engine_config()
    assert engine_config["tp"] == 2

    offline = LLMEngine(EngineConfig(model=str(demo_assets.model), dtype="float32"))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    (want,) = offline.generate([PROMPT], [params], [None])

    with lean_ray_serve():
        app = deployment(
            **options,
            health_check_period_s=1.0,
            graceful_shutdown_wait_loop_s=0.2,
            graceful_shutdown_timeout_s=2.0,
        ).bind(engine_config)
        handle = serve.run(app, name=APP, route_prefix=None)
        assert asyncio.run(_tokens(handle)) == want.token_ids
        stats = handle.stats.remote().result(timeout_s=60)
        assert stats["tp"]["size"] == 2 and stats["tp"]["launcher"] == "ray"
        assert stats["tp"]["bytes_sent_rank0"]["base"] > 0

        (worker,) = [
            ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("loraplex-tp-")
        ]
        ray.kill(worker)
        with pytest.raises(Exception):  # noqa: B017 (the replica's own error, whatever Ray wraps it in)
            asyncio.run(_tokens(handle))
        deadline = time.monotonic() + 120
        while True:  # Serve's health check fails the replica and starts another
            try:
                assert asyncio.run(_tokens(handle)) == want.token_ids
                break
            except Exception:  # noqa: BLE001
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
