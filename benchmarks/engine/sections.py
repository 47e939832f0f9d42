"""Where a decode step's time goes, for `bench engine`: the step's wall time split into the
forward pass's sections, each timed around the function `replica/model/llama.py` or
`replica/batch.py` calls for it, and what is left (sampling, scheduling, LoRA, the
embedding, Python).

Wall clocks around the calls, not `torch.profiler`: the profiler's per-op cost is large
beside these ops (it read the KV gather of SmolLM2's decode step at 470 us an op; timed
around the call it is 190 us) and would misplace the time it reports. The wrappers cost
well under 1 us a call, ~300 calls a step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import loraplex.kernels.attention_native as attention_native
import loraplex.replica.batch as step_batch
import loraplex.replica.model.llama as llama

# section -> (owner, function) called once or more per layer
SECTIONS: dict[str, tuple[Any, str]] = {
    "gemm": (llama, "linear"),
    # a layer's attention, whichever path the backend gives it (the torch ops' gather and
    # products, or a decode kernel: kernels/attention_native.py)
    "attention": (step_batch.StepAttention, "__call__"),
    "attention_rows": (step_batch, "decode_rows"),  # once a step; 0 with a decode kernel
    # a decode layer's RoPE, KV write and attention in one call of the compiled loops
    # (kernels/attention_native.DecodeLayers): where it runs, attention, rope and
    # kv_write read 0
    "decode_layer": (attention_native.DecodeLayers, "__call__"),
    # the norms with the residual add before each, and SwiGLU's product: torch forms or
    # the compiled loops (kernels/small_ops_native.py)
    "norm": (llama.ForwardOps, "norm"),
    "rope": (llama.ForwardOps, "rotate"),
    "kv_write": (llama.ForwardOps, "write_kv"),
    "silu_mul": (llama.ForwardOps, "silu_mul"),
}


@contextmanager
def _timed(totals: dict[str, float]) -> Iterator[None]:
    originals = {name: getattr(owner, fn) for name, (owner, fn) in SECTIONS.items()}

    def wrap(name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start

        return timed

    try:
        for name, (owner, fn) in SECTIONS.items():
            setattr(owner, fn, wrap(name, originals[name]))
        yield
    finally:
        for name, (owner, fn) in SECTIONS.items():
            setattr(owner, fn, originals[name])


def step_sections_ms(step: Callable[[], object], steps: int) -> dict[str, float]:
    """Mean ms per step of each section over `steps` calls of `step`, the whole step
    (`step`) and the rest. The step must be a base-model decode step (the sections above
    are what it calls)."""
    totals = dict.fromkeys(SECTIONS, 0.0)
    with _timed(totals):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        whole = time.perf_counter() - start
    out = {name: t / steps * 1e3 for name, t in totals.items()}
    out["rest"] = (whole - sum(totals.values())) / steps * 1e3
    out["step"] = whole / steps * 1e3
    return out
