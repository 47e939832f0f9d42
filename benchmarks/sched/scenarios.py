"""Workload scenarios of `loraplex bench sched`: the paper's setup and trace shapes it was
not tuned on, each built from any Azure-format trace.

`paper` is seed 004 §5.1 (with §3.2's length rule): an A40 with Llama-7B, 100 adapters of
ranks 8-128 (20 each; uniform over ranks, power law within one), the conversation
trace's lengths scaled by the constant that makes its replay peak at the pool's capacity,
Poisson arrivals, S-LoRA run with its default token pool (6000 slots: the operating
point that gives the paper's SLO and S-LoRA's throughput; `device-pool` is the same with
the device's whole free memory as S-LoRA's pool). Clients ask for exactly the trace's output (`max_new_tokens` = output
length, `ignore_eos`), as the S-LoRA benchmark client does (S-LoRA benchmarks/run_exp.py);
S-LoRA reserves memory for it, the others only cap their output predictor with it.

The other shapes change one property of the trace before the same rules apply:
`long-prompt` multiplies prompts by 4 and divides outputs by 4 (prefill-heavy requests,
as in a code-completion service); `bursty` draws gamma inter-arrival times with a
coefficient of variation of 4 instead of Poisson's 1 (S-LoRA's own bursty workloads use
cv 1-8, benchmarks/trace.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from loraplex.benchmarks.sim.workload import AdapterSpec, SimRequest, Trace, poisson_requests


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    prompt_factor: float = 1.0  # on the trace's context lengths, before the paper's scaling
    output_factor: float = 1.0  # on its generated lengths
    cv: float = 1.0  # inter-arrival coefficient of variation: 1 is Poisson
    # S-LoRA's --max_total_token_num (KV and adapter slots); None: the device's pool. The
    # paper does not give S-LoRA's flags; 6000 is S-LoRA's default (slora/server/
    # api_server.py, `--max_total_token_num`). The length rule applies to this pool, and
    # Chameleon on S-LoRA caches adapters in the device memory it leaves idle.
    slora_pool: int | None = 6000


SCENARIOS = {
    "paper": Scenario(
        "paper",
        "seed 004 §5.1: A40 + Llama-7B, 100 adapters (ranks 8-128), trace lengths scaled "
        "to the pool, Poisson arrivals",
    ),
    "device-pool": Scenario(
        "device-pool",
        "the paper's, with S-LoRA's pool the device's free memory (not its default 6000 "
        "tokens): the operating point before calibration",
        slora_pool=None,
    ),
    "long-prompt": Scenario(
        "long-prompt", "the paper's, with prompts x 4 and outputs / 4", 4.0, 0.25
    ),
    "bursty": Scenario("bursty", "the paper's, with gamma arrivals of cv 4", cv=4.0),
}


def shape_trace(trace: Trace, scenario: Scenario) -> Trace:
    if scenario.prompt_factor == 1.0 and scenario.output_factor == 1.0:
        return trace
    return Trace(
        f"{trace.source} (prompts x {scenario.prompt_factor:g}, outputs x "
        f"{scenario.output_factor:g})",
        trace.timestamps,
        np.maximum(1, np.round(trace.context * scenario.prompt_factor)).astype(int),
        np.maximum(1, np.round(trace.generated * scenario.output_factor)).astype(int),
    )


def scenario_requests(
    scenario: Scenario,
    trace: Trace,
    adapters: list[AdapterSpec],
    rate: float,
    n: int,
    length_scale: float,
    max_len: int,
    seed: int,
) -> list[SimRequest]:
    """n requests at `rate` / s: each asks for exactly its output, and its prompt is cut so
    that prompt + output fits the model's context."""
    reqs = poisson_requests(
        trace, adapters, rate, n, length_scale, max_len, seed=seed, cv=scenario.cv
    )
    return [
        replace(r, prompt=max(1, min(r.prompt, max_len - r.output)), max_tokens=r.output)
        for r in reqs
    ]
