"""Runs a workload through simulated replicas and summarises what they did: loraplex's
engine (benchmarks/sim/replica.py) or S-LoRA's (benchmarks/peers/slora.py), one or N
replicas behind a dispatch policy."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from loraplex.benchmarks.peers.slora import SLoRAReplica
from loraplex.benchmarks.peers.slora_chameleon import ChameleonOnSLoRA
from loraplex.benchmarks.sim.replica import SimReplica, System
from loraplex.benchmarks.sim.workload import AdapterSpec, SimRequest

Replica = SimReplica | SLoRAReplica


def simulate(
    requests: list[SimRequest],
    profile,
    system: System,
    adapters: list[AdapterSpec],
    max_len: int,
    replicas: int = 1,
    dispatch: Callable[[list[Replica], SimRequest], int] | None = None,
) -> Result:
    """Serve `requests` (sorted by arrival) on `replicas` simulated replicas. A request
    goes where `dispatch` says (default: the least loaded replica, preferring one that
    holds its adapter on the device among the least loaded + 2)."""
    dispatch = dispatch or affinity_dispatch
    sims = [_replica(profile, system, adapters, max_len) for _ in range(replicas)]
    for req in requests:
        for sim in sims:
            sim.advance_until(req.arrival)
        sims[dispatch(sims, req) if replicas > 1 else 0].add(req)
    for sim in sims:
        while sim.has_work():
            sim.step()
    return Result.of(system.name, sims, requests)


def _replica(profile, system: System, adapters: list[AdapterSpec], max_len: int) -> Replica:
    if system.slora is not None and system.scheduler.policy == "chameleon":
        params, half_life = system.scheduler.chameleon, system.cache.half_life_s
        keep = system.cache.keep_idle
        return ChameleonOnSLoRA(profile, system.slora, params, adapters, max_len, half_life, keep)
    if system.slora is not None:
        return SLoRAReplica(profile, system.slora, adapters, max_len)
    return SimReplica(profile, system, adapters, max_len)


def affinity_dispatch(sims: list[Replica], req: SimRequest) -> int:
    least = min(s.load for s in sims)
    warm = [
        i
        for i, s in enumerate(sims)
        if req.adapter is not None and s.holds(req.adapter) and s.load <= least + 2
    ]
    if warm:
        return min(warm, key=lambda i: sims[i].load)
    return min(range(len(sims)), key=lambda i: sims[i].load)


@dataclass(slots=True)
class Result:
    system: str
    ttft: np.ndarray
    tbt: np.ndarray  # per request: mean time between its tokens
    e2e: np.ndarray
    queue: np.ndarray  # arrival -> first scheduled
    ranks: np.ndarray
    duration_s: float
    output_tokens: int
    cache: dict = field(default_factory=dict)
    preemptions: int = 0
    steps: int = 0
    link_busy_s: float = 0.0
    bypasses: int = 0
    squashes: int = 0
    peak_memory_fraction: float = 0.0
    arrival: np.ndarray = field(default_factory=lambda: np.zeros(0))
    size: np.ndarray = field(default_factory=lambda: np.zeros(0))  # prompt + output tokens

    @classmethod
    def of(cls, name: str, sims: list[Replica], requests: list[SimRequest]) -> Result:
        done = [r for s in sims for r in s.done]
        assert len(done) == len(requests), "every request must finish (no starvation)"
        done.sort(key=lambda r: r.request.rid)
        arrival = np.array([r.request.arrival for r in done])
        first = np.array([r.first_token for r in done])
        finish = np.array([r.finish for r in done])
        outs = np.array([r.request.output for r in done])
        tbt = np.where(outs > 1, (finish - first) / np.maximum(outs - 1, 1), 0.0)
        rank_of = {}
        for s in sims:
            rank_of.update(s.rank)
        counters = [s.counters() for s in sims]
        cache: dict = {}
        for c in counters:
            for key, value in c.cache.items():
                cache[key] = cache.get(key, 0) + value
        return cls(
            system=name,
            ttft=first - arrival,
            tbt=tbt,
            e2e=finish - arrival,
            queue=np.array([r.admitted for r in done]) - arrival,
            ranks=np.array([rank_of.get(r.request.adapter, 0) for r in done]),
            duration_s=float(finish.max() - arrival.min()),
            output_tokens=int(outs.sum()),
            cache=cache,
            preemptions=sum(c.preemptions for c in counters),
            steps=sum(c.steps for c in counters),
            link_busy_s=sum(c.link_busy_s for c in counters),
            bypasses=sum(c.bypasses for c in counters),
            squashes=sum(c.squashes for c in counters),
            peak_memory_fraction=max(c.peak_memory_fraction for c in counters),
            arrival=arrival,
            size=np.array([r.request.prompt + r.request.output for r in done]),
        )

    def steady_completion(self) -> tuple[float, float]:
        """Completions per second between the arrival of the first quarter's last request
        and the last arrival — under overload, with a backlog throughout, the rate the
        system sustains — and that rate in requests of the run's mix: times the completed
        requests' mean tokens (prompt + output) over the mean of every request's, so a
        policy that finishes small requests first is not credited for their size."""
        n = len(self.arrival)
        order = np.argsort(self.arrival, kind="stable")
        t1, t2 = self.arrival[order[n // 4]], self.arrival[order[-1]]
        finish = self.arrival + self.e2e
        window = (finish >= t1) & (finish < t2)
        if t2 <= t1 or not window.any():
            return math.nan, math.nan
        rate = window.sum() / (t2 - t1)
        return float(rate), float(rate * self.size[window].mean() / self.size.mean())

    def summary(self) -> dict:
        steady, steady_mix = self.steady_completion()
        loads = self.cache.get("loads", 0)
        hits, misses = self.cache.get("hits", 0), self.cache.get("misses", 0)
        return {
            "p50_ttft_s": float(np.percentile(self.ttft, 50)),
            "p99_ttft_s": float(np.percentile(self.ttft, 99)),
            "mean_ttft_s": float(self.ttft.mean()),
            "p50_tbt_s": float(np.percentile(self.tbt, 50)),
            "p99_tbt_s": float(np.percentile(self.tbt, 99)),
            "mean_e2e_s": float(self.e2e.mean()),
            "throughput_rps": len(self.ttft) / self.duration_s,
            "throughput_tok_s": self.output_tokens / self.duration_s,
            "requests": len(self.ttft),
            "preemptions": self.preemptions,
            "bypasses": self.bypasses,
            "squashes": self.squashes,
            "hit_rate": hits / max(hits + misses, 1),
            "loads": loads,
            "gb_loaded": self.cache.get("bytes_loaded", 0) / 1e9,
            "evictions": self.cache.get("evictions", 0),
            "mean_load_ms": 1e3 * self.cache.get("load_seconds", 0.0) / max(loads, 1),
            # S-LoRA's engine (NaN on loraplex's, whose copies run beside the compute):
            # the loads a step waited for (critical path), and the mean wait per load
            "critical_loads": self.cache.get("waited_loads", math.nan),
            "critical_wait_ms": (
                1e3 * self.cache["wait_seconds"] / max(self.cache["waited_loads"], 1)
                if "wait_seconds" in self.cache
                else math.nan
            ),
            "link_busy": self.link_busy_s / self.duration_s if self.duration_s > 0 else math.nan,
            "steady_completion_rps": steady,
            "steady_mix_rps": steady_mix,
        }
