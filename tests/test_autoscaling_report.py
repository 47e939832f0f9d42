"""A real replica's autoscaling report (replica/deployment.py `record_autoscaling_stats`):
the tokens it counts are the ones its engine computed and streamed, priced by the engine's
own step costs. The replica runs its real engine on the demo model, without Ray (the Serve
replica context is the only thing its constructor takes from Serve)."""

from __future__ import annotations

import asyncio
import time

import pytest

from loraplex.replica.async_engine import Engine
from loraplex.replica.config import build_engine_config
from loraplex.replica.deployment import ReplicaDeployment
from loraplex.replica.protocol import (
    AUTOSCALE_REQUESTS,
    AUTOSCALE_UTILISATION,
    GenerateRequest,
    token_utilisation,
)

SLOTS = 4
OUTPUT = 24


def replica_without_serve(model_dir) -> ReplicaDeployment:
    """`ReplicaDeployment.__init__`'s state for the base model (no registry), set by hand."""
    replica = object.__new__(ReplicaDeployment)
    replica.replica_id, replica.watcher, replica.sync = "r0", None, None
    cfg = build_engine_config(
        {
            "model": str(model_dir),
            "pool_bytes": 64 << 20,
            "page_bytes": 64 << 10,
            "scheduler": {"max_num_seqs": SLOTS},
        }
    )
    replica.max_concurrency = cfg.scheduler.max_num_seqs
    replica.host_bytes = cfg.cache.host_bytes
    replica._start_counters()
    replica.engine = Engine(cfg)
    return replica


def request(i: int) -> GenerateRequest:
    # distinct prompts: no prefix-cache hit, every prompt token is computed
    return {
        "request_id": f"q{i}",
        "prompt_token_ids": [11 + i, 40 + 3 * i, 7, 90 + i, 5],
        "adapter": None,
        "params": {"max_tokens": OUTPUT, "temperature": 0.0, "ignore_eos": True},
    }


def test_the_report_prices_the_tokens_the_replica_computed_and_streamed(demo_assets):
    replica = replica_without_serve(demo_assets.model)

    async def client(i: int) -> int:
        return sum([len(c["new_token_ids"]) async for c in replica.generate(request(i))])

    async def body():
        streamed = sum(await asyncio.gather(*(client(i) for i in range(12))))
        # the steps' costs are measured (the estimator needs 32 steps): price what was made
        assert (await replica.engine.stats())["step_costs"] is not None
        since = replica._autoscale_mark[0]
        before = time.monotonic()
        report = await replica.record_autoscaling_stats()
        after = time.monotonic()
        stats = await replica.engine.stats()
        priced = {
            "prompt_tokens": 12 * 5,
            "output_tokens": streamed,
            "slots": SLOTS,
            "adapters": 0,
        }
        slowest = token_utilisation(stats, elapsed_s=after - since, **priced)
        fastest = token_utilisation(stats, elapsed_s=before - since, **priced)
        assert streamed == 12 * OUTPUT and report[AUTOSCALE_REQUESTS] == 0
        assert 0 < slowest <= report[AUTOSCALE_UTILISATION] <= fastest
        again = await replica.record_autoscaling_stats()  # nothing made since
        assert again[AUTOSCALE_UTILISATION] == 0.0

    try:
        asyncio.run(body())
    finally:
        replica.engine.shutdown()
        replica.engine = None


@pytest.mark.parametrize("elapsed_s", [0.0, -1.0])
def test_no_time_elapsed_reports_no_utilisation(elapsed_s):
    costs = {
        "base_s": 0.01,
        "per_prompt_token_s": 1e-4,
        "per_decode_row_s": 1e-4,
        "per_adapter_s": 0,
    }
    used = token_utilisation(
        {"step_costs": costs},
        prompt_tokens=10,
        output_tokens=10,
        elapsed_s=elapsed_s,
        slots=4,
        adapters=1,
    )
    assert used == 0.0
