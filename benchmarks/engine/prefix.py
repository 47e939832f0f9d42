"""`loraplex bench engine`, section `prefix`: prefix caching on a multi-tenant chat workload.

16 tenants, each with a system prompt of 512-1,024 tokens and its own adapter. Each tenant's
users hold multi-turn conversations: a turn's prompt is the system prompt, the earlier
turns (the user's messages and the engine's own answers) and a new message. Conversations
start as a Poisson process; a turn arrives an exponential think time after the previous
answer ends. Requests carry their tenant (the cache's salt).

Time is the engine's own: each step advances a virtual clock by the CPU time the process
spent in it (the step, and adapter copies on the copy thread meanwhile), and an idle engine
jumps to the next arrival. So no run waits in real time, and other processes on a shared
machine barely move the clock: wall time there stretched one run 2.5x against its pair.

- prefill_tokens_ratio: prompt tokens the engine computed / prompt tokens requested,
  caching on, over the runs at equal load (target <= 0.3).
- p50_ttft_ratio: p50 time to first token, caching on / off, the same arrivals (target
  <= 0.5). The offered load is 70% of what the cache-off engine sustains: conversations
  arrive at 0.7 x the rate it served them saturated (measured in the first round).
- throughput_ratio: generated tokens per second on / off with every conversation started
  at once and no think time: the engine saturated (target >= 1.5).
- unified_vs_split: P99 TTFT of the one-decision pool (idle cached blocks and idle adapters
  evicted by the cost of losing each) / that of a static split (idle cached blocks capped at
  a fixed share of the pool, evicted only among themselves or as a last resort), under
  adapter pressure: every tenant's adapter is a large one (rank 64, all projections) and
  the pool holds a full batch plus half of what the adapters and the cache's working set
  need; the same arrivals. The split gives cached blocks half the pool.

On and off (unified and split) run alternately, round after round, each on its own engine,
the cache reset before each run; each round draws a new workload. One torch thread: the
section's small matrices gain nothing from two, and one is steadier on a shared machine.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from loraplex.benchmarks.report import log
from loraplex.demo.synthetic import AdapterSpec, ModelSpec, write_adapter, write_checkpoint
from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.scheduling.scheduler import SchedulerConfig
from loraplex.settings import MiB

TARGETS = (("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"))
ALL_TARGETS = (*TARGETS[1], "gate_proj", "up_proj", "down_proj")
LOAD = 0.7  # offered load, as a share of what the cache-off engine sustains
SPLIT_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class ChatShape:
    model: ModelSpec
    tenants: int
    system_tokens: tuple[int, int]
    conversations: int  # per tenant
    turns: int
    user_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    max_num_seqs: int
    rounds: int


FULL = ChatShape(
    model=ModelSpec(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=4096,
        rope_scaling=None,
    ),
    tenants=16,
    system_tokens=(512, 1024),
    conversations=2,
    turns=3,
    user_tokens=(32, 96),
    output_tokens=(16, 32),
    max_num_seqs=8,
    rounds=2,
)
# Every key in under half a minute: the full run's conversations (two of three turns a
# tenant) with shorter prompts, one round. Its conversations are the full run's, not fewer:
# with one of two turns a tenant (until 2026-12-06), every first turn meets its tenant's
# system prompt cold, so half the requests could not hit by construction, the prompt tokens
# computed could not fall below half, and the median TTFT fell where hits meet misses
# (`p50_ttft_ratio` 0.56-0.75; 0.30-0.43 in five rounds with these, 2026-12-06; 0.142 full).
QUICK = ChatShape(
    model=FULL.model,
    tenants=16,
    system_tokens=(128, 256),
    conversations=FULL.conversations,
    turns=FULL.turns,
    user_tokens=(16, 48),
    output_tokens=(8, 16),
    max_num_seqs=8,
    rounds=1,
)


@dataclass(frozen=True, slots=True)
class Conversation:
    tenant: int
    messages: tuple[tuple[int, ...], ...]  # the user's message of each turn
    answers: tuple[int, ...]  # tokens the engine generates for each turn


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    system: tuple[tuple[int, ...], ...]  # per tenant
    conversations: tuple[Conversation, ...]

    @classmethod
    def draw(cls, shape: ChatShape, seed: int) -> ChatWorkload:
        rng = np.random.default_rng(seed)
        vocab = shape.model.vocab_size

        def tokens(bounds: tuple[int, int]) -> tuple[int, ...]:
            n = rng.integers(*bounds, endpoint=True)
            return tuple(rng.integers(10, vocab, size=n).tolist())

        system = tuple(tokens(shape.system_tokens) for _ in range(shape.tenants))
        convs = []
        for tenant in range(shape.tenants):
            for _ in range(shape.conversations):
                messages = tuple(tokens(shape.user_tokens) for _ in range(shape.turns))
                answers = tuple(
                    int(rng.integers(*shape.output_tokens, endpoint=True))
                    for _ in range(shape.turns)
                )
                convs.append(Conversation(tenant, messages, answers))
        order = rng.permutation(len(convs))
        return cls(system, tuple(convs[i] for i in order))

    @property
    def requests(self) -> int:
        return sum(len(c.messages) for c in self.conversations)


@dataclass(slots=True)
class RunResult:
    ttft_s: list[float]
    makespan_s: float
    generated: int
    prompt_tokens: int
    prompt_tokens_computed: int


def serve_chat(
    engine: LLMEngine, workload: ChatWorkload, adapters: list[str], rate: float | None, seed: int
) -> RunResult:
    """Serve every conversation, each turn once the previous answer is complete. `rate`:
    conversations per second (Poisson) with exponential think times of mean 1 / rate
    between turns; None: all at once, no think time. Times are the engine's (module doc)."""
    rng = np.random.default_rng(seed)
    n = len(workload.conversations)
    gaps = rng.exponential(1 / rate, size=n) if rate else np.zeros(n)
    arrivals = [(float(t), i) for i, t in enumerate(np.cumsum(gaps))]
    heapq.heapify(arrivals)
    history = [list(workload.system[c.tenant]) for c in workload.conversations]
    turn = [0] * n
    owner: dict[str, tuple[int, float]] = {}  # request id -> (conversation, arrival)
    ttft, generated, clock = [], 0, 0.0
    before = engine.stats()["prefix_cache"]
    while arrivals or engine.has_unfinished():
        while arrivals and arrivals[0][0] <= clock:
            at, i = heapq.heappop(arrivals)
            conv = workload.conversations[i]
            history[i] += conv.messages[turn[i]]
            params = SamplingParams(
                max_tokens=conv.answers[turn[i]], temperature=0, ignore_eos=True
            )
            seq = engine.add_request(
                history[i], params, adapters[conv.tenant], tenant=f"tenant-{conv.tenant}"
            )
            owner[seq.request_id] = (i, at)
        if not engine.has_unfinished():
            clock = arrivals[0][0]
            continue
        start = time.process_time()
        outputs = engine.step()
        clock += time.process_time() - start
        for out in outputs:
            i, at = owner[out.request_id]
            if len(out.token_ids) == 1 and out.new_token_ids:
                ttft.append(clock - at)
            if not out.finished:
                continue
            assert out.finish_reason == "length", out.error
            generated += len(out.token_ids)
            history[i] += out.token_ids
            turn[i] += 1
            if turn[i] < len(workload.conversations[i].messages):
                think = float(rng.exponential(1 / rate)) if rate else 0.0
                heapq.heappush(arrivals, (clock + think, i))
    after = engine.stats()["prefix_cache"]
    assert len(ttft) == workload.requests
    return RunResult(
        ttft,
        clock,
        generated,
        after["prompt_tokens"] - before["prompt_tokens"],
        after["prompt_tokens_computed"] - before["prompt_tokens_computed"],
    )


