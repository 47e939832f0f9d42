"""The five systems of Chameleon's experiment (seed 004 §5), as scheduler and cache settings:
the simulator section (benchmarks/sched.py) and the real engine's (sched_engine.py) run
the same ones.

  fifo_nocache       FIFO, adapters leave with their last request (S-LoRA)
  fifo_cache         FIFO + the adapter cache (Chameleon's score)
  sjf                SJF with aging, no cache (S-LoRA + µServe's SJF)
  chameleon_nocache  multi-level queues, no cache
  chameleon          multi-level queues + the adapter cache
"""

from __future__ import annotations

from loraplex.benchmarks.sim_replica import System
from loraplex.replica.config import CacheConfig, ChameleonParams, SchedulerConfig

SYSTEM_NAMES = ("fifo_nocache", "fifo_cache", "sjf", "chameleon_nocache", "chameleon")
SCHED = {"max_num_seqs": 128, "max_num_batched_tokens": 4096, "max_loras_per_batch": 64}


def systems(slo_s: float, sched: dict = SCHED, prefetch: int = 8) -> dict[str, System]:
    nocache = CacheConfig(keep_idle=False, prefetch=prefetch, eviction="lru")
    cache = CacheConfig(keep_idle=True, prefetch=prefetch, eviction="chameleon")
    # T_refresh: 60 s instead of the paper's 5 min, for runs of minutes, not hours.
    mlq = ChameleonParams(refresh_s=60.0, min_samples=64, slo_s=slo_s)
    fifo = SchedulerConfig(policy="fifo", **sched)
    sjf = SchedulerConfig(policy="sjf", **sched)
    cham = SchedulerConfig(policy="chameleon", chameleon=mlq, **sched)
    return {
        "fifo_nocache": System("fifo_nocache", fifo, nocache),
        "fifo_cache": System("fifo_cache", fifo, cache),
        "sjf": System("sjf", sjf, nocache),
        "chameleon_nocache": System("chameleon_nocache", cham, nocache),
        "chameleon": System("chameleon", cham, cache),
    }
