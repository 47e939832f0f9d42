"""`loraplex bench report`: docs/performance.md, generated from the committed bench JSON.

Each bench written with `--json docs/bench/<suite>.json` carries its figures and how it ran
(`run`: date, command, load average before and after, cores; `report.write_json` adds it).
The page is the headline table first (figure, value, target, met, what it is measured
against, which run), then one short method section per bench, then the figures that have no
target, and nothing else: history lives in git. `tests/test_bench_report.py` fails while the
committed page differs from what the committed JSON renders.
"""

from __future__ import annotations

import argparse
import json
import math
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.benchmarks.goodput import ratio_at_ceiling

SUITES = ("engine", "registry", "sched", "router", "fleet", "fleet_validation", "autoscale")
_OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt}


@dataclass(frozen=True)
class Headline:
    suite: str
    key: str  # dotted path into the suite's JSON
    target: str  # "<op> <number>"
    against: str  # the anchor: the peer, paper or bound the figure is measured against
    # the key is a list (one figure per arrival draw) and the target holds for every one:
    # the figure is the worst of them
    every: bool = False

    def figure(self, value: Any) -> Any:
        """The value the target is read from: the key's, or its worst draw's."""
        if not self.every or not isinstance(value, list) or not value:
            return value
        return max(value) if self.target.startswith("<") else min(value)

    def met(self, value: Any) -> bool | None:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return None
        op, number = self.target.split()
        return _OPS[op](value, float(number))


HEADLINES = [
    # engine (issue 24): the synthetic 101M model and the real SmolLM2-135M-Instruct
    Headline("engine", "speedup_vs_peft", ">= 4", "transformers + peft generate, mixed-adapter static batches"),
    Headline("engine", "lora_overhead", "<= 0.15", "a base-only batch's decode step in the same engine (8 adapters r16 q/k/v/o)"),
    Headline("engine", "lora_overhead_heavy_vs_bound", "<= 1.5", "adapter weight bytes / base weight bytes"),
    Headline("engine", "gemm_efficiency", ">= 0.6", "the step's base GEMMs alone"),
    Headline("engine", "real.speedup_vs_peft", ">= 3", "transformers + peft on SmolLM2-135M; a second run of the same tree: 3.97; the runs before on 2026-12-07: 3.44, 3.51, 3.63, 3.63 (every loop), 3.02 (LoRA's loops only; see engine below)"),
    Headline("engine", "real.lora_overhead", "<= 0.10", "SmolLM2's base-only batch in the same engine"),
    Headline("engine", "real.lora_overhead_heavy_vs_bound", "<= 1.0", "adapter weight bytes / base weight bytes"),
    Headline("engine", "real.gemm_efficiency", ">= 0.75", "SmolLM2's base GEMMs alone; a second run of the same tree: 0.800; before one call a decode layer, on 2026-12-07: 0.745, 0.747, 0.744, 0.690 (see engine below)"),
    Headline("engine", "detok.per_token_cost_ratio", "<= 1.5", "per-token output cost at 20 tokens"),
    Headline("engine", "tp.lora_comm_ratio", "<= 0.05", "the base model's collective bytes"),
    Headline("engine", "prefix.p50_ttft_ratio", "<= 0.5", "the same engine with prefix caching off"),
    # registry
    Headline("registry", "register_per_s", ">= 500", "a real etcd on loopback, fsync on"),
    Headline("registry", "propagation_p99_ms", "<= 50", "commit to event at 8 watchers"),
    Headline("registry", "restart_resync_s", "<= 2", "a new watcher's full snapshot"),
    # sched (issue 23): seed 004's experiment against S-LoRA as S-LoRA's code does it
    Headline("sched", "vs_slora.p99_ttft_reduction_high_load", ">= 0.6", "Chameleon paper: 0.807"),
    Headline("sched", "vs_slora.p50_ttft_reduction_high_load", ">= 0.36", "Chameleon paper: 0.481"),
    Headline("sched", "vs_slora.throughput_at_slo_ratio", ">= 1.125", "Chameleon paper: 1.5"),
    Headline("sched", "loraplex_vs_slora.p99_ttft_reduction_high_load", ">= 0.8", "S-LoRA's scheduler and cache"),
    Headline("sched", "loraplex_vs_slora.throughput_at_slo_ratio", ">= 1.5", "S-LoRA's scheduler and cache"),
    Headline("sched", "engine.p99_ttft_reduction_per_draw", "> 0", "loraplex's own FIFO, real engine, FIFO's high load (the starvation guard's draws: docs/scheduling.md)", every=True),
    # router (issue 22): real Ray, against Ray Serve's own routers; medians over repetitions,
    # ci_low the 90% bootstrap interval's lower end
    Headline("router", "workloads.zipf.goodput_ratio_vs_best_ray_router_ci_low", ">= 1.0", "the better of power of two and multiplexing"),
    Headline("router", "workloads.hot.goodput_ratio_vs_best_ray_router_ci_low", ">= 1.0", "the better of power of two and multiplexing"),
    Headline("router", "workloads.shift.goodput_ratio_vs_best_ray_router_ci_low", ">= 1.0", "the better of power of two and multiplexing"),
    Headline("router", "workloads.failover.goodput_ratio_vs_best_ray_router_ci_low", ">= 1.0", "the better of power of two and multiplexing"),
    Headline("router", "workloads.zipf.goodput_ratio_vs_best_ray_router", ">= 1.2", "the better of power of two and multiplexing (median)"),
    Headline("router", "workloads.shift.goodput_ratio_vs_best_ray_router", ">= 1.2", "the better of power of two and multiplexing (median)"),
    Headline("router", "workloads.zipf.reads_ratio_vs_multiplex", "<= 0.7", "Ray Serve multiplexing's store reads"),
    Headline("router", "workloads.failover.recovery_s.affinity", "<= 30", "a replica killed a third into the run"),
    Headline("router", "fairness.b_p99_ttft_ratio", "<= 1.5", "tenant B's p99 TTFT alone; 2026-12-06: 2.92, 2.50; three runs of 2026-12-05: 2.97, 2.85, 4.02"),
    Headline("router", "fairness.b_p99_ttft_ratio_haproxy", "<= 1.5", "tenant B's p99 TTFT alone, both behind HAProxy (http.ingress_proxy: haproxy); 2026-12-06: 2.18, 2.46; three runs of 2026-12-05: 1.37, 1.71, 1.85 (see router below)"),
    # fleet (issue 22): the simulator at 16 x H100 / 7B; medians over seeds
    Headline("fleet", "fleet.workloads.zipf.goodput_ratio_vs_best_ray_router", ">= 1.5", "Ray Serve's routers, modelled from source"),
    Headline("fleet", "fleet.workloads.shift.goodput_ratio_vs_best_ray_router", ">= 1.5", "Ray Serve's routers, modelled from source"),
    Headline("fleet", "fleet.workloads.zipf.replicas_needed_ratio_vs_best_ray_router", "<= 0.7", "the replicas the better Ray router needs for the SLO"),
    Headline("fleet", "fleet.workloads.shift.replicas_needed_ratio_vs_best_ray_router", "<= 0.7", "the replicas the better Ray router needs for the SLO"),
    Headline("fleet", "fleet.workloads.zipf.placement_miss_rate.affinity", "<= 0.05", "placements the router predicted warm that read from the store"),
    Headline("fleet_validation", "fleet.validation.p99_ttft_error", "<= 0.25", "the means of real repetitions of the same workload"),
    Headline("fleet_validation", "fleet.validation.loads_error", "<= 0.10", "the means of real repetitions of the same workload"),
    # autoscale (issue 26): a simulated day under Ray Serve's autoscaler (bench fleet --section autoscale)
    Headline("autoscale", "autoscale.replica_hours_ratio_vs_ray_default", "<= 0.8", "Ray's default policy, target_ongoing_requests swept to its best"),
    Headline("autoscale", "autoscale.slo_attainment.lora", ">= 0.99", "requests within the SLO (5 x the unloaded TTFT)"),
    Headline("autoscale", "autoscale.slo_attainment_vs_ray_default", ">= 0", "Ray's default policy at its best setting"),
    Headline("autoscale", "autoscale.replica_hours_ratio_vs_static", "<= 0.6", "a static fleet sized for the peak"),
    Headline("autoscale", "autoscale.requests_lost", "<= 0", "every scale-down of every policy"),
    Headline("autoscale", "autoscale.steady.scale_events_per_hour.lora", "<= 6", "changes of Serve's target count at a steady load (the day's mean rate), after its first 10 min"),
]  # fmt: skip