def _build(root: Path, shape: ChatShape) -> tuple[Path, dict[str, Path], dict[str, Path]]:
    """The model; each tenant's adapter (ranks 8-32 on q/v or q/k/v/o); and each tenant's
    large adapter for the pressure runs (rank 64 on all seven projections: ~1.5x the KV of
    a 768-token system prompt here, as a rank-64 adapter is 0.8x (Llama-2-7B) to 3.5x
    (Llama-3-8B, GQA) of one there)."""
    model_dir = root / "chat-model"
    write_checkpoint(model_dir, shape.model, seed=5, with_tokenizer=False)
    ranks = np.random.default_rng(5).integers(8, 33, size=shape.tenants).tolist()
    specs = [
        AdapterSpec(f"tenant-{t:02d}-r{rank}", rank, 2.0 * rank, TARGETS[t % 2], 4000 + t)
        for t, rank in enumerate(ranks)
    ]
    large = [
        AdapterSpec(f"tenant-{t:02d}-large", 64, 128.0, ALL_TARGETS, 5000 + t)
        for t in range(shape.tenants)
    ]
    sets = []
    for group in (specs, large):
        sets.append({})
        for spec in group:
            write_adapter(root / spec.name, shape.model, spec)
            sets[-1][spec.name] = root / spec.name
    return model_dir, sets[0], sets[1]


