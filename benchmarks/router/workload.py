"""The router bench's workload shape (benchmarks/router/bench.py drives it; router_apps,
router_assets, router_costs and router_figures read it). Requests and their outcomes are in
router_runs.py."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any

from loraplex.demo.synthetic import ModelSpec


@dataclass(frozen=True, slots=True)
class Workload:
    model: ModelSpec
    num_adapters: int
    num_replicas: int
    adapters_per_replica: int  # device pool: adapters of mean size beside a full batch's KV
    host_adapters_per_replica: int  # host tier (sync) and max_num_models_per_replica
    window_s: float  # one run's arrivals span this long
    failover_window_s: float
    rate_factors: tuple[float, ...]  # x the nominal capacity
    reference_factor: float  # one of rate_factors: loads, load seconds
    failover_factors: tuple[float, ...]
    read_bandwidth_mib_s: float = 8.0
    read_latency_ms: float = 50.0
    prompt_tokens: tuple[int, int] = (16, 32)  # inclusive range
    output_tokens: tuple[int, int] = (8, 16)
    max_num_seqs: int = 16
    routing_stats_period_s: float = 1.0
    request_timeout_s: float = 120.0
    seed: int = 0
    repeats: int = 3  # the whole comparison again, fresh apps, the router order rotated
    # LoRA capacity bursts per router, the order rotated; its capacity is their median
    capacity_bursts: int = 3
    burst_batches: int = 10  # a saturating burst: this many full batches per replica
    min_requests: int = 0  # a run's arrivals span at least this many requests
    # run one at a time past the grid, in order, while some router's p99 still held the SLO
    # at the highest rate run (bench.py `_sweep`): a goodput at the grid's top is a floor
    extra_rate_factors: tuple[float, ...] = ()
    # the fleet validation's calibration: base-model requests at the reference rate through
    # each router's app before the repetitions (bench.py `_loaded_path`), as many as this
    # many runs hold (one run's 320 put its p99 on 3 requests); 0, as the bench has it: none
    loaded_path_runs: int = 0

    @property
    def all_rate_factors(self) -> tuple[float, ...]:
        """The grid and the rates past it that a sweep may run."""
        return self.rate_factors + self.extra_rate_factors

    def run_requests(self, rate: float, window_s: float) -> int:
        """Requests in one run at `rate`: its window's, and at least `min_requests`."""
        return max(1, self.min_requests, round(rate * window_s))

    @property
    def burst_requests(self) -> int:
        """A saturating burst's requests: `burst_batches` full batches per replica."""
        return self.burst_batches * self.num_replicas * self.max_num_seqs

    @property
    def aggregate_host_adapters(self) -> int:
        """What the fleet's host tiers hold together, in adapters of mean size."""
        return self.num_replicas * self.host_adapters_per_replica

    def check_routing_regime(self) -> None:
        """The router comparison's shape is the regime routing exists for: a catalog larger
        than one replica's host tier that fits the fleet's. (Other sections over the same
        replicas, e.g. the prefix one's 16 tenants, need not be.)"""
        if not self.host_adapters_per_replica < self.num_adapters <= self.aggregate_host_adapters:
            raise ValueError(
                "the catalog must be larger than one replica's host tier and fit the fleet's "
                "(the regime routing exists for: what one replica cannot hold, another does), "
                f"got {self.num_adapters} adapters over {self.num_replicas} host tiers of "
                f"{self.host_adapters_per_replica}"
            )

    def __post_init__(self):
        if not 1 <= self.adapters_per_replica < self.num_adapters:
            raise ValueError(
                f"adapters_per_replica must be in [1, num_adapters): more adapters than fit on "
                f"one replica, got {self.adapters_per_replica} of {self.num_adapters}"
            )
        if self.reference_factor not in self.rate_factors:
            raise ValueError("reference_factor must be one of rate_factors")
        grid = self.all_rate_factors
        if any(b <= a for a, b in pairwise(grid)):
            raise ValueError(f"rate factors must ascend, extra ones past the grid: {grid}")
        if (
            self.num_replicas < 1
            or self.window_s <= 0
            or min(self.repeats, self.capacity_bursts) < 1
            or self.loaded_path_runs < 0
        ):
            raise ValueError(
                "num_replicas, window_s, repeats and capacity_bursts must be > 0, "
                "loaded_path_runs >= 0"
            )

    @staticmethod
    def rotated(routers: tuple[str, ...], k: int) -> tuple[str, ...]:
        """The routers' order in round k: each runs first, second, ... once per len rounds."""
        k %= len(routers)
        return routers[k:] + routers[:k]


def workload_dict(w: Workload) -> dict[str, Any]:
    """The workload as the bench's JSON shows it."""
    out = asdict(w)
    out["model"] = {k: v for k, v in out["model"].items() if k != "rope_scaling"}
    out["aggregate_host_adapters"] = w.aggregate_host_adapters
    return out