METHODS = {
    "engine": """\
`loraplex bench engine` (`benchmarks/engine/bench.py`). A Llama-shaped model of 101M parameters
(hidden 768, 12 layers, GQA 12/4) with random weights (`--quick`: 26M), and the real demo
model SmolLM2-135M-Instruct. `speedup_vs_peft`: the same requests (lengths from the Azure
conv trace, adapters drawn Zipf-like from 32 of ranks 8–64) through loraplex's continuous
batching and through transformers + peft `generate` in mixed-adapter static batches,
alternating rounds, median of the per-round ratios; the first greedy tokens are checked
equal. `lora_overhead`: a decode step of batch 32 with 8 adapters of rank 16 on q/k/v/o ÷
a base-only batch's in the same engine, interleaved rounds, fastest of each. The base model's GEMMs run on weights
reordered once for oneDNN (`kernels/dense.py`); `dense_gemm_step_ratio` is that base step ÷
the same step on F.linear, and `gemm_efficiency` times the GEMMs alone on the engine's own
weights. `tp.*`: tp = 2 over gloo beside
tp = 1, bytes rank 0 sends. `prefix.*`: 16 tenants with long system prompts, caching on ÷
off on the same arrivals. Under `--quick` each tenant holds the full run's two
conversations of three turns with shorter prompts (system prompts of 128-256 tokens), in
one round: `prefix.p50_ttft_ratio` 0.371/0.331/0.362 by round of the published run (0.319/0.335/0.297 in that of 10:40). Until
2026-12-06 the quick shape held one conversation of two turns, so every first turn, half
the requests, met its system prompt cold (the cache is reset before each run): half the
requests could not hit by construction, `prefill_tokens_ratio` could not fall below 0.5
(0.530), and the median TTFT fell where hits meet misses (0.56-0.75). The section's full
shape (two conversations of three turns a tenant, prompts of 512-1,024 tokens), run alone
on 2026-12-06 (164 s, load 0.5-1.5), read `p50_ttft_ratio` 0.142, `prefill_tokens_ratio`
0.218, `throughput_ratio` 2.26 and `unified_vs_split` 0.848. `detok.*`: the output path's time per token at 2,000 ÷ at 20
output tokens.

The published run (2026-12-07 15:40-15:50, the machine alone, load 1.1 before, 1.5 after)
is the first whose decode steps make one call a layer for RoPE, the KV write and attention
(`DecodeLayers`: attention_cpu.c's `decode_layer`, from the layer's fused qkv rows, where
the forward pass made three calls) and keep the norms' and SwiGLU's outputs while their
shape repeats (`ForwardOps`). What that acts on: on this host the first torch op after one
of SmolLM2's GEMMs takes ~16 us where it takes ~1 (even a `view`; on one thread or two,
after MKL's GEMM as after oneDNN's): the GEMM has streamed megabytes of weights through the
caches, and the op's code and data come back from memory. Every Python wrapper, allocation
and ctypes call between two GEMMs paid for it: the norms' section read 3.3 ms a step where
their loop ran 0.9. Alternating in one engine (32 pairs of four steps, ABBA, load ~1), the
step took 5.5 ms less (87.9 against 93.1 ms; 30 pairs of 32 faster); the layer call alone
3.0 ms, the kept outputs 1.6. `real.gemm_efficiency` reads 0.808 (0.808/0.785/0.810), met
with room; a second run of the same tree right after it (15:51-16:03, load 0.5 before, 1.5
after) read 0.800 (0.812/0.800/0.796): of the six rounds the least is 0.785, the median 0.804. The base step took 72.9-76.7 ms against 59.0-62.0 for its GEMMs alone;
one round's sections (77.5 ms): GEMMs 60.7, the layer call 9.7 (attention, RoPE and the KV
write), norms 2.0, SwiGLU 1.5, the rest 3.7. The synthetic `gemm_efficiency` reads 0.677
(0.677/0.665/0.697), `real.speedup_vs_peft` 3.66 (3.58/3.66/3.75; the second run 3.97), `speedup_vs_peft` 5.68
(5.72/5.68/5.68; 5.62), `real.lora_overhead` 0.076 (0.085/0.060/0.076), `lora_overhead` 0.093
(0.077/0.126/0.093), the heavy steps 0.44 and 0.37 of their bounds, `detok` 1.16: every
target of the section is met. What is left beside the GEMMs is mostly the layer call's
attention, which is memory (below).

The run of 2026-12-07 13:32-13:45 (the machine alone, load 0.7 before, 1.5 after)
was the fourth whose decode steps run the rest of the step in compiled loops too
(kernels/native.py, one library): decode attention reads every key and value where the pool
keeps them (attention_cpu.c: no gathered copy, one call a layer where the torch path ran a
gather and ~6 ops), and the step's small ops are one pass each (small_ops_cpu.c: RMSNorm
with the residual add before it, RoPE in place, the KV write, SwiGLU's product and greedy
sampling's argmax, where torch ran two to six ops each over a few tens of kilobytes).
Alternating in one engine (12:38, load 1.1-1.5, contexts growing 64 -> 140), SmolLM2's base
step took 84.3 ms with every loop against 104.0 with none, 88.9 with the attention alone
and 92.6 with the small ops alone; the sections of a step (timed around each call, whichever
path) read attention 13.3 ms against 28.1, norms 3.1 against 6.9, RoPE 0.9 against 2.8, the
KV write 0.9 against 1.9. `real.gemm_efficiency` read 0.745 (0.741/0.745/0.762): missed by
a hair. The three runs before it read 0.747 (0.767/0.747/0.741; 13:17, before the loops
shared one exp and the attention took its group size at run time, measured no slower),
0.744 (0.744/0.740/0.772; 13:00, before a base step's no-op LoRA calls were dropped, ~1 ms)
and 0.690 (0.690/0.654/0.780; 12:43, before the argmax and the small ops' second thread):
of the nine rounds since the argmax, three reach 0.75, the median 0.745. The synthetic
`gemm_efficiency` read 0.651 (0.656/0.645/0.651; the runs before 0.664, 0.645 and 0.625):
met. What is left beside the GEMMs (one round's sections, 86.7 ms: GEMMs 63.9, attention
9.7, norms 3.5, RoPE 0.8, KV write 1.0, SwiGLU 1.9, the rest 6.0; cProfile over ten steps:
Python in the forward pass ~3 ms, the step's batch 0.8, sampling 0.3) is mostly attention,
and it is memory: with a bfloat16 cache, half the bytes, the base step takes 0.93
(0.93/0.94/0.93) of the float32 one's time in this run, where before the loop it took
1.0 (`real.kv_cache_bf16_step_ratio`), and the loop reads ~110 MB of keys and values a step
at ~11 GB/s where a stream reads 22. Prefetching the next work item's first tile and
prefetching all kv heads' rows at once (tried, 13:05-13:15) did not move it. The GEMMs
themselves ran slower in most runs of the afternoon than in the morning's (54-76 ms alone
against 52-53), and the ratio moved less than either. `real.speedup_vs_peft` read 3.44
(3.44/3.28/3.77; 3.51, 3.63 and 3.63 in the runs before), the synthetic `speedup_vs_peft`
5.36 (5.66/5.36/5.13; 5.07, 5.33 and 5.00), both targets met with room. The base step
being shorter, LoRA's relative overheads read higher against the same LoRA work:
`lora_overhead` 0.097 (0.089/0.122/0.097; 0.099 at 13:17), `real.lora_overhead` 0.082
(0.078/0.101/0.082), the heavy steps 0.37 and 0.40 of their bounds.

The run of 2026-12-07 10:40-10:52 (the machine alone, load 0.6 before, 1.5 after)
was the first whose decode steps run LoRA in compiled loops on this CPU (`kernels: native`,
`auto` where a C compiler builds them: kernels/lora_cpu.c and lora_native.py), one call per
layer and group reading every adapter's rows in place through the Triton kernels' row
tables. The torch ops had paid ~10-13 us of dispatch for each small matmul, one per
adapter, row-chunk and target: ~18,500 of them in the synthetic serving round's 26 steps
of more than 16 rows (0.24 s of a 1.33 s round), and the masked rows and kept gathers
below had only bounded that. `real.speedup_vs_peft` reads 3.02 (3.08/3.01/3.02), the
synthetic `speedup_vs_peft` 4.42 (4.42/4.50/4.35): both targets met at the median. Two
runs before it on the way there (10:12, the loops alone; 10:27, with a running batch's
tables kept) read 3.04 (2.95/3.05/3.04) and 2.89 (2.89/3.11/2.71) on the real model, 4.33
and 4.48 on the synthetic one: over the nine real rounds the median is 3.02 and three read
under 3, so the real target is met at its edge, not with room. Our real serving round
took 1.39-1.84 s (its first in each process 1.74-1.84), PEFT's 4.3-4.6; in harness runs
alternating processes of each backend (10:10-10:27, load 0.5-1.4, the same tokens) the
round took 1.24-1.32 s against 1.32-1.38 with the torch ops (real), 1.05-1.16 against
1.20-1.33 (synthetic). The heavy step (32 adapters of ranks 8-64 on all projections, one
token each), read in place one op per row-chunk before, costs 0.36 of its weight bound
(0.38/0.35/0.36) against 0.66; the light one (8 adapters of rank 16, 4 tokens each, whose
rows the torch ops had gathered and kept) 0.071 (0.062/0.071/0.072), level with them within
this figure's spread (in a harness the light step took 92.8-94.2 ms in the loops against
92.1-93.1 with those groups on the torch ops). Under tensor parallelism h is all-reduced:
the second run sent h as wide as the step's widest group for every group
(`tp.lora_comm_ratio` 0.1125); it is each group's own width now (0.0375, as before; the
heavy batch 0.258 against the torch ops' 0.199, whose rank buckets pad less). A prefill's
long runs (more than 16 tokens an adapter) stay on the torch ops, where one BLAS product
beats the loops. `real.gemm_efficiency` 0.607 and the synthetic 0.522 stay under their
targets: the loops shortened LoRA, not the step's other parts (below).

The run of 2026-12-07 02:04-02:17 (the machine alone, load 1.1 before, 1.4 after) was the
first with two changes. First, LoRA's overheads compare a LoRA batch with a base
batch in the same engine (`base_and_lora_steps`: the scheduler's running list swapped
before each step); until then they compared two engines, and identical engines step at
different speeds here: five base engines of the real model, built one after another in one
process and stepped in turn, read the first built 3-4% slower than the four after it, and
with one engine built and dropped first (the bench does so now) two identical ones still
read 0.99-1.15x each other (`base_step_engine_spread`: 1.03-1.08 on the real model in this
run). That is the size of the figure: the morning's run (01:02, the tree before) read
`real.lora_overhead` -0.03/-0.08/0.02 by round, its base engine (built first) slower than
the LoRA one. Every earlier published `real.lora_overhead` (0.082 at 22:35 on 2026-12-06,
and those below) compared a base engine built first, so it read low by about that
penalty. Measured in one engine it reads 0.057/0.181/0.089 (median 0.089, within 0.10;
three light engines in a harness beforehand: 0.069-0.136, median 0.082), the heavy batch
0.71/0.60/0.66 of its bound. Second, groups read in place keep their set's rows once the set
has repeated four steps and run a small step as one masked product (kernels/lora_gathered.py
`MaskedPlan`): the real serving set (6 adapters of mixed targets, 16 tokens) had read every
group in place, ~900 ops a step. In one process, alternating and rotated, its serving round
took 1.750 s against 1.934 with no masked rows, the synthetic one 1.624 against 1.746.
`real.speedup_vs_peft` reads 2.85 (2.86/2.85/2.77), under its 3 target; the synthetic
`speedup_vs_peft` 3.60 (3.59/3.57/3.75), under 4. The host ran slower all day than on
2026-12-06's evening, and us more than PEFT: the real base step 100-111 ms against 81-88,
PEFT's real serving round 5.0-6.2 s against 4.3-4.7, ours 1.7-2.5 against 1.5-2.0; the
synthetic `speedup_vs_peft` read 3.59, 3.64 and 3.62 in three runs today before this one
(01:02 on the tree before both changes, 01:20 and 01:38) against 3.996 at 22:35. Processes
of yesterday's tree (550e95b) and today's, alternating, served the synthetic workload in
1.40-1.45 and 1.39-1.50 s a round: the fall is the host's, within what these figures can
resolve. What is left of our serving round beside PEFT's is the base GEMMs: 52% of it
(0.98 of 1.89 s in a profiled round), LoRA 16% (0.30 s; 0.33 before the masked
rows), the norms 5%. `real.gemm_efficiency` reads 0.594 (0.597/0.594/0.577) against 0.605
and 0.650 in earlier runs. Earlier runs, before the one-engine overheads: the run of
2026-12-06 22:35 read `real.lora_overhead` 0.107/0.082/0.063, that of 18:38
0.111/0.108/0.171, 16:32 0.082/0.109/0.064, 07:09 0.089/0.097/0.109, each a base engine
built first against a LoRA one built after it.
The real model's GEMMs alone take 52-57 ms of those steps: 0.75 would need every other part
of the step (attention, norms, RoPE, sampling, Python) in 17-19 ms, where the KV gather
alone reads ~5 MB a layer from memory the weights have just evicted (11 ms a step, ~13
GB/s; timed in the step, 07:05). What was tried against it (no gather, whole-page
gathers, huge pages, fewer tensors a layer) is below; reading half the KV bytes
(`engine.kv_cache_dtype: bfloat16`, since 2026-12-06) was tried last and does not move
the step either: `real.kv_cache_bf16_step_ratio` (the base step with a bfloat16 cache ÷
the float32 one, in the same interleaved rounds) 1.021 in this run, 0.994/0.996/1.012
(median 0.996) in the run of 18:38, 1.018/1.006/0.963 in that of 16:32, and 1.023/0.984/0.981 on the synthetic model.

How the engine's figures got here. Runs before 2026-12-05 timed every step after the adapter
copy thread had run a parallel copy, which left it an OpenMP team of its own for the
process's life: past one OpenMP thread per CPU, GNU OpenMP barely spins before its threads
sleep, and the steps' small batched matmuls ran 2.6-5x slower (replica/cpu_threads.py).
`real.lora_overhead` read 0.19-0.23 on 2026-12-04 23:16 (three rounds) and 0.01-0.17 after
the fix (six rounds in two runs, 23:57 and 00:09). A quick round timed 6 steps of each kind,
which moved one round's overhead by ~0.05; since 2026-12-05 it times 16 (full: 24), and the
contexts grow by as many tokens (64 -> ~82 on the real model, `--quick`). `step_sections_ms`
splits the base step's wall time by the forward pass's calls
(`benchmarks/engine/sections.py`), timed around each call, not with torch.profiler, which
reads the KV gather at 470 us where it takes 190 us. On SmolLM2 at batch 32 the GEMMs take
52-58 ms of the step, at ~90% of these two cores' FMA peak (8.6 GFLOP a step, ~172 GFLOP/s),
so `real.gemm_efficiency` is set by what else the step does. Since 2026-12-05 the engine's
thread flushes denormal floats before its first op, and so its OpenMP team
(`replica/cpu_threads.py` `flush_denormals`; the bench does it on its own thread, for peft
too): a softmax over a sharp row leaves many probabilities under float32's smallest normal
(11% at SmolLM2's shapes and 130 tokens in a microbenchmark), and the exps and products
that reach them took the CPU's slow path (softmax 30 -> 16 us, the product with V 142-191
-> 100 us).
`real.gemm_efficiency` went 0.560/0.564/0.575 -> 0.662/0.655/0.665 (rounds of the runs of
01:34 and 05:54, both alone), the base step 88-90 -> 77-80 ms. The slow path grows with
the context (longer rows hold more tiny probabilities), so it may be part of the attention
that ran twice as slow past ~100 tokens in some processes of earlier runs, but not all of
it: attention still took 26.4 ms in the first round, 16.5-17.7 in the others, 60% of it
the gather of every cached key and value, read scattered across pages at ~17 GB/s; the
norms, RoPE, KV writes and the rest of the step (sampling, scheduling, residual adds) take
10-15 ms. Measured on 2026-12-05 (09:22, the machine alone): not gathering does not help.
A dense K/V buffer per layer kept across steps, which the matmuls read in place (each step
copying only the new position's rows), took 13.2-16.7 ms of attention a step against
13.0-18.5 for the gather (three runs each, context 64 -> 112, equal outputs): the matmuls
reading cold K/V cost what the gather and the matmuls on its copy did (on data in cache the
layer's gather, scores, softmax and product with V take 60, 73, 13 and 54 us). Gathering
whole 12 KB pages instead of rows, and huge pages for torch's large tensors, were slower
(attention 27-34 ms against 15-21; the gather 13-20 ms against 7-11). The small ops run
2-3x slower in the step than on data in cache (rms_norm 51-66 us against 25, RoPE 60-71
against 35-40): each new tensor is written to memory the step's 538 MB of weights have just
pushed out of the caches; writing four fewer a layer (torch's rms_norm, SwiGLU and RoPE in
place) did not move the step above its noise in five A/B pairs. Reading fewer KV bytes
does not move it either: beside the bench's ratio above, a longer run (2026-12-06
16:13-16:19, the machine alone, load 1.4-1.8; each its own process, rotated three times;
32 requests, 100 decode steps from one-sentence prompts, median step) of a bfloat16 cache
(`engine.kv_cache_dtype`) gathered and widened to float32 took 93.9/98.1/98.5 ms a step
against 84.9/91.3/96.1 for float32, and the same
cache attended in bfloat16 matmuls (an experiment, not kept: scores rounded to 8 bits of
mantissa) 91.4/91.4/82.9. In a microbenchmark of one layer's gather (SmolLM2's decode
rows at 165 tokens, from a cold 384 MB pool) the bfloat16 rows took 0.72-0.76 ms against
1.12-1.16 and widening them 0.33-0.36 ms: the bytes saved are paid back in the widening,
and matmuls in bfloat16 save too little of the rest to show. The option stays
for what it does give, twice the KV tokens a pool holds (at worst 0.30 of a logit from
the oracle on the real model, 767 of 768 greedy tokens the oracle's). The faster base step raises
`real.lora_overhead`: LoRA's 7.2-9.7 ms over base steps of 77-80 ms is 0.092/0.104/0.125
(median 0.104, over the 0.10 target), where the same milliseconds over 88-90 ms read
0.089 before. The synthetic model's `gemm_efficiency` read 0.561/0.467/0.455 against
0.538/0.537/0.422 before: its 18 ms step moves that much between the rounds of one run.
Two runs of 2026-12-06 on the tree with fd61682's decode rows (05:17, beside light work at
nice 19; 05:32, the machine alone, load 0.1 -> 1.7, the committed one) read
`real.lora_overhead` 0.095/0.119/0.136 and 0.075/0.099/0.121 by round: medians 0.119 and
0.099, the six rounds' 0.110, so the committed median meets the 0.10 target and a run
does not hold it. In both runs the first round's base step was the fastest (84.8 and 79.6
ms) and the later rounds' attention took 26-29 ms against 17-20 in the first, while the
GEMMs stayed level (52.6-52.9 ms a step in the second run): `real.gemm_efficiency` read
0.656/0.582/0.603 and 0.663/0.574/0.569. Three runs of one round each, each its own
process (06:22-06:32, the machine alone, load 0.9-1.6), read `real.gemm_efficiency`
0.656/0.659/0.658 on base steps of 80.5-83.0 ms (`real.lora_overhead` 0.099/0.093/0.128):
what slows the later rounds is left in the process by the rounds before, not the
machine's drift, so `--repeat`'s rounds after the first understate the real model's GEMM
share. What it is was not found: a process that built the engine three times, changing
its thread count between (as the tp section does), kept its attention at 18-24 ms, and
one that ran the peft comparison between varied as much as one that did not.""",
    "registry": """\
`loraplex bench registry` (`benchmarks/registry/bench.py`): a real etcd on loopback with fsync on;
registrations with 8 in flight, the time from a registration's commit to its event at each
of 8 watchers, and a new watcher's full snapshot of 10,000 adapters.""",
    "sched": """\
`loraplex bench sched` (`benchmarks/sched/bench.py`): seed 004's experiment (Chameleon) in
the simulator, on the real scheduler, adapter cache and queue math of `replica/`, against
S-LoRA modelled from its source (`benchmarks/peers/slora.py` cites the functions), on
arrivals from the Azure conv trace with adapters of ranks 8–128. S-LoRA is calibrated to the
paper's baseline by its own default token pool (`--max_total_token_num 6000`,
`slora/server/api_server.py`) with the paper's length rule applied to it: SLO 4.9–5.1 s,
S-LoRA's capacity ~10 req/s, its crossing in 1,200-request runs 9.3–10.8 req/s (the paper's
8.6). Loads are stated as load ÷ S-LoRA's capacity; reductions are 1 − the system's P99
(P50) TTFT ÷ S-LoRA's at the high load; throughput at the SLO is each system's sustainable capacity (its
steady completion rate under overload); the sweep runs each system past it (0.7, 0.8, …
x its capacity until its P99 TTFT crosses the SLO in every seed, at most 1.5x), and
`crossing_over_capacity` is each finite-run crossing ÷ capacity. `reduction_curves` (and
`*.p99_ttft_reduction_max`, beside the headline keys) give the P99 reduction against S-LoRA
over the grid and the paper's loads, each as load ÷ each system's own capacity. The
paper's high load is 9/8.6 of S-LoRA's capacity and 9/12.9 of Chameleon's (§5.2.2); the
headline matches S-LoRA's fraction, and `*_own_capacity_load` keys, beside it, compare
each system at 9/12.9 of its own capacity (`*_slora_capacity_50/70_load`: 0.5 and 0.7 of
S-LoRA's), each with its `*_load_over_capacity` and `*_load_over_slora_capacity`. Chameleon
runs as the paper has it: no starvation guard (reported apart as `chameleon_guard`), quotas
scaled in proportion to the M/M/1 minimums when these exceed the pool, every queue tried
every iteration. `chameleon_p99` is a departure reported apart: minimums sized for each
queue's M/M/1 P99 (ln 100/SLO for 1/SLO), granted largest queue first over the pool.
The engine section replays the same arrivals through
the real engine with a CPU cost profile; Chameleon on S-LoRA there admits every iteration,
with bypass, squash and prefetch, as in the simulator. Its target is loraplex's Chameleon
(as the paper has it: no starvation guard) ahead of loraplex's own FIFO on P99 TTFT at
FIFO's high load in every arrival draw, so the table shows the worst draw's reduction with
each draw's beside it; the pooled key (`engine_p99_ttft_reduction`) can be carried by one
draw. Why it is missed (FIFO without S-LoRA's reservation has no head-of-line blocking to
remove, and its tail is near the best any order reaches for these bounded sizes) and what
the guard (`chameleon.starve_s`, an option) does: docs/scheduling.md.""",
    "router": """\
`loraplex bench router` (`benchmarks/router/bench.py`): a real local Ray and etcd, three Serve apps
side by side — the affinity router, Ray Serve's power of two and Ray Serve multiplexing —
each of 3 replicas of a tiny Llama on the shared cores, 300 adapters (`--quick` 120) of ranks
8–128 read from a store paced like a network one; fresh apps for every workload. Serve's
`max_ongoing_requests` is Ray Serve LLM's default (1e9) for all three: requests queue in
the engines, as behind Ray Serve LLM and behind loraplex's own default (runs before
2026-12-03 capped it at 2 × the batch, which held most of a burst in the handle). Each replica's
host tier holds the catalog over all replicas but one (150 adapters of mean size, `--quick`
60): the catalog is 2 × one host tier and 2/3 of the fleet's, the regime routing exists for,
where a store read is what a router pays for sending an adapter where it is not held, and
the catalog still fits with failover's killed replica gone. Poisson arrivals at fractions
of the LoRA workload's measured capacity (a saturating burst of zipf's own requests through
each router; the best router's, the same rates for all); goodput is the highest offered
rate whose p99 TTFT meets the SLO (5 × the unloaded TTFT), a miss that the next rate's run
holds being a stall left out, not a crossing (each repetition's p99s per rate are kept, as
`p99_ttft_s_by_rate`); `goodput_ratio_vs_best_ray_router`
divides affinity's by the better Ray router's. The whole comparison is repeated (3 times, `--quick` too: a full rotation) on other seeds with the
router order rotated; figures are medians, each ratio with its 90% bootstrap interval
(`_ci_low`, `_ci_high`). Past the grid's top (1.3 × the basis) the sweep goes on, at 1.7,
2.2 and 2.9 ×, while any router still holds the SLO; a rate's figures are the medians of
the repetitions that ran it (`repetitions_per_rate`). Where the routers compared all hold
the SLO at the sweep's top rate even so (`held_slo_at_top_rate`), each goodput is that rate
and the ratio is 1 by that ceiling, not a tie the sweep found. Store reads are counted at
the reference rate (0.5 × the basis, `--quick` 0.35), against their floor (`reads_floor`: the adapters
that run asks for that neither its warm-up nor an earlier run did, each read once by some
replica whatever the router; the warm-up asks for every adapter of the catalog once, so the
floor is 0 and every read counted is a re-read, a router sending an adapter where it is no
longer held); where multiplexing reads no more than the floor, `reads_ratio_vs_multiplex`
cannot go below 1, and the table says so beside the miss. Fairness: tenant A holds 64 streams of 256 tokens open (8× the
replica's batch), tenant B's p99 TTFT ÷ B alone, in alternating windows (3 rounds of 10 s,
`--quick` 5 of 6 s: 95 and 85 of B's requests a window kind; a quiet window starts once the
replica has drained the flood), with its 90% bootstrap interval over B's requests;
`b_p50_ttft_ratio` beside it, and A's chunks a second, what the relay carried. Behind
Serve's proxy actor (the default), then on a second Ray behind HAProxy
(`http.ingress_proxy: haproxy`, `_haproxy` keys): the same app, the same schedules. Runs
before 2026-12-04 21:00 started the client's clock before its garbage collection (~0.25 s
in the driver), which every request due during it counted as TTFT: the first 4-6 requests
of every run, which made the p99 of the routers that read nothing (0.15-0.27 s where the
replicas took ~0.01-0.06). The published run is the tree of 2026-12-07 (04:17-05:08, the
machine alone: load 0.5 before, 0.8 after, 3.5-7.2 during, three apps of three replicas on
two cores), the first whose affinity router gives an adapter its homes by Little's law on
the time a request holds a slot on a saturated replica (below), on a basis of 71.9 req/s
(multiplexing's LoRA capacity; affinity's 68.3, power of two's 60.6). Zipf read 1.00 [0.72,
1.22] (its repetitions 0.72, 1.00, 1.22; in the first, affinity's p99 read 0.65 s at 0.7
× and 1.19 s at 0.85 ×, where 24 of its requests went to replicas that read the adapter,
spills past a store read's imbalance as below), hot 1.17 [1.00, 1.42] (1.00, 1.42,
1.17; affinity's p99 at 0.85 × 0.14, 0.81 and 0.19 s against multiplexing's 0.43, 2.01 and
0.40), shift 1.10 [1.02, 1.21] (1.02, 1.21, 1.10), failover 1.00. Hot's and shift's
intervals hold at or above 1, as in the run of 2026-12-04 22:30 and in neither of
2026-12-06's; zipf's does not, and its median is level. The run before (2026-12-06 18:49-19:43, the machine alone: load 1.4
before, 1.1 after, 4-7 during), the first on the grid with 0.85 and 1.15 × the basis (77.1
req/s, multiplexing's LoRA capacity; affinity's 70.3, power of two's 66.6), read zipf 1.03 [1.01, 1.17] (its
repetitions 1.01, 1.17, 1.03), shift 1.03 [0.99, 1.09] (1.09, 1.03, 0.99), hot 0.98 [0.81,
1.09] (1.09, 0.81, 0.98; hot's better Ray router is power of two, which spreads the hot
adapter, where multiplexing's p99 passed 1.4 s at 0.85 × in every repetition), failover
1.00 (every router held the SLO at its one rate). On zipf and shift affinity's goodput is
level with the better Ray router's, within a few percent, in every repetition; hot's
second repetition gave 0.81 because affinity's p99 at 0.7 × read 1.00 s, then 0.95 at
0.85 ×, where power of two's read 0.38. The run of 09:44-10:28 (load 0.0 before, 1.5
after, on the grid of 0.35, 0.7, 1.0 and 1.3 × the basis) read zipf 1.03 [0.54, 1.04]
(its first repetition 0.54: affinity's runs at 0.7 and 1.0 × read 16 and 20 adapters from
the store, requests sent where the adapter was no longer held, each ~0.12 s on top of the
queue), hot 1.28 [1.00, 1.66], shift 1.03 [0.96, 1.39]; one router's p99 at one rate
moved between repetitions by up to 10 × there (multiplexing on zipf at 1.0 ×: 0.38, 4.19
and 2.33 s). The run of 2026-12-04 22:30, on the tree before the engine's denormal flush
and torch's rms_norm (which every router's replicas run), read zipf 1.03 [0.72, 1.07], hot
1.08 [1.05, 1.64], shift 1.20 [1.09, 1.26]. Across the three runs affinity is level with
the better Ray router on zipf and shift, the workloads it reads on, and no interval of
hot's holds above 1 in all of them: the routers serve the same capacity here (below).

Why hot's second repetition read 0.81 on 2026-12-06: the hot adapter (half the requests)
kept its homes only while requests queued on them. Its homes were Little's law on its rate
with `request_time_s`, the time a request holds a batch slot measured on an idle engine
(48 ms), or the requests its holders report, whichever needs more; on two cores a saturated
replica finished 25-35 requests a second in its 16 slots, 0.46-0.65 s a slot, so the rate
asked for a tenth of the homes the adapter needed, and the homes its queue gave drained it
and were withdrawn. The router now takes the hold from the replicas' measured drain (a
saturated replica's slots over the requests it finished a second while full; the idle
`request_time_s` until one has been seen, router/policy.py). Measured on real Ray
(2026-12-07 03:59-04:06, the hot workload alone through one affinity app of the quick
shape, 0.7, 0.85, 1.0 and 1.15 × 77.1 req/s, three runs of each rule alternating, the
machine alone, load 0.7-6.2): once the first saturated stats had arrived (26-29 s into a
run, at 0.85 ×), the old rule changed the adapter's homes 3 times a run and routed 12-22%
of its requests with fewer than three; the new one changed them 0, 1 and 0 times (0-4%).
Affinity's p99 at 1.15 × read 1.27, 1.40 and 0.78 s under the old rule against 0.82, 0.77
and 0.26 under the new one; at 1.0 × 0.95, 0.57 and 0.60 against 0.73, 1.03 and 0.56 (the
SLO 0.74 s); below 0.85 × no drain is measured and the rule is the old one. In the
simulator the rule moves nothing that matters: the replay of the run of 2026-12-06 under
both rules in one process moved affinity's p99s by at most 0.05 s on zipf, hot and shift,
and the fleet section (H100 / 7B) gave every figure of its published run to the digit.

Tried after it and not kept (2026-12-07 06:37-06:59): the hold by Little's law at any load
(each replica's slots held, its queue up to its slots, over the requests it finished, both
halved every 32 finished), not only once a replica is seen saturated. Zipf's hottest home
at 0.85 x had held 25-33 requests in 16 slots priced at 0.07-0.1 s (no replica yet seen
saturated in two stats running, so the idle 47 ms hold), and they waited 0.53-0.59 s.
Zipf alone through one affinity app, the quick shape at 0.7, 0.85, 1.0 and 1.15 x 71.9
req/s, two arrival draws, each rule three times a draw, alternating (old, new, new, old,
old, new), the machine alone (load 0.9-5.2): affinity's p99 at 1.0 x read 1.55, 0.78,
0.73, 0.51, 0.46 and 0.67 s under the old rule against 0.95, 0.86, 1.29, 0.78, 0.39 and
0.62 under the new (the SLO 0.75 s: held in 4 runs against 2), at 1.15 x 1.84, 1.21, 1.36,
0.71, 0.62 and 1.15 against 1.04, 0.93, 1.35, 1.72, 1.11 and 1.79; store reads at 1.0 x
3-16 against 3-20. Its estimates were nearer what requests got (a warm home's queued
requests, queue at or past its slots: got / estimated 1.52 at 0.85 x and 1.36 at 1.0 x
against 2.45 and 1.56), and the tail did not follow. What neither rule's wait holds is
the step a request with a free slot waits on: such requests got a first token in 36-81 ms
(medians by rate) where the estimate said 7-17 (busy_cost_s, measured per decode row,
0.1 ms), the same on every replica, so it moves no ranking; the slowest requests at 1.0
and 1.15 x were on replicas all at or past their slots (19-35 held in 16), where no
placement is fast: the capacity that bounds every router here.

Where affinity's reads come from (2026-12-06 12:54-13:06 and 13:07-13:18, zipf alone,
affinity against multiplexing, the quick shape, three repetitions each, the machine alone:
load 0.1-1.0 before, 4-8 during). The router now counts each request by the affinity it
judged the chosen replica and the tier that replica held the adapter in (`placements` per
rate; `loraplex_router_placements_total` on /metrics). At 0.35 and 0.7 × the basis (71.4
and 75.9 req/s those runs, 58.4 in the published one) one of affinity's 4,395 requests went
where its adapter had to be read (a hot adapter's extra home). At 1.0 and 1.3 × 22-38 a
run did, all but 1-4 of them spills of adapters judged cold (14-31 a run) or crowded (2-11)
to a replica that held them nowhere: at those rates the replicas' estimated waits differ
by more than one store read (0.125 s; the p50 was 0.3-3.2 s), and a request goes to the
least estimated TTFT, read included (`cold_walk_reads` 0, the default), as designed: past
that imbalance a replica that must read the adapter wins. Multiplexing read none. The
spills do not unbalance the work (each replica's engine-busy seconds at 1.3 ×, medians,
most to least: affinity 9.7 / 9.6 / 9.2, multiplexing 9.1 / 8.5 / 8.0), but each copy they
bring evicts another from a full host tier and pool: affinity made 311-436 device loads a
run at 1.3 × against multiplexing's 221-314 (241-304 against 219-241 at 1.0 ×). Goodput
ratio (each repetition's, their median and 90% interval): 0.95 [0.94, 0.95] in the first
run (0.95, 0.95, 0.94), 1.17 [0.99, 1.24] in the second (0.99, 1.17, 1.24); one router's
p99 at 1.0 × ranged 0.88-3.5 s over the six repetitions. With three
apps on the machine (two A/B runs, 14:07-14:33, the third app a variant of affinity)
affinity spilled at 0.7 × as well, 7-15 reads in three of six repetitions, as in the
published run (basis 58.4 req/s): the spills start wherever the queues grow past a read.
The variant was told a read costs two (the read, and the copy it displaces from a full host
tier, read again later): at 1.0-1.3 × it sent 11-20 requests a run to read (36 once in
twelve) where affinity sent 21-34, and made fewer device loads at 1.3 × in each of the six
repetitions (282-415 against 286-425); its goodput over affinity's, repetition by repetition, was 1.46, 1.15, 0.99, 0.74,
1.37 and 1.06: within the noise, so it was not adopted (a factor of 2 is the upper bound:
the displaced copy is often held on another replica). What the spill rule does not price is what a read costs beyond
itself: the copy it evicts from a full host tier and pool, read or loaded again later.

Two remedies for that copy, tried in the simulator first (2026-12-06 18:15-18:20, nice 19;
`bench router`'s published run replayed as `fleet.validation` replays it, one process and
one measured profile per comparison, 8 seeds, zipf and shift, reads and within-SLO share
per rate). Neither is built. (1) Keeping homes' copies in the host tier and dropping spill
copies first (issue 22's build item 4): with the bench's host tier (60 adapters a replica)
affinity's host tiers never fill in the replay (0 copies dropped at 1.0-2.0 x the basis,
where it read 0-36 adapters a run), so the order of drops cannot matter there. With the
host tier at two thirds (40 a replica: the catalog equal to the fleet's tiers), where they
fill (1-55 dropped a run), an oracle that drops first the copies another replica holds
read 17 / 21 / 59 and 1 / 4 / 46 adapters at 0.7 / 1.0 / 1.3 x on two seeds against 19 / 24
/ 57 and 1 / 3 / 41 for recency: the reads that matter are the spills themselves, not the
copies they displace. Dropping by decayed use count instead of recency read more for power
of two (with the bench's tier, 213 against 156 at 1.3 x on one seed) and no fewer for affinity. (2) Pricing a store read
as 1.5 or 2 reads (the read and the copy it displaces): reads fell by a quarter to two
fifths (zipf at 1.3 x: 177 over 8 seeds, 145 at 1.5, 117 at 2; shift 166 / 135 / 110) but
the share within the SLO did not rise (zipf 0.845 / 0.807 / 0.816, shift 0.984 / 0.967 /
0.972; at 1.0 x all 0.998-0.999; with 40 adapters a host tier zipf 0.842 / 0.828 / 0.836).
Two processes, one per pricing, had shown a gain of 2-4 points at 1.3 x: each measures its
own CPU profile, and that difference was the profiles', not the pricing's.

What the real path adds to affinity's decisions (2026-12-06 18:31-18:36, the machine alone:
load 0.2 before, 2.7-6.7 during; a harness logging every routing decision of the affinity
app on the quick shape, zipf, affinity and multiplexing, rates 0.7 / 1.0 / 1.3 x a basis of
69.6 req/s, two repetitions). The router's estimate of a request's TTFT against what it got:
at 0.7 x the request waited 26-39 ms more than estimated at the median (the path from the
client to the replica and back, which the estimate leaves out), at 1.0 x 50-69 ms (90th
percentile 184-268 ms), at 1.3 x 23-47 ms with a spread of -0.49 to +0.57 s (10th to 90th
percentile; correlation 0.84-0.95). Requests sent to read from the store were 17 and 1 of
557 at 1.0 x (p50 TTFT 0.32 s against 0.14 s on the device) and 23 and 31 of 724 at 1.3 x;
the late ones at 1.3 x (487 and 429 of 724) were late in every placement alike: past the
basis both routers run out of capacity, not affinity out of warm replicas. The two routers
serve zipf's own requests at the same capacity: the saturating bursts read 77.9 / 56.9 /
54.0 req/s for affinity and 79.8 / 63.7 / 69.6 for multiplexing in that run, 79.8 / 68.7 /
70.1 and 66.8 / 65.0 / 72.0 in the run before it (18:22-18:27), 72.3 / 58.4 / 50.8 and
57.1 / 63.3 / 55.8 in the published one: medians 68.7 and 65.0 over the nine each. On
these cores the engine's steps are the bottleneck and multiplexing reads nothing after the
warm-up, so neither router has capacity to gain over the other; the goodput ratio is
decided by whose tail parts first near the basis, and there affinity held the SLO at 1.0 x
in three of those four repetitions (p99 0.51, 0.54, 0.42 s; 1.07 s) and multiplexing in two
(0.39, 0.51 s; 1.52, 1.60 s): the grid has had one rate between 0.7 and 1.3 x, so since
2026-12-06 it has two more (0.85 and 1.15).

Where tenant B's time goes under the flood behind Serve's proxy (2026-12-05, the protected
app alone on the machine, load 0.5-2.4; a timestamp at every hop in every process, the third
of three such runs): alone, B's median 25.5 ms is 6.1 from the client to the ingress's app
(Serve's proxy), 3.3 in the app until its call to the replica (0.5 ms of it is the app's own
code, measured in process), 2.9 to the replica, 5.2 in the engine (the next step admits,
prefills, yields), 3.0 back to the ingress and 3.5 through the proxy to the client; under
the flood the same hops take 8.6 / 6.5 / 7.1 / 11.3 / 2.5 / 3.2 ms at the median and 50 / 37
/ 25 / 41 / 10 / 37 at the p99 (132 ms). Every hop is slower and none dominates: the
engine's step loop keeps one of the two cores busy with A's 8 running streams (0.83 cores),
and B's hops share the other with the relay of A's chunks (Serve's proxy 0.19, the ingress
0.30), the client (0.13) and Ray's daemons. Not the cause, each measured: garbage collection
(14 of 85 of B's flood requests overlapped a collection, mostly 2-20 ms ones; without them
the p99 is still 79 ms against 40 alone), the interpreter's switch interval (0.5 ms: pooled
p99 ratio 2.99 against 2.82), the engine thread at nice 10 (3.75: B's own prefill runs
there). Halving the relay's messages (`engine.stream_events_per_s_per_stream` 10 instead of
20; A's chunks 87-92/s against 153-158, proxy + ingress 0.37 cores against 0.48; three runs
each, alternating) moved B's p99 ratio over the 255 requests of each setting from 2.80 to
2.53, its p95 from 2.55 to 2.17 and its median from 1.64 to 1.40: the direction the relay
predicts, too little for the bound, and every stream's text would come in coarser steps, so
the default stays. Of the ingress's up to 1.9 ms a chunk under the flood (0.30 cores, ~157
chunks a second) its own code is ~10 us (formatting the event, metrics; measured in process
over a stand-in backend: 2.4 ms for a request of 200 chunks, the client included): the rest
is Serve's streaming over Ray, the replica's stream in and the response's messages out to
the proxy actor. HAProxy takes the proxy actor's relay off that core (0.01-0.03) and halves
the tail, but does not hold the bound run after run: in three runs alternating with Serve's
proxy (12:00-12:11, the machine alone, load 0.4-2.4) B's p99 ratio behind HAProxy was 1.37,
1.71 and 1.85 (pooled over 255 of B's requests 1.79, median 1.38) against 2.97, 2.85 and
4.02 behind Serve's proxy (pooled 3.86, median 1.68). The run of 2026-12-04 read 1.44 behind
HAProxy and 2.25 behind Serve's proxy; that of 2026-12-06 19:36 (the bench's own fairness
section) 2.18 [2.06, 2.40] behind HAProxy and 2.92 [2.27, 3.51] behind Serve's proxy,
medians 1.24 and 1.60 (the run of 10:20: 2.46 [1.56, 3.08] and 2.50 [1.91, 3.65], medians
1.44 and 1.86); the published one (2026-12-07 05:02) 1.62 [1.41, 1.81] and 3.09 [1.99,
3.38], medians 1.16 and 1.40. Giving the
engine a core of its own makes B's tail worse, not better (the
engine's thread pinned to core 0 and every other thread of the run's processes to core 1;
2026-12-05 21:37-21:46, three runs each, alternating, load 1.7-3.2): B's p99 ratio behind
Serve's proxy 5.25, 5.46 and 4.45 pinned against 2.94, 3.26 and 2.61 not. Pinned, the
engine ran 0.91 cores against 0.48-0.52 and finished 47-53 of A's streams a round against
22-28, each followed by a new request of A's through the proxy and the ingress: those two
used 0.42-0.44 cores against 0.31-0.34, on the core that B's hops (and the replica's own
event loop, pinned there too) share. B waits behind the relay, which a faster engine only
loads more. Of the three runs not pinned, only the first (2.94) had both cores: the
harness's pinning also reached the session's first process, from which every later
process inherited core 1 alone (found 2026-12-06), so the second and third (3.26, 2.61)
ran everything, engine included, on one core; the comparison rests on the first and on
the same day's runs above (2.97, 2.85, 4.02). Cutting the flood's chunks to a third, not a
half, does no better: with each stream at 5 chunks a second (as a budget of ~40 a
second for a tenant's 8 running streams would give them; B's first chunk is never held) A's
chunks fell from 154-159 to 54-56 a second and the proxy and ingress from 0.47-0.51 cores to
0.31-0.32, yet B's p99 under the flood was 96-101 ms against 94-109 at 20 a second (ratios
2.77, 2.70, 2.68 against 2.45, 3.07, 2.01; pooled over 255 of B's requests each, flood p99
101 ms against 107, median 37 against 38; 2026-12-06 07:56-08:05, alternating and rotated,
the protected app alone on the machine, load 0.1-3.3). The cores the relay gave back went
to the engine, which finished 253-267 of A's streams a run against 175-216, each followed
by a new request of A's: the relay's chunks are not what holds B's tail, so a per-tenant
chunk budget is not built. Freezing the replica's and the ingress's start-up objects out
of the cyclic garbage collector's way once started (`gc.freeze`, as vLLM's and SGLang's servers do) was tried
on 2026-12-07 and not kept: in the fairness section alone (the protected app, quick
shape, behind Serve's proxy then HAProxy; six runs of each tree in two sets of three,
alternating, 07:20-07:39 and 08:09-08:28, the machine alone, load 0.1-1.7) B's p99 under
the flood through Serve's proxy read 89.6, 96.7, 92.7, 119.4, 113.4 and 115.2 ms with it
against 109.5, 108.8, 93.7, 120.1, 102.8 and 105.4 without (medians 105 and 107; B's p99
ratio 2.57-3.17 against 2.66-3.41), behind HAProxy 45.3-71.7 ms against 47.4-60.9
(medians 47 and 51.5): the first set's gain did not come back in the second, and the
collector's pauses are not what holds B's tail. Nor is the GIL of the replica's process
or the engine's share of the cores (2026-12-07 21:26-21:44, the protected app behind
Serve's proxy, quick shape, alternating, the machine alone, load 0.4-3.7): with the
replica's switch interval at 0.5 ms (Python's default 5 ms: its event loop waits that long
for the engine thread's GIL at worst) B's p99 under the flood read 128, 118 and 117 ms
(ratios 3.26, 2.86, 2.62), with the engine thread at nice 19 127, 104 and 119 ms (2.74,
2.90, 2.72), against 88-129 ms (2.50-3.28, median 2.83) in six runs at the defaults. The
flood keeps 1.45 of the two cores busy (replica 0.8, ingress 0.33, proxy 0.2, client 0.13),
so B's hops find a core free, and in one process, without Ray, the engine under A's 64
streams delays B's first output by only 2-4 ms (p50 5.2-6.9 ms against 3.7-5.1, p99
11.2-13.4 against 8.8-9.8; switch interval 0.5 ms the same): what is left of B's wait
lies, by elimination, in the relay's processes and Ray's streaming between them. Timed hop
by hop (a harness run of each path, the same day 21:45-21:50, the machine alone; B's 85
requests a window kind; the ingress's and the replica's clocks read at a request's arrival,
the call to the replica, the replica's start and first chunk, the ingress's first chunk),
B's p50 / p99 under the flood against quiet, in ms: behind Serve's proxy, client to the
ingress's handler 15.4 / 77.5 against 8.8 / 14.7 (the proxy actor and the ingress's HTTP
side), the ingress to the replica 6.8 / 19.9 against 3.0 / 5.8 (Serve's handle), the
replica to its first chunk 9.6 / 28.3 against 5.2 / 12.5, that chunk to the ingress 2.4 /
13.8 against 3.1 / 8.5 and on to the client 3.1 / 14.8 against 3.2 / 6.7; in all 41.9 /
113.6 against 24.4 / 34.1. Behind HAProxy the first hop is 5.0 / 16.3 against 3.5 / 7.6,
and the next two much as behind the proxy actor (the ingress to the replica 7.8 / 22.6,
the replica to its first chunk 9.8 / 42.9); in all 29.9 / 66.7 against 19.6 / 34.6. The
client's own event loop was late by at most 2 ms at p99 under the flood, so the tail is the
cluster's, not the harness's: Serve's proxy actor and the ingress's HTTP side are most of
it, and behind HAProxy what is left is Serve's handle call to the replica and the
replica's own wait for its first chunk (each 4-5 ms more at the median than quiet). A
second pair of runs (22:21-22:23) split the first hop at the ingress's ASGI entry: behind
Serve's proxy the ingress's own HTTP side, from there to the handler, took 3.7 / 6.4 ms
quiet and 8.9 / 55.3 under the flood, behind HAProxy 0.8 / 1.4 and 1.1 / 11.1. Behind
Serve's proxy the ingress does not have the request's body when it is called: it fetches
it back from the proxy actor (Ray 2.60's `ASGIReceiveProxy`,
ray/serve/_private/http_util.py, calling the proxy's `receive_asgi_messages`,
ray/serve/_private/proxy.py), a second round trip through the actor that relays the
flood; the hop before it, to the ingress's ASGI entry, read 11.8 / 46.1 under the flood
against 3.8 / 16.2 behind HAProxy. B's totals in that pair: 53.7 / 147.4 against 28.1 /
40.2 quiet behind Serve's proxy, 30.4 / 70.2 against 19.2 / 27.0 behind HAProxy. Behind
HAProxy, where the proxy actor's tail does not hide the replica's, the replica's switch
interval at 0.5 ms did not help either (22:31-22:42, alternating, the machine alone, load
0.9-1.7): B's p99 ratio 1.88, 2.58 and 2.43 (flood p99 66.9, 75.7 and 74.1 ms) against
2.02, 2.07 and 2.53 (68.5, 57.1 and 78.3 ms) at the default.""",
    "fleet": """\
`loraplex bench fleet` (`benchmarks/fleet/bench.py`): the same comparison at fleet scale in the
simulator — 16 × H100 serving a 7B model, 2,000–10,000 adapters — whose replicas are the real
adapter cache and scheduler and whose routers are the real affinity policy and Ray Serve's
routers modelled from Ray 2.60's source. The catalog is larger than one replica's 64 GiB host
tier and smaller than the fleet's, store reads take ~0.3 s. What one run asks for still fits
one replica's device pool and host tier together: in the scale sweep's zipf runs at the
reference rate no router's replicas evicted or dropped an adapter (`evictions`, `host_drops`
0, power of two included), so there the routers differ in reads and queueing, not in what the
fleet holds; the `eviction` run (a node's 256 GiB host tier, 4 × the catalog) is where pools
evict. Serve's `max_ongoing_requests` is Ray Serve LLM's 1e9 for every router (the engine
queues, Serve only forwards; `max_ongoing_requests` in the JSON), as in `bench router`;
runs before 2026-12-03 held 128 (2 × the batch). Here that cap seldom bound: the run of
2026-12-03 at 1e9 gave the run of 2026-11-28's goodputs within 2% (multiplexing's 44.5 /
27.0 / 40.7 req/s became 44.4 / 26.5 / 40.5, every ratio the same), where on the 2-core real
bench it held most of a burst in the handle. Every figure is the median over
seeds (3, `--quick` 2) and each ratio has its 90% bootstrap interval. The table reads the
simulator's validation from `fleet_validation` (below), which `--validation-only` writes.

The published quick run (2026-12-06 23:15, nice 19, 516 s) gave every figure of the run of
2026-12-03 to the last digit, on a tree with three days of router and simulator changes
between and on another machine: the simulator's own H100 profile and seeds decide it.
How far the fleet's router targets are from what the fleet can do at all (the published
quick run, 8 replicas, 83.3 req/s of capacity, 10.4 a replica): on zipf the affinity router
holds the SLO to 79.0 and 77.7 req/s in the two repetitions, 0.93-0.95 of the capacity,
against the better Ray router's 58.7 (multiplexing) and 52.3 (power of two). A goodput
ratio of 1.5 in the first repetition would be 88.1 req/s, above the capacity: there the
ratio cannot pass 1.42 whatever the router does. The replicas-needed ratio (<= 0.7) meets the
same bound: at the reference rate (50.0 req/s, 4.8 replicas' capacity) no router can hold the
SLO on fewer than 5 replicas, and where multiplexing needs 6 (the first repetition of zipf and
of shift) 5 / 6 = 0.83 is the lowest ratio possible; the affinity router needs 6 in every
repetition (0.80 of capacity). The ratios move with how the Ray router fares on a seed
(multiplexing's goodput 58.7 and 30.1 on zipf, its replicas 6 and 11), not with
the affinity router, whose figures hardly vary.""",
    "fleet_validation": """\
`loraplex bench fleet --validation-only [--quick] --json docs/bench/fleet_validation.json`
(`benchmarks/fleet/validation.py`): `bench router`'s repetitions of zipf (3, other seeds,
the routers' order rotated) at its reference rate on a real local Ray, every router, each
repetition then replayed in the simulator configured like it (the same warm-up and
requests, adapters, pool, host tier, read model, Serve settings and router costs, a CPU
profile fitted on one engine's steps, slowed by the replicas' share of the cores, plus a
cost per streamed token outside the steps that brings the replicas' base-model burst to
the capacity they showed, and per request a draw of the path's latency under load: before
the repetitions, base-model requests at the same rate through each router's app, whose real
TTFTs less the simulated ones of the same stream, quantile by quantile, are the samples,
`loaded_path_latency_s`);
`p99_ttft_error` and `loads_error` are the mean over the routers of |simulated − real| ÷
real, each figure the mean over the repetitions (one run's p99 at one rate on the 2 shared
cores moved 0.35-1.2 s between runs), each repetition's error beside
(`..._by_repetition`). Beside it, the same replays with the path of 30 lone requests on
idle replicas (`p99_ttft_error_lone_path`, the model until 2026-12-04) and with the loaded
path added by rank instead of drawn (`p99_ttft_error_ranked_path`: the longest simulated
waits get the calibration's longest paths). The engines count their forward passes and the
seconds they took on both sides. `step_seconds_ratio` is the median over the routers of the
real steps' seconds ÷ the simulated ones' less the streamed tokens' charge (as if Serve's
threads paid it outside the steps), `step_seconds_ratio_with_stream` the same against the
simulated steps with it; `p99_ttft_error_at_real_step_speed` replays each router with the
fitted steps slowed by the first and the charge on top, `p99_ttft_error_at_real_busy_time`
with the whole simulated step slowed by the second. `--save-run PATH` keeps the real run's
measurements and each request's real TTFT, `--from-run PATH` validates against them again
in seconds without Ray (bit for bit the same figures). Set beside their replays request by
request, the real p99 of the routers that read nothing was until 2026-12-04 the first 4-6
requests of every run (0.15-0.27 s against 0.007 s simulated, falling with their arrival):
the client started its clock before its garbage collection (~0.25 s in the driver), and
counted it in every request due meanwhile (`benchmarks/router/runs.py` `drive`, fixed).
Three runs after the fix (2026-12-04 20:52, 21:01, 21:09; 28.1, 27.7 and 24.8 req/s; load
average 1.1-3.8 before, 3.0-4.4 after): p99_ttft_error 0.20, 0.32 and 0.13 (median 0.20),
with the lone path 0.35, 0.45 and 0.15, by rank 0.04, 0.22 and 0.36; loads_error 0.07,
0.07 and 0.09. The published run is the median one (20:52). Five runs before the fix, with
the same 3-run calibration stream, gave 0.38-0.46 (median 0.40); with a third of that
stream the fourth of them gave 0.40 against 0.42, so its length was not what moved it. What
is left is bursts: the real tail is now a few requests arriving together mid-run (e.g. 4
within 0.05 s at 0.10-0.17 s where the replay gives 0.01-0.02), which a path drawn per
request independently cannot reproduce; and the figure moves 0.13-0.32 from run to run.
On GPUs each replica has its own device.""",
    "autoscale": """\
`loraplex bench fleet --section autoscale` (`benchmarks/fleet/autoscale.py`): the fleet
simulator under Ray Serve's autoscaler (`benchmarks/sim/scaling.py`: Ray 2.60's
AutoscalingContext, delay logic and bounds on the simulated clock, replicas that start in
their model's load time and leave by draining) over a compressed day: the Azure conv
trace's arrivals warped onto a diurnal rate with a 5x peak-to-trough swing and one
popularity shift at the peak, 2,000-10,000 adapters, H100 / 7B, the affinity router. Ray's
default policy is swept over target_ongoing_requests and its best setting kept; loraplex's
`lora` policy runs with its defaults; the static fleet is sized for the peak. Replica-hours
count a replica from Serve's asking for it until it has stopped. Flapping is measured apart,
at a steady load (`steady`: the day's mean rate all through, Zipf(1) without the shift;
Ray's default at its best setting and `lora`), counting scale events after the first 10
minutes; the day's own events follow its ramp and are reported beside. Beside the hours
against the static fleet, `replica_hours_clairvoyant_vs_static`: a fleet that knows the
rate and holds at each moment the fewest whole replicas that keep each at or below the
static fleet's load at the peak, started and stopped at once. Its hours are the day's mean
rate over its peak (0.6) only with fractional replicas; with whole ones they are 0.70 of the
static fleet's at a peak of 4 (`--quick`) and 0.64 at 12, so `<= 0.6` is below what such a
fleet reaches, and the table says so beside the miss. Serve's `max_ongoing_requests` is
Ray Serve LLM's 1e9, as in the fleet section since 2026-12-03 (at 128 lora's day and Ray's
best setting gave the same figures to the last digit: the cap never bound them). The
simulator is deterministic: a run's figures do not follow the machine's load. Since
2026-12-05 `lora`'s utilisation count has square-root headroom (a load of u replicas'
worth wants u + 0.5 sqrt(u) replicas; the band 0.7 sqrt(u)) where it wanted u / 0.7: the
published day (2026-12-06 13:18-13:58, nice 19, the policy's defaults) took 3.31
replica-hours at attainment 0.997 (0.838 of Ray's best), against 3.63 at 0.999 (0.918) for
the old rule, run beside it as `lora_proportional`. Its β was chosen on this day among four
pairs, so the same day on seeds 27 and 28 is the held-out check (docs/cluster.md). Since
2026-12-06 the policy's scale-down delay and cool-down are 60 s and 30 s (120 s and 60 s
before: 3.39 h, 0.858 of Ray's best; the steady hour 3.60 h and 2.4 events an hour after
its warm-up, now 3.51 h and 1.2). Shorter delays had undone steps down on the full day,
asked for by store reads of adapters coming back to replicas that last had them long
before; such reads no longer count (a re-read counts within `demand_window_s` of the
adapter's previous load there), and the full day at 60 s / 30 s took 31.7 replica-hours at
0.9979 with none undone, against 32.7 at 120 s / 60 s (docs/cluster.md). Where lora's hours
still go: the morning ramp, which sets how little headroom is enough (at β 0.43 the third
replica came 50 s later and attainment fell to 0.984), the down-ramp's delay, and a fifth
replica from 1,700 s to 2,383 s (0.19 h; without it the day would take 3.12 h, 0.79 of
Ray's best). That replica is asked for by 3.16 replicas' worth of use on four (each
replica's larger of its token utilisation and its slots held; in a harness run of the same
day the first such ask, at 980 s, read token utilisations of 0.84, 0.92 and 0.89, and 0.50
on the newest replica, which holds only the homes the walk moved to it), where square-root
headroom at β 0.5 wants 3.16 + 0.5 sqrt(3.16) = 4.05 replicas, while the static four hold
that peak with a p99 of 0.58 s against the 1.76 s SLO. Lowering β for this peak would be
fitting the policy to the bench's own day, and does not meet the target either: the peak's
use reads up to 3.34 on four replicas (β <= 0.36 to stay on four) where the morning's ramp
needs more than 0.43 (at 0.43 it held 0.984), and at β 0.25 the day took 3.04 h at 0.979.
Projecting the use's rise over a replica's start-up, or vetoing the headroom while every
replica's p99 TTFT is under half the SLO, did not separate the two either (2026-12-07,
3.29-3.45 h; docs/cluster.md); nor did Erlang C staffing, the exact queueing form of the
square root for a few replicas (3.18-3.23 h at 0.984-0.987: its third replica 50 s late).
As the scale-down band alone it took this day to 3.24 h at 0.9972, but on seed 27 let four
replicas go to three in a lull of the trace on the way up (0.970), and the band that
survives such a lull is what holds the way down.""",
}


