"""The router workloads, shared by `loraplex bench router` (real Ray) and `loraplex bench
fleet` (the simulator): who asks for which adapter when.

    zipf      adapter popularity Zipf(a) over the catalog (a = 1.0), rank independent of size
    hot       one adapter carries `hot_share` (50%) of the requests, the rest Zipf
    shift     Zipf, and at the middle of the run the ranking rotates by half the catalog:
              the popular adapters become unpopular and unpopular ones popular
    failover  zipf; the benches kill a replica a third of the way through

Arrivals: Poisson at the offered rate, or the Azure conversation trace's own timestamps
scaled to that mean rate. Lengths: the trace's (context, generated) rows scaled and capped,
or uniform in a range (the real bench's tiny model on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loraplex.benchmarks.sim.workload import RANKS, AdapterSpec, SimRequest, Trace

WORKLOADS = ("zipf", "hot", "shift", "failover")
KILL_AT_FRACTION = 1 / 3  # failover: of the run's arrival span


@dataclass(frozen=True, slots=True)
class Lengths:
    """Request lengths: the trace's rows (scaled, output capped at max_tokens) when `trace`
    is given, else uniform in the inclusive ranges."""

    trace: Trace | None = None
    scale: float = 1.0
    max_tokens: int = 1024
    prompt: tuple[int, int] = (16, 32)
    output: tuple[int, int] = (8, 16)


def catalog(n: int, adapter_bytes, prefix: str = "a") -> list[AdapterSpec]:
    """n adapters, ranks 8-128 in turn (an equal share of each), `adapter_bytes(rank)` each."""
    ranks = [RANKS[i % len(RANKS)] for i in range(n)]
    return [
        AdapterSpec(f"{prefix}{i:05d}-r{rank}", rank, adapter_bytes(rank))
        for i, rank in enumerate(ranks)
    ]


def requests(
    workload: str,
    names: list[str],
    num: int,
    rate: float,
    lengths: Lengths,
    seed: int = 0,
    arrivals_trace: Trace | None = None,
    zipf_a: float = 1.0,
    hot_share: float = 0.5,
    popularity_seed: int = 0,
) -> list[SimRequest]:
    """`num` requests of the workload at a mean `rate` per second (rid = index). The
    popularity order (which adapter is hot, the Zipf ranks) is drawn from
    `popularity_seed` alone, so streams of other seeds share it."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    rng = np.random.default_rng(seed)
    at = _arrivals(num, rate, rng, arrivals_trace)
    permutation = np.random.default_rng(popularity_seed).permutation(len(names))
    order = [names[i] for i in permutation]  # popularity independent of size
    picks = _zipf_ranks(num, len(order), zipf_a, rng)
    if workload == "hot":
        rest = _zipf_ranks(num, len(order) - 1, zipf_a, rng) + 1
        picks = np.where(rng.random(num) < hot_share, 0, rest)
    adapters = [order[k] for k in picks]
    if workload == "shift":
        rotated = order[len(order) // 2 :] + order[: len(order) // 2]
        middle = num // 2
        adapters = adapters[:middle] + [rotated[k] for k in picks[middle:]]
    prompt, output = _lengths(num, lengths, rng)
    return [
        SimRequest(i, float(at[i]), int(prompt[i]), int(output[i]), lengths.max_tokens, adapters[i])
        for i in range(num)
    ]


def kill_at(reqs: list[SimRequest]) -> float:
    """When the failover workload's replica dies."""
    return reqs[0].arrival + KILL_AT_FRACTION * (reqs[-1].arrival - reqs[0].arrival)


def _zipf_ranks(num: int, n: int, a: float, rng: np.random.Generator) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** a
    return rng.choice(n, size=num, p=weights / weights.sum())


def _arrivals(num: int, rate: float, rng: np.random.Generator, trace: Trace | None) -> np.ndarray:
    if trace is None:
        return np.cumsum(rng.exponential(1.0 / rate, num))
    if num > len(trace.timestamps):
        raise ValueError(f"the trace has {len(trace.timestamps)} arrivals, {num} asked for")
    stamps = trace.timestamps[:num] - trace.timestamps[0]
    own_rate = (num - 1) / stamps[-1] if num > 1 and stamps[-1] > 0 else rate
    return stamps * (own_rate / rate)


def _lengths(num: int, lengths: Lengths, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if lengths.trace is None:
        prompt = rng.integers(lengths.prompt[0], lengths.prompt[1] + 1, num)
        output = rng.integers(lengths.output[0], lengths.output[1] + 1, num)
        return prompt, np.minimum(output, lengths.max_tokens)
    rows = rng.integers(0, len(lengths.trace.context), num)
    prompt = np.maximum(1, np.round(lengths.trace.context[rows] * lengths.scale))
    output = np.maximum(1, np.round(lengths.trace.generated[rows] * lengths.scale))
    return prompt.astype(int), np.minimum(output, lengths.max_tokens).astype(int)
