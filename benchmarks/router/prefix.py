"""`loraplex bench router`'s prefix section: how much of each prompt the replica a router
picks finds in its prefix cache, on issue 16's multi-tenant chat workload.

Workload: `num_tenants` tenants (16), each with its adapter and a system prompt of
512-1,024 tokens, each running `chats_per_tenant` chats of `turns` turns. Chats start at
Poisson arrivals (`chat_rate_per_s`); a turn's prompt is the system prompt, the earlier
turns (the user's tokens and the tokens the model answered) and a new user message; the
next turn is sent when the answer has ended (a user reads it). Greedy, ignore_eos. The
tenants' adapters are registered under one registry tenant (the requests' cache salt is
the same for all), so only the adapter version and the tokens tell the tenants' blocks
apart, as they would for tenants of one cache salt.

The same three routers as `bench router` (router.py), on the same replicas, each with its
engine's prefix cache on (the default); one run each, on a fresh Serve app:

    affinity   AffinityRequestRouter: adapter affinity and prefix affinity in one cost
               (the ingress keys the prompt's first blocks as the replicas do)
    pow2       Serve's power-of-two-choices router
    multiplex  Serve's model multiplexing (adapter placement only)

    router_hit_rate  prompt tokens the chosen replicas found in their prefix caches / prompt
                     tokens sent, over all replicas (each engine's own counters: prompt
                     tokens requested and computed)
    p50_ttft_ms      client side, per router
    hit_rate_ratio_vs_best_baseline = affinity router_hit_rate / max(baselines')

A hit needs the prefix's blocks still cached where the request lands: a router that sends a
tenant's chats to one replica finds the system prompt there from the second chat on, and a
chat's earlier turns from its second turn on; one that spreads them pays the prefill again
on each replica it tries.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from loraplex.benchmarks.report import log
from loraplex.benchmarks.router.apps import build_app
from loraplex.benchmarks.router.assets import TENANT, bench_cluster
from loraplex.benchmarks.router.bench import ROUTERS
from loraplex.benchmarks.router.runs import counters, no_client_gc
from loraplex.benchmarks.router.workload import Workload
from loraplex.replica.protocol import GenerateRequest
from loraplex.router.serve_backend import ServeBackend

TENANTS = 16


@dataclass(frozen=True, slots=True)
class PrefixWorkload:
    base: Workload  # model, replicas, pool sizing and routing-stats period of `bench router`
    num_tenants: int = TENANTS
    chats_per_tenant: int = 3
    turns: int = 3
    system_tokens: tuple[int, int] = (512, 1024)  # inclusive range
    user_tokens: tuple[int, int] = (16, 48)
    output_tokens: tuple[int, int] = (8, 24)
    chat_rate_per_s: float = 3.0
    request_timeout_s: float = 120.0
    seed: int = 0

    def __post_init__(self):
        if self.num_tenants != self.base.num_adapters:
            raise ValueError("one adapter per tenant: base.num_adapters must be num_tenants")
        if min(self.num_tenants, self.chats_per_tenant, self.turns) < 1:
            raise ValueError("num_tenants, chats_per_tenant and turns must be >= 1")

    @property
    def longest_prompt(self) -> int:
        return self.system_tokens[1] + self.turns * (self.user_tokens[1] + self.output_tokens[1])


def workload(base: Workload, quick: bool) -> PrefixWorkload:
    """The section's workload over `bench router`'s model and replicas: one adapter per
    tenant, the pool sized for a full batch of the longest prompts. --quick runs fewer
    chats, each as long."""
    w = PrefixWorkload(base=replace(base, num_adapters=TENANTS, adapters_per_replica=8))
    if quick:
        w = replace(w, chats_per_tenant=1, turns=3)
    total = w.longest_prompt
    return replace(
        w,
        base=replace(
            w.base,
            prompt_tokens=(w.system_tokens[0], total - w.output_tokens[1]),
            output_tokens=w.output_tokens,
            max_num_seqs=8,
        ),
    )


@dataclass(frozen=True, slots=True)
class Chat:
    at_s: float  # the first turn's arrival, from the start of the run
    adapter: str
    system: list[int]
    users: list[list[int]]  # one user message per turn
    outputs: list[int]  # max_tokens per turn


def chats(adapters: list[str], w: PrefixWorkload) -> list[Chat]:
    rng = np.random.default_rng(w.seed)
    vocab = w.base.model.vocab_size
    lo, hi = w.system_tokens
    systems = [rng.integers(10, vocab, int(rng.integers(lo, hi + 1))).tolist() for _ in adapters]
    owners = [t for t in range(len(adapters)) for _ in range(w.chats_per_tenant)]
    order = rng.permutation(len(owners)).tolist()
    arrivals = np.cumsum(rng.exponential(1.0 / w.chat_rate_per_s, len(owners))).tolist()
    out = []
    for at, i in zip(arrivals, order, strict=True):
        tenant = owners[i]
        users = [
            rng.integers(
                10, vocab, int(rng.integers(w.user_tokens[0], w.user_tokens[1] + 1))
            ).tolist()
            for _ in range(w.turns)
        ]
        outputs = rng.integers(w.output_tokens[0], w.output_tokens[1] + 1, w.turns).tolist()
        out.append(Chat(at, adapters[tenant], systems[tenant], users, outputs))
    return out


@dataclass(slots=True)
class TurnOutcome:
    ttft_s: float | None = None
    prompt_tokens: int = 0
    error: str | None = None


async def _chat(
    backend: ServeBackend, chat: Chat, tag: str, start: float, timeout_s: float
) -> list[TurnOutcome]:
    await asyncio.sleep(max(0.0, start + chat.at_s - time.perf_counter()))
    history = list(chat.system)
    outcomes = []
    for turn, (user, max_tokens) in enumerate(zip(chat.users, chat.outputs, strict=True)):
        prompt = history + user
        outcome = TurnOutcome(prompt_tokens=len(prompt))
        request = GenerateRequest(
            request_id=f"{tag}-{turn}",
            prompt_token_ids=prompt,
            adapter=chat.adapter,
            params={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
            tenant=TENANT,
        )
        answer: list[int] = []
        sent = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                async for piece in backend.generate(request):
                    if outcome.ttft_s is None:
                        outcome.ttft_s = time.perf_counter() - sent
                    answer += piece["new_token_ids"]
        except Exception as e:  # counted and reported, never hidden
            outcome.error = repr(e)
        outcomes.append(outcome)
        if outcome.error is not None:
            break
        history = prompt + answer
    return outcomes


async def _drive(backend: ServeBackend, all_chats: list[Chat], router: str, timeout_s: float):
    with no_client_gc():  # its collection before the clock starts (runs.drive)
        start = time.perf_counter()
        results = await asyncio.gather(
            *(_chat(backend, c, f"{router}-{i}", start, timeout_s) for i, c in enumerate(all_chats))
        )
        elapsed = time.perf_counter() - start
    return [o for turns in results for o in turns], elapsed


def _serve(router: str, app, all_chats: list[Chat], w: PrefixWorkload) -> dict[str, Any]:
    from ray import serve

    name = f"bench-prefix-{router}"
    load_avg = os.getloadavg()[0]
    handle = serve.run(app, name=name, route_prefix=None)
    try:
        backend = ServeBackend(handle, retries=0)
        asyncio.run(_warm_up(backend, w))
        outcomes, elapsed = asyncio.run(_drive(backend, all_chats, router, w.request_timeout_s))
        counted = counters(name, router)
        replicas = [{"replica": rid, **c} for rid, c in counted.items() if c is not None]
    finally:
        serve.delete(name)
    done = [o for o in outcomes if o.error is None]
    requested = sum(r.get("prompt_tokens", 0) for r in replicas)
    computed = sum(r.get("prompt_tokens_computed", 0) for r in replicas)
    ttft = np.array([o.ttft_s for o in done], dtype=float) * 1e3
    log(f"prefix {router}: {len(done)}/{len(outcomes)} turns in {elapsed:.1f}s")
    return {
        "router_hit_rate": (requested - computed) / requested if requested else None,
        "prompt_tokens": requested,
        "prompt_tokens_computed": computed,
        "p50_ttft_ms": float(np.percentile(ttft, 50)) if len(ttft) else None,
        "p99_ttft_ms": float(np.percentile(ttft, 99)) if len(ttft) else None,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "errors": sorted({o.error for o in outcomes if o.error is not None})[:5],
        "duration_s": elapsed,
        "load_avg_1m": [load_avg, os.getloadavg()[0]],
        "counters_unread": sum(c is None for c in counted.values()),
        "replicas": replicas,
    }


async def _warm_up(backend: ServeBackend, w: PrefixWorkload) -> None:
    """Base-model requests (no prefix shared with the workload) so every replica ran a
    forward, then a stats period so routers hold every replica's routing stats."""
    params = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}

    async def warm(i: int) -> None:
        prompt = [1 + i % 7] * 8
        request = GenerateRequest(
            request_id=f"prefix-warm-{i}", prompt_token_ids=prompt, adapter=None, params=params
        )
        async for _ in backend.generate(request):
            pass

    await asyncio.gather(*(warm(i) for i in range(4 * w.base.num_replicas)))
    await asyncio.sleep(w.base.routing_stats_period_s * 1.5)