def _engine(model_dir: Path, adapters: dict[str, Path], shape: ChatShape, **cfg) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            scheduler=SchedulerConfig(
                max_num_seqs=shape.max_num_seqs,
                max_num_batched_tokens=2048,
                max_loras_per_batch=shape.max_num_seqs,
            ),
            **cfg,
        )
    )
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.generate([list(range(10, 200))], [params], [next(iter(adapters))])  # warm-up
    engine.reset_prefix_cache()
    return engine


def _pressure_pool_bytes(engine: LLMEngine, shape: ChatShape) -> int:
    """A full batch of requests of mean length, plus half of what every adapter and the
    cache's working set (every tenant's system prompt, every conversation's turns) need."""
    mean = [sum(bounds) / 2 for bounds in (shape.system_tokens, shape.user_tokens)]
    system, user, output = *mean, sum(shape.output_tokens) / 2
    turns = shape.turns
    request = system + (turns + 1) / 2 * user + (turns - 1) / 2 * output
    conversations = shape.tenants * shape.conversations
    working_set = shape.tenants * system + conversations * turns * (user + output)
    pages = [engine.adapters.pages_of(a) for a in engine.adapters.entries]
    bs = engine.kv.block_size
    running = shape.max_num_seqs * math.ceil(request / bs)
    half = (sum(pages) + math.ceil(working_set / bs)) // 2
    # an adapter may take at most half the pool (LLMEngine.read_adapter)
    return max(running + half, 2 * max(pages)) * engine.pool.page_bytes


def run_prefix(root: Path, quick: bool) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(root, QUICK if quick else FULL)
    finally:
        torch.set_num_threads(threads)


def _run(root: Path, shape: ChatShape) -> dict:
    model_dir, adapter_dirs, large_dirs = _build(root, shape)
    names, large = list(adapter_dirs), list(large_dirs)
    pool = 256 * MiB  # every adapter and every cached conversation fit
    log(
        f"prefix: {shape.tenants} tenants x {shape.conversations} conversations x "
        f"{shape.turns} turns, system prompts {shape.system_tokens[0]}-{shape.system_tokens[1]}"
        f" tokens; caching on vs off, {shape.rounds} round(s)"
    )
    engines = {
        "on": _engine(model_dir, adapter_dirs, shape, pool_bytes=pool),
        "off": _engine(
            model_dir, adapter_dirs, shape, pool_bytes=pool, enable_prefix_caching=False
        ),
    }
    small = _pressure_pool_bytes(_engine(model_dir, large_dirs, shape, pool_bytes=pool), shape)
    for key, share in (("unified", None), ("split", SPLIT_SHARE)):
        engines[key] = _engine(
            model_dir, large_dirs, shape, pool_bytes=small, prefix_cache_share=share
        )
    runs: dict[str, dict[str, list[RunResult]]] = {"saturated": {}, "load": {}, "pressure": {}}
    rate = None
    for r in range(shape.rounds):
        workload = ChatWorkload.draw(shape, seed=100 + r)
        pair = ("on", "off") if r % 2 == 0 else ("off", "on")
        for kind in pair:
            engines[kind].reset_prefix_cache()
            result = serve_chat(engines[kind], workload, names, None, seed=r)
            runs["saturated"].setdefault(kind, []).append(result)
        if rate is None:  # the load: a share of what the cache-off engine sustains
            off = runs["saturated"]["off"][0]
            rate = LOAD * len(workload.conversations) / off.makespan_s
        for kind in pair:
            engines[kind].reset_prefix_cache()
            result = serve_chat(engines[kind], workload, names, rate, seed=r)
            runs["load"].setdefault(kind, []).append(result)
        for kind in ("unified", "split") if r % 2 == 0 else ("split", "unified"):
            engines[kind].reset_prefix_cache()
            result = serve_chat(engines[kind], workload, large, rate, seed=r)
            runs["pressure"].setdefault(kind, []).append(result)
        log(f"  round {r + 1}/{shape.rounds} done")
    pressure_stats = {k: engines[k].stats() for k in runs["pressure"]}
    for engine in engines.values():
        engine.close()
    return _figures(shape, runs, rate, small, pressure_stats)


