"""Workloads for the simulator: adapters and requests.

The paper's setup (seed 004 §5.1): N adapters, ranks {8, 16, 32, 64, 128} with N/5 each;
a request picks its rank uniformly and an adapter within the rank by a power law; input
and output lengths from the Azure conversation trace (scaled by a constant factor), and
Poisson arrivals at a given rate — or the trace's own timestamps, scaled in time.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

RANKS = (8, 16, 32, 64, 128)


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    name: str
    rank: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class SimRequest:
    rid: int
    arrival: float
    prompt: int
    output: int  # tokens it will generate (the trace's)
    max_tokens: int  # what the client asks for: the predictor's cap
    adapter: str | None


@dataclass(frozen=True, slots=True)
class Trace:
    source: str
    timestamps: np.ndarray  # seconds from the first request
    context: np.ndarray
    generated: np.ndarray


def read_trace(path: Path | None) -> Trace:
    """An Azure LLM inference trace (TIMESTAMP, ContextTokens, GeneratedTokens), any file
    by path. Without one, a stated synthetic stand-in: lognormal lengths fitted to the
    conv trace's published moments (context p50 1020, mean 1155; generated p50 129, mean
    211) and Poisson arrivals at its mean rate of 5.53 / s."""
    if path is not None and path.is_file():
        stamps, ctx, gen = [], [], []
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                stamps.append(_seconds(row["TIMESTAMP"]))
                ctx.append(int(row["ContextTokens"]))
                gen.append(int(row["GeneratedTokens"]))
        t = np.array(stamps)
        return Trace(str(path), t - t.min(), np.array(ctx), np.array(gen))
    rng = np.random.default_rng(0)
    n = 19366
    return Trace(
        "synthetic lognormal (no trace file found; conv-trace moments)",
        np.cumsum(rng.exponential(1 / 5.53, n)),
        rng.lognormal(np.log(1020), 0.55, n).astype(int) + 1,
        rng.lognormal(np.log(129), 0.95, n).astype(int) + 1,
    )


def _seconds(stamp: str) -> float:
    # "2023-11-16 18:15:46.6805900": 7 fractional digits, more than fromisoformat takes
    head, _, frac = stamp.partition(".")
    return datetime.fromisoformat(head).timestamp() + float("0." + (frac or "0"))


def paper_adapters(n: int, adapter_bytes) -> list[AdapterSpec]:
    """n adapters, n/5 of each rank; `adapter_bytes(rank)` sizes them."""
    if n % len(RANKS):
        raise ValueError(f"the number of adapters must be a multiple of {len(RANKS)}, got {n}")
    per = n // len(RANKS)
    return [
        AdapterSpec(f"r{rank}-{i:03d}", rank, adapter_bytes(rank))
        for rank in RANKS
        for i in range(per)
    ]


def pick_adapters(
    adapters: list[AdapterSpec], n: int, rng: np.random.Generator, alpha: float = 1.0
) -> list[str]:
    """Uniform over ranks, power law (Zipf, exponent `alpha`) within a rank."""
    by_rank: dict[int, list[AdapterSpec]] = {}
    for a in adapters:
        by_rank.setdefault(a.rank, []).append(a)
    ranks = sorted(by_rank)
    rank_picks = rng.integers(len(ranks), size=n)
    names = []
    for r in rank_picks:
        group = by_rank[ranks[r]]
        w = 1.0 / np.arange(1, len(group) + 1) ** alpha
        names.append(group[rng.choice(len(group), p=w / w.sum())].name)
    return names


def poisson_requests(
    trace: Trace,
    adapters: list[AdapterSpec],
    rate: float,
    n: int,
    length_scale: float,
    max_tokens: int,
    seed: int = 0,
    offset: int = 0,
    cv: float = 1.0,
) -> list[SimRequest]:
    """n requests arriving at `rate` / s, with the lengths of trace rows offset.. (wrapping),
    scaled by `length_scale` (at least 1 token each). Inter-arrival times are exponential
    (Poisson, cv = 1) or gamma with coefficient of variation `cv` (bursts; the generator of
    S-LoRA's benchmarks/trace.py: shape 1/cv², scale cv²/rate)."""
    rng = np.random.default_rng(seed)
    if cv == 1.0:
        gaps = rng.exponential(1.0 / rate, n)
    else:
        gaps = rng.gamma(1.0 / cv**2, cv**2 / rate, n)
    arrivals = np.cumsum(gaps)
    names = pick_adapters(adapters, n, rng)
    rows = (offset + np.arange(n)) % len(trace.context)
    return [
        _request(i, float(arrivals[i]), trace, int(row), length_scale, max_tokens, names[i])
        for i, row in enumerate(rows)
    ]


def replay_requests(
    trace: Trace,
    adapters: list[AdapterSpec],
    n: int,
    time_scale: float,
    length_scale: float,
    max_tokens: int,
    seed: int = 0,
) -> list[SimRequest]:
    """The trace's first n rows at their own timestamps divided by `time_scale` (2: twice
    the rate)."""
    rng = np.random.default_rng(seed)
    names = pick_adapters(adapters, n, rng)
    return [
        _request(
            i, float(trace.timestamps[i] / time_scale), trace, i, length_scale, max_tokens, names[i]
        )
        for i in range(min(n, len(trace.context)))
    ]


def _request(
    rid: int, arrival: float, trace: Trace, row: int, scale: float, max_tokens: int, adapter: str
) -> SimRequest:
    prompt = max(1, round(int(trace.context[row]) * scale))
    output = min(max(1, round(int(trace.generated[row]) * scale)), max_tokens)
    return SimRequest(rid, arrival, prompt, output, max_tokens, adapter)