def lookup(results: dict[str, Any], key: str) -> Any:
    value: Any = results
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def read_runs(json_dir: Path) -> dict[str, dict[str, Any]]:
    """The committed JSON of each suite that has one, by suite."""
    runs = {}
    for suite in SUITES:
        path = json_dir / f"{suite}.json"
        if path.exists():
            runs[suite] = json.loads(path.read_text())
    return runs


def render(runs: dict[str, dict[str, Any]]) -> str:
    lines = [
        "# Performance",
        "",
        "Generated by `loraplex bench report` from the JSON the benches wrote into `docs/bench/`",
        "(`loraplex bench SUITE [--quick] --json docs/bench/SUITE.json`); do not edit by hand.",
        "Every ratio is measured side by side in one run. Where a target is missed, the",
        "issue's note names the mechanism, with the measurement that shows it.",
        "",
        "| figure | value | target | met | against | run |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for h in HEADLINES:
        run = runs.get(h.suite)
        value = None if run is None else lookup(run, h.key)
        if value is None and run is not None:
            value = _non_finite(run, h.key)
        figure = h.figure(value)  # the value itself, or its worst draw's (`every`)
        met = h.met(figure)
        mark = {True: "yes", False: "**no**", None: "—"}[met]
        if run is not None and _at_ceiling(run, h.key):
            mark = "— (all held the SLO at the top rate)"
        elif met is False and run is not None and _peer_at_reads_floor(run, h.key):
            mark = "**no** (multiplexing at the floor: each new adapter read once)"
        elif met is False and run is not None and (bound := _clairvoyant(run, h)) is not None:
            mark = f"**no** (a clairvoyant fleet of whole replicas: {_value(bound)})"
        shown = "not run" if run is None else _value(value, h)
        if figure is not value:
            each = ", ".join(_value(v) for v in value)
            shown = f"{_value(figure, h)} (worst of {len(value)} draws; each {each})"
        if run is not None and value is None and _neither_read(run, h.key):
            shown = "— (0 / 0: neither read an adapter)"
        lines.append(
            f"| `{h.suite}` `{h.key}` | {shown} | {h.target} | {mark} | {h.against} | "
            f"{_run_label(run)} |"
        )
    lines += ["", "Runs:", ""]
    for suite in SUITES:
        run = runs.get(suite)
        lines.append(f"- `{suite}`: {_run_detail(run)}")
    lines += ["", "## Method", ""]
    for suite in SUITES:
        lines += [f"### {suite}", "", METHODS[suite], ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _at_ceiling(run: dict[str, Any], key: str) -> bool:
    """Whether `key` is a router goodput ratio that is 1 by the sweep's ceiling
    (goodput.py `ratio_at_ceiling`)."""
    parts = key.split(".")
    if len(parts) != 3 or parts[0] != "workloads" or "goodput_ratio_vs_best_ray" not in parts[2]:
        return False
    return ratio_at_ceiling((run.get("workloads") or {}).get(parts[1], {}))


def _peer_at_reads_floor(run: dict[str, Any], key: str) -> bool:
    """Whether `key` is a reads ratio against multiplexing whose store reads were at the
    floor (router/figures.py `reads_floor`): then no router can read fewer, and the ratio
    says the peer cannot be beaten on reads at that rate, not that affinity read more."""
    workload = _reads_ratio_workload(run, key)
    peer, floor = (workload.get("reads") or {}).get("multiplex"), workload.get("reads_floor")
    return floor is not None and peer is not None and peer <= floor


def _neither_read(run: dict[str, Any], key: str) -> bool:
    """Whether `key` is a reads ratio against multiplexing left out because both routers
    read nothing at the reference rate (goodput.py `_ratio`: 0 / 0 has no value)."""
    reads = _reads_ratio_workload(run, key).get("reads") or {}
    return reads.get("affinity") == 0 and reads.get("multiplex") == 0


def _reads_ratio_workload(run: dict[str, Any], key: str) -> dict[str, Any]:
    """The workload's figures where `key` is its `reads_ratio_vs_multiplex`, else {}."""
    parts = key.split(".")
    if len(parts) != 3 or parts[0] != "workloads" or parts[2] != "reads_ratio_vs_multiplex":
        return {}
    return (run.get("workloads") or {}).get(parts[1], {})


def _clairvoyant(run: dict[str, Any], h: Headline) -> float | None:
    """For the autoscaled day's hours against the static fleet, what a fleet that knows
    the rate would need (fleet/autoscale.py `clairvoyant_replica_hours`), where it misses
    the target too: the target is then below what any fleet of whole replicas at the
    static fleet's load reaches, and the table says how far."""
    if h.key != "autoscale.replica_hours_ratio_vs_static":
        return None
    bound = lookup(run, "autoscale.replica_hours_clairvoyant_vs_static")
    return bound if bound is not None and h.met(bound) is False else None


def _non_finite(run: dict[str, Any], key: str) -> float | None:
    """A figure the JSON holds as null because it was infinite (`report.write_json` names
    it in `non_finite`): a ratio over a baseline's 0."""
    why = (run.get("non_finite") or {}).get(key, "")
    return float(why.split(":")[0]) if why.startswith(("inf", "-inf")) else None


def _value(value: Any, headline: Headline | None = None) -> str:
    """The figure in 3 significant digits, or as many more as show which side of the
    headline's target it is on (3.9956 against ">= 4" reads 3.996, not 4)."""
    if value is None:
        return "— (not in this run)"
    if isinstance(value, float) and math.isinf(value):
        return "∞ (the baseline's figure was 0)" if value > 0 else "−∞"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        for digits in range(3, 8):
            text = f"{value:.{digits}g}"
            if headline is None or headline.met(float(text)) == headline.met(value):
                return text
        return text
    return str(value)


def _run_label(run: dict[str, Any] | None) -> str:
    if run is None:
        return ""
    meta = run.get("run") or {}
    kind = "quick" if run.get("quick") or meta.get("quick") else "full"
    return f"{meta.get('date', '?')[:10]} {kind}"


def _run_detail(run: dict[str, Any] | None) -> str:
    if run is None:
        return "no committed JSON"
    meta = run.get("run") or {}
    load = meta.get("load_average") or {}
    cpus, machine = meta.get("cpus", "?"), meta.get("cpus_on_machine")
    # a run confined to fewer CPUs than its machine's (its affinity) says so
    cores = f"{cpus} of {machine} CPUs" if machine not in (None, cpus) else f"{cpus} CPUs"
    # the versions it ran, where the run recorded them (since 2026-12-06)
    versions = "".join(f", {k} {v}" for k, v in (meta.get("versions") or {}).items() if v)
    return (
        f"{meta.get('date', 'date unknown')}, `{meta.get('command', '?')}`, "
        f"{cores}, load average {load.get('before', '?')} before, "
        f"{load.get('after', '?')} after{versions}"
    )


def run_report(args: argparse.Namespace) -> int:
    json_dir = args.json_dir
    out = args.out
    out.write_text(render(read_runs(json_dir)))
    print(f"wrote {out} from {json_dir}")
    return 0