def _pooled(results: list[RunResult]) -> dict:
    ttft = [t for r in results for t in r.ttft_s]
    makespan = sum(r.makespan_s for r in results)
    return {
        "p50_ttft_s": _p(ttft, 50),
        "p99_ttft_s": _p(ttft, 99),
        "generated_tok_per_s": sum(r.generated for r in results) / makespan,
        "makespan_s": makespan,
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "prompt_tokens_computed": sum(r.prompt_tokens_computed for r in results),
    }


def _figures(shape: ChatShape, runs: dict, rate: float, small_pool: int, stats: dict) -> dict:
    sat = {k: _pooled(v) for k, v in runs["saturated"].items()}
    load = {k: _pooled(v) for k, v in runs["load"].items()}
    pressure = {k: _pooled(v) for k, v in runs["pressure"].items()}
    on = load["on"]
    return {
        "prefill_tokens_ratio": on["prompt_tokens_computed"] / on["prompt_tokens"],
        "p50_ttft_ratio": on["p50_ttft_s"] / load["off"]["p50_ttft_s"],
        "throughput_ratio": sat["on"]["generated_tok_per_s"] / sat["off"]["generated_tok_per_s"],
        "unified_vs_split": pressure["unified"]["p99_ttft_s"] / pressure["split"]["p99_ttft_s"],
        "workload": {
            "tenants": shape.tenants,
            "conversations": shape.tenants * shape.conversations,
            "turns": shape.turns,
            "system_tokens": list(shape.system_tokens),
            "user_tokens": list(shape.user_tokens),
            "output_tokens": list(shape.output_tokens),
            "model_parameters": _params(shape.model),
            "rounds": shape.rounds,
            "conversations_per_s": rate,
            "offered_load": LOAD,
        },
        "per_round": [
            {
                "p50_ttft_ratio": _p(load_on.ttft_s, 50) / _p(load_off.ttft_s, 50),
                "throughput_ratio": sat_off.makespan_s / sat_on.makespan_s,
                "unified_vs_split": _p(unified.ttft_s, 99) / _p(split.ttft_s, 99),
            }
            for load_on, load_off, sat_on, sat_off, unified, split in zip(
                runs["load"]["on"],
                runs["load"]["off"],
                runs["saturated"]["on"],
                runs["saturated"]["off"],
                runs["pressure"]["unified"],
                runs["pressure"]["split"],
                strict=True,
            )
        ],
        "saturated": sat,
        "load": load,
        "pressure": {
            "pool_mib": small_pool / MiB,
            "split_share": SPLIT_SHARE,
            **pressure,
            "evictions": {
                k: {
                    "cached_blocks": s["prefix_cache"]["evictions"],
                    "adapters": s["adapters"]["evictions"],
                    "adapter_loads": s["adapters"]["loads"],
                }
                for k, s in stats.items()
            },
        },
    }


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def _params(spec: ModelSpec) -> int:
    per_layer = sum(o * i for o, i in spec.projection_shapes().values())
    return spec.num_hidden_layers * per_layer + 2 * spec.vocab_size * spec.hidden_size


def print_prefix(p: dict) -> None:
    for name, target in (
        ("prefill_tokens_ratio", "<= 0.3"),
        ("p50_ttft_ratio", "<= 0.5"),
        ("throughput_ratio", ">= 1.5"),
        ("unified_vs_split", "(P99 TTFT; < 1: unified better)"),
    ):
        print(f"prefix.{name:25} {p[name]:10.3f}  {target}")
    load, sat = p["load"], p["saturated"]
    print(
        f"  p50 TTFT {load['on']['p50_ttft_s'] * 1e3:.0f} ms on vs {load['off']['p50_ttft_s'] * 1e3:.0f} ms off; "
        f"saturated {sat['on']['generated_tok_per_s']:.0f} vs {sat['off']['generated_tok_per_s']:.0f} tok/s"
    )
