"""The router bench's shared types: the workload, one request of it, and what became of it
(benchmarks/router.py drives them; router_apps, router_costs and router_figures read them)."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.demo.synthetic import ModelSpec


@dataclass(frozen=True, slots=True)
class Workload:
    model: ModelSpec
    num_adapters: int
    num_replicas: int
    adapters_per_replica: int  # device-pool capacity (adapters of mean size); multiplex K
    num_requests: int
    rate_per_s: float
    zipf_a: float = 1.1
    prompt_tokens: tuple[int, int] = (16, 32)  # inclusive range
    output_tokens: tuple[int, int] = (8, 16)
    ranks: tuple[int, int] = (8, 64)
    max_num_seqs: int = 16
    routing_stats_period_s: float = 1.0
    request_timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.adapters_per_replica < self.num_adapters:
            raise ValueError(
                f"adapters_per_replica must be in [1, num_adapters): more adapters than fit on "
                f"one replica, got {self.adapters_per_replica} of {self.num_adapters}"
            )
        if not (self.num_requests > 0 and self.rate_per_s > 0 and self.num_replicas > 0):
            raise ValueError("num_requests, rate_per_s and num_replicas must be > 0")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    at_s: float  # arrival, from the start of the run
    adapter: str
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Outcome:
    ttft_s: float | None = None
    latency_s: float | None = None
    tokens: int = 0
    error: str | None = None
