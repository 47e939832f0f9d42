"""The systems `loraplex bench sched` runs side by side on the same arrivals.

On S-LoRA's engine (benchmarks/peers/slora.py: FIFO admission every 10 decode steps with
memory reserved for the whole output, whole-prompt prefill steps apart from decode,
adapters loaded on the critical path and prefetched for the queue head):
  slora              S-LoRA as its code does it: adapters freed when no request uses them
  chameleon          Chameleon as seed 004 built it, on S-LoRA: Chameleon's queues (the
                     policy loraplex runs) and its adapter cache (benchmarks/peers/slora_chameleon.py)
  chameleon_guard    the same with a starvation guard at the SLO (not in the paper: a
                     request that waited the SLO is admitted first, over quota); simulator only
  chameleon_p99      the same with quotas sized for each queue's P99 (not in the paper:
                     M/M/1 minimums for the 99th percentile of time in system, granted
                     largest queue first over the pool); simulator only
  cham_queues_only   seed 004 §5.2.4's breakdown, simulator only: Chameleon's queues on
                     S-LoRA without the cache (adapters leave as S-LoRA's do)
  cham_cache_only    ... and the cache with one queue (FIFO admission, every iteration)
On loraplex's engine (chunked prefill beside decode, admission every step, preemption by
recompute, adapter copies beside the compute, the adapters of the next 8 queued requests
prefetched) — the ablation against our own FIFO:
  fifo_nocache       FIFO, adapters leave with their last request
  fifo_cache         FIFO + the adapter cache (Chameleon's score)
  sjf                SJF with aging, no cache (µServe's SJF)
  chameleon_nocache  Chameleon's queues, no cache
  loraplex           everything on: Chameleon's queues (bypass, squash) and cache,
                     prefetch, copy overlap, the engine's defaults otherwise
  loraplex_guard     the same with its starvation guard at the SLO (`chameleon.starve_s`,
                     an option, not in the paper); engine only, reported apart
"""

from __future__ import annotations

from dataclasses import replace

from loraplex.benchmarks.peers.slora import SLoRAConfig
from loraplex.benchmarks.sim.replica import System
from loraplex.replica.config import CacheConfig, ChameleonParams, SchedulerConfig

SYSTEM_NAMES = (
    "slora",
    "fifo_nocache",
    "fifo_cache",
    "sjf",
    "chameleon_nocache",
    "chameleon",
    "loraplex",
)
GUARDED = "chameleon_guard"
ENGINE_GUARDED = "loraplex_guard"
ENGINE_SYSTEMS = (*SYSTEM_NAMES, ENGINE_GUARDED)
TAIL = "chameleon_p99"
TAIL_PERCENTILE = 0.99
BREAKDOWN = ("cham_queues_only", "cham_cache_only")
SIM_SYSTEMS = (*SYSTEM_NAMES, GUARDED, TAIL, *BREAKDOWN)
SCHED = {"max_num_seqs": 128, "max_num_batched_tokens": 4096, "max_loras_per_batch": 64}
# S-LoRA's flags: the pool is the device's (max_total_token_num = its slots), prompts up
# to the model's context, prefetching on (seed 004 §5.1: "asynchronous adapter
# prefetching"); the rest are S-LoRA's defaults.
SLORA = SLoRAConfig(max_req_total_len=4096, prefetch=True)
# Chameleon's first clustering (ChameleonParams.min_samples) after this share of a run's
# arrivals: seed 004 gives no warm-up (it clusters "recent request data" every
# T_refresh), and a fixed count is a different share of runs of 80 and 1200 requests (64
# arrivals left an 80-request engine run FIFO until its last 16).
WARMUP_SHARE = 1 / 20
WARMUP_PER_QUEUE = 4  # and at least this many arrivals per queue it may form (k_max)


def warmup_arrivals(run_requests: int, k_max: int = ChameleonParams().k_max) -> int:
    """Arrivals Chameleon sees before it first clusters, in a run of `run_requests`."""
    return max(WARMUP_PER_QUEUE * k_max, int(run_requests * WARMUP_SHARE))


def systems(
    slo_s: float,
    sched: dict = SCHED,
    prefetch: int = 8,
    slora: SLoRAConfig = SLORA,
    run_requests: int = 1200,
    chameleon_slora: SLoRAConfig | None = None,
) -> dict[str, System]:
    """Every system, with Chameleon's quotas sized for `slo_s` and its warm-up for runs of
    `run_requests` arrivals; `sched` caps loraplex's batches, `slora` is S-LoRA's server
    configuration, `chameleon_slora` that of Chameleon on S-LoRA (default: the same)."""
    on_slora = chameleon_slora or slora
    nocache = CacheConfig(keep_idle=False, prefetch=prefetch, eviction="lru")
    cache = CacheConfig(keep_idle=True, prefetch=prefetch, eviction="chameleon")
    # T_refresh: 60 s instead of the paper's 5 min, for runs of minutes, not hours.
    warmup = warmup_arrivals(run_requests)
    mlq = ChameleonParams(refresh_s=60.0, min_samples=warmup, slo_s=slo_s)
    fifo = SchedulerConfig(policy="fifo", **sched)
    sjf = SchedulerConfig(policy="sjf", **sched)
    cham = SchedulerConfig(policy="chameleon", chameleon=mlq, **sched)
    return {
        # the cache settings are what S-LoRA's rules need when the real engine runs them
        # (benchmarks/peers/slora_engine.py); the simulator's S-LoRA keeps its own books
        "slora": System(
            "slora",
            SchedulerConfig(),
            CacheConfig(keep_idle=False, prefetch=4096, eviction="lru"),
            slora=slora,
        ),
        "fifo_nocache": System("fifo_nocache", fifo, nocache),
        "fifo_cache": System("fifo_cache", fifo, cache),
        "sjf": System("sjf", sjf, nocache),
        "chameleon_nocache": System("chameleon_nocache", cham, nocache),
        # prefetch: S-LoRA's, as much of the queue head as fits (sim_slora.py)
        "chameleon": System(
            "chameleon",
            cham,
            CacheConfig(keep_idle=True, prefetch=4096, eviction="chameleon"),
            slora=on_slora,
        ),
        "loraplex": System("loraplex", cham, cache),
        ENGINE_GUARDED: System(
            ENGINE_GUARDED, replace(cham, chameleon=replace(mlq, starve_s=slo_s)), cache
        ),
        "cham_queues_only": System(
            "cham_queues_only",
            cham,
            CacheConfig(keep_idle=False, prefetch=4096, eviction="lru"),
            slora=on_slora,
        ),
        "cham_cache_only": System(
            "cham_cache_only",
            replace(cham, chameleon=replace(mlq, k_max=1)),
            CacheConfig(keep_idle=True, prefetch=4096, eviction="chameleon"),
            slora=on_slora,
        ),
        GUARDED: System(
            GUARDED,
            replace(cham, chameleon=replace(mlq, starve_s=slo_s)),
            CacheConfig(keep_idle=True, prefetch=4096, eviction="chameleon"),
            slora=on_slora,
        ),
        TAIL: System(
            TAIL,
            replace(cham, chameleon=replace(mlq, quota_percentile=TAIL_PERCENTILE)),
            CacheConfig(keep_idle=True, prefetch=4096, eviction="chameleon"),
            slora=on_slora,
        ),
    }
