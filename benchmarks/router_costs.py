"""What the affinity router is told about a machine: its load and batching costs, measured
on one engine of the replicas' configuration (`loraplex bench router` passes them as the
router's kwargs)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from loraplex.benchmarks.engine import decode_batch, interleaved
from loraplex.replica.config import build_engine_config
from loraplex.replica.engine import LLMEngine
from loraplex.replica.sampling import SamplingParams

if TYPE_CHECKING:
    from loraplex.benchmarks.router_workload import Workload


def measure_router_costs(
    engine_config: dict[str, Any], sources: dict[str, Path], w: Workload
) -> dict[str, float]:
    """AffinityConfig cost fields measured on one engine of the replicas' configuration, one
    thread (as each replica runs), before any replica starts. With `segment` the growth of
    a full batch's decode step per distinct adapter in it (the multi-LoRA loop runs once
    per adapter segment) and `out` the mean output tokens:

        host_load_cost_s  host tier -> pool (a first request's extra time) + segment * out:
                          an adapter new to a replica adds its segment to every step while
                          it runs. A replica pays this for an adapter it served before
                          (its host tier keeps it); a first use also reads the artifact
        load_cost_s       + reading the adapter from its folder
        busy_cost_s       2 x the step's growth per sequence, one adapter (a new request
                          waits out the current step, then runs its prefill step)
        request_time_s    out x the step time of a full batch of distinct adapters
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = LLMEngine(build_engine_config(engine_config))
        names = list(sources)[: min(w.adapters_per_replica, w.max_num_seqs)]
        vocab = engine.model_config.vocab_size  # ordinary ids: 10..vocab-1, over and over
        prompt = [10 + i % (vocab - 10) for i in range(sum(w.prompt_tokens) // 2)]
        reads, copies = [], []
        for name in names:
            start = time.perf_counter()
            engine.add_adapter(name, sources[name])
            reads.append(time.perf_counter() - start)
            cold, warm = (_one_token(engine, prompt, name) for _ in range(2))
            copies.append(max(0.0, cold - warm))
        full = w.max_num_seqs
        one = _decode_step_s(engine, len(prompt), names[:1])
        same = _decode_step_s(engine, len(prompt), names[:1] * full)
        mixed = _decode_step_s(engine, len(prompt), [names[i % len(names)] for i in range(full)])
    finally:
        torch.set_num_threads(threads)
    out = sum(w.output_tokens) / 2
    segment = max(0.0, mixed - same) / max(1, len(names) - 1)
    host = float(np.median(copies)) + segment * out
    return {
        "load_cost_s": float(np.median(reads)) + host,
        "host_load_cost_s": host,
        "busy_cost_s": 2 * max(0.0, same - one) / (full - 1),
        "request_time_s": out * mixed,
    }


def _one_token(engine: LLMEngine, prompt: list[int], adapter: str) -> float:
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), adapter)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def _decode_step_s(engine: LLMEngine, context: int, adapters: list[str]) -> float:
    """Fastest of 5 decode steps of a batch of len(adapters) sequences."""
    decode_batch(engine, adapters, context)
    (step_s,) = interleaved([engine.step], 5)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    return step_s
