"""What `loraplex bench router` measures on one engine of the replicas' configuration before
the runs (one thread, as each replica runs): the affinity router's cost inputs, the unloaded
TTFT the SLO is made of, and step timings for the simulator's CPU profile."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from loraplex.benchmarks.engine.bench import decode_batch, interleaved
from loraplex.benchmarks.sim.profiles import StepLoad
from loraplex.replica.config import build_engine_config
from loraplex.replica.engine import LLMEngine
from loraplex.replica.sampling import SamplingParams

if TYPE_CHECKING:
    from loraplex.benchmarks.router.workload import Workload


def measure_router_costs(
    engine_config: dict[str, Any], sources: dict[str, Path], w: Workload
) -> tuple[dict[str, float], dict[str, Any]]:
    """AffinityConfig cost fields, and the calibration beside them. With `segment` the
    growth of a full batch's decode step per distinct adapter in it (the multi-LoRA loop
    runs once per adapter segment) and `out` the mean output tokens:

        host_load_cost_s  host tier -> pool (a first request's extra time) + segment * out:
                          an adapter new to a replica adds its segment to every step while
                          it runs. A replica pays this for an adapter its host tier holds
        load_cost_s       + reading the adapter from the artifact store (read model on)
        busy_cost_s       2 x the step's growth per sequence, one adapter (a new request
                          waits out the current step, then runs its prefill step)
        request_time_s    out x the step time of a full batch of distinct adapters: how
                          long a request holds a slot of a full batch

    Calibration: `unloaded_ttft_s`, the mean TTFT of a request alone on an idle engine that
    reads its adapter from the store first (read, copy, prefill); `steps`, (StepLoad,
    seconds) of a mixed stream of requests for the CPU profile; the copy bandwidth."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = LLMEngine(build_engine_config(engine_config))
        names = list(sources)[: min(w.adapters_per_replica, w.max_num_seqs)]
        prompt = ordinary_ids(sum(w.prompt_tokens) // 2, engine.model_config.vocab_size)
        reads, copies, unloaded = [], [], []
        for name in names:
            start = time.perf_counter()
            engine.add_adapter(name, sources[name])
            reads.append(time.perf_counter() - start)
            cold, warm = (_one_token(engine, prompt, name) for _ in range(2))
            copies.append(max(0.0, cold - warm))
            unloaded.append(reads[-1] + cold)
        full = w.max_num_seqs
        one = _decode_step_s(engine, len(prompt), names[:1])
        same = _decode_step_s(engine, len(prompt), names[:1] * full)
        mixed = _decode_step_s(engine, len(prompt), [names[i % len(names)] for i in range(full)])
        steps = _step_samples(engine, names, w)
    finally:
        torch.set_num_threads(threads)
    out = sum(w.output_tokens) / 2
    segment = max(0.0, mixed - same) / max(1, len(names) - 1)
    host = float(np.median(copies)) + segment * out
    costs = {
        "load_cost_s": float(np.median(reads)) + host,
        "host_load_cost_s": host,
        "busy_cost_s": 2 * max(0.0, same - one) / (full - 1),
        "request_time_s": out * mixed,
    }
    calibration = {
        "unloaded_ttft_s": float(np.mean(unloaded)),
        "steps": steps,
        "copy_bytes_per_s": _copy_rate(engine, names),
    }
    return costs, calibration


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


def ordinary_ids(n: int, vocab: int) -> list[int]:
    """`n` prompt token ids of the model's vocabulary: 10..vocab-1, over and over (a prompt
    longer than the vocabulary wraps rather than running past it)."""
    return [10 + i % (vocab - 10) for i in range(n)]


def _step_samples(engine: LLMEngine, names: list[str], w: Workload) -> list[tuple[StepLoad, float]]:
    """Every step of a closed-loop stream of requests of the bench's lengths over `names`
    and the base model, joining a few at a time, with what it computed and how long it
    took. Without base-model requests every step's LoRA tokens were its tokens: the fit
    could not tell the LoRA terms from the token term (the run of 2026-12-02 fitted
    c_lora 0 and R² 0.50, and the simulated engine served the base burst at 94 req/s
    against the real one's 172-245, the zipf LoRA burst at 81 against 55-75)."""
    rng = np.random.default_rng(w.seed)
    ranks = {n: engine.adapters.host[n].rank for n in names}
    nbytes = {n: engine.adapters.nbytes_of(n) for n in names}
    samples: list[tuple[StepLoad, float]] = []
    schedule = engine.scheduler.schedule
    batches: list = []

    def recording():
        out = schedule()
        batches.append([(s.adapter, s.num_computed, n) for s, n in out])
        return out

    engine.scheduler.schedule = recording
    try:
        for _ in range(12 * w.max_num_seqs):
            free = w.max_num_seqs - len(engine.requests)
            # mostly one at a time; now and then a burst fills the batch: prefill steps of
            # many prompts, without which a prompt token costs what a decode row does
            joining = free if rng.random() < 0.1 else int(free > 0 and rng.random() < 0.5)
            for _ in range(joining):
                n = int(rng.integers(w.prompt_tokens[0], w.prompt_tokens[1] + 1))
                out = int(rng.integers(w.output_tokens[0], w.output_tokens[1] + 1))
                params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
                pick = int(rng.integers(len(names) + 2))  # 1 in 5 base-model (of 8 adapters)
                engine.add_request(
                    ordinary_ids(n, engine.model_config.vocab_size),
                    params,
                    names[pick] if pick < len(names) else None,
                )
            if not engine.has_unfinished():
                continue
            batches.clear()
            start = time.thread_time()  # the step's CPU: another process's turn is not its
            engine.step()
            took = time.thread_time() - start
            if batches and batches[-1]:
                batch = batches[-1]
                adapters = {a for a, _, _ in batch if a is not None}
                load = StepLoad(
                    tokens=sum(n for _, _, n in batch),
                    context=sum(c + n for _, c, n in batch),
                    token_rank=sum(n * ranks[a] for a, _, n in batch if a is not None),
                    adapter_bytes=sum(nbytes[a] for a in adapters),
                    adapters=len(adapters),
                    rows=len(batch),
                )
                samples.append((load, took))
    finally:
        engine.scheduler.schedule = schedule
        for request_id in list(engine.requests):
            engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()
    return samples


def _copy_rate(engine: LLMEngine, names: list[str]) -> float:
    """Host -> pool bytes per second: the largest adapter's copy into its pages, timed."""
    from loraplex.replica.memory.pool import PageKind

    big = max(names, key=engine.adapters.nbytes_of)
    weights = engine.adapters.host[big]
    pages = engine.pool.allocate(engine.adapters.pages_of(big), PageKind.ADAPTER)
    resident = engine.adapters.layout.place(weights, pages)
    start = time.perf_counter()
    for _ in range(5):
        engine.adapters.layout.fill(resident, weights)
    rate = 5 * weights.nbytes / (time.perf_counter() - start)
    engine.pool.free(resident.pages)
    return rate