def measure(w: PrefixWorkload, routers: tuple[str, ...] = ROUTERS) -> dict[str, Any]:
    per_router = {}
    with bench_cluster(w.base, "prefix") as cluster:
        all_chats = chats(list(cluster.paths), w)
        for router in routers:
            app = build_app(
                router,
                w.base,
                cluster.engine_config,
                cluster.settings,
                cluster.artifacts,
                cluster.paths,
                cluster.costs,
            )
            per_router[router] = _serve(router, app, all_chats, w)
    rates = {r: f["router_hit_rate"] for r, f in per_router.items()}
    baselines = [rates[b] for b in ("pow2", "multiplex") if rates.get(b) is not None]
    ours = rates.get("affinity")
    workload_fields = asdict(w)
    workload_fields["base"]["model"].pop("rope_scaling", None)
    return {
        "router_hit_rate": rates,
        "p50_ttft_ms": {r: f["p50_ttft_ms"] for r, f in per_router.items()},
        "hit_rate_ratio_vs_best_baseline": (
            ours / max(baselines) if ours is not None and baselines and max(baselines) else None
        ),
        "workload": workload_fields,
        "routers": per_router,
    }


def print_table(results: dict[str, Any]) -> None:
    log("prefix: router_hit_rate (cached prompt tokens / prompt tokens), p50 TTFT ms")
    for router, f in results["routers"].items():
        rate = f["router_hit_rate"]
        shown = "-" if rate is None else f"{rate:.3f}"
        log(f"  {router:10s} {shown:>7s}  {f['p50_ttft_ms']}  (load avg {f['load_avg_1m']})")
    log(f"  affinity / best baseline: {results['hit_rate_ratio_vs_best_baseline']}")
