"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seed.

Every parameter is checked as the sampler will use it: temperature and top-p in float32
(a top-p that is positive as a Python float can round to 0 in float32 and filter out every
token), seeds in the range `torch.Generator.manual_seed` takes. The ingress runs the same
checks (`check_*`), so a bad value is a 400 naming the field, never a fault in the engine.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np
import torch

from loraplex.kernels import small_ops_native as small_ops

# Temperatures below this act as greedy decoding (as in vLLM's _SAMPLING_EPS): dividing
# float32 logits by a smaller one overflows to inf and the softmax gives NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
TOP_K_MAX = 2**31 - 1


def check_temperature(value: float) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"temperature must be a finite number, got {value!r}")
    if not 0.0 <= value <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {value!r}")
    return value


def check_top_p(value: float) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"top_p must be a finite number, got {value!r}")
    as_used = float(np.float32(value))
    if not 0.0 < as_used <= 1.0:
        raise ValueError(
            f"top_p must be in (0, 1] as a float32 (the smallest accepted is "
            f"{float(np.finfo(np.float32).smallest_subnormal):.3g}), got {value!r}"
        )
    return value


def check_top_k(value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not -1 <= value <= TOP_K_MAX:
        raise ValueError(
            f"top_k must be an integer in [-1, {TOP_K_MAX}] (0 or -1 disable it), got {value!r}"
        )
    return value


def check_seed(value: int | None) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not SEED_MIN <= value <= SEED_MAX:
        raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1], got {value!r}")
    return value


def draw_seed(seed: int, position: int) -> int:
    """The seed of a request's draw for output token `position`: a splitmix64 mix of the
    request's seed and the position. Each draw depends on (seed, position) alone, so a
    request resumed elsewhere after k tokens (or recomputed after preemption) draws its
    (k+1)-th token exactly as an uninterrupted run would."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW_TEMPERATURE) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_logits: bool = (
        False  # attach each step's float32 logits to the output (oracles, debugging)
    )

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check_temperature(self.temperature)
        check_top_p(self.top_p)
        check_top_k(self.top_k)
        check_seed(self.seed)
        if isinstance(self.stop, str):
            raise ValueError(f"stop must be a tuple of strings, not the string {self.stop!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] with tokens outside top-k / the top-p nucleus set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p: a token is dropped when the
        # mass before it already does. The first token never is, even where top_p is a
        # float32 denormal that a thread flushing denormals (the engine's) reads as 0
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def greedy_tokens(logits: torch.Tensor, loops: ctypes.CDLL | None = None) -> list[int]:
    """logits [n, V] -> the argmax of every row (in the compiled loops where given:
    kernels/small_ops_native.py)."""
    if loops is not None and logits.device.type == "cpu":
        tokens = small_ops.argmax_rows(loops, logits)
        if tokens is not None:
            return tokens
    return logits.argmax(dim=-1).tolist()


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from logits [V] float32 under `params` (not greedy), drawn with `generator`."""
    row = _filter(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(row, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample(
    logits: torch.Tensor,  # [n, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[int]:
    """One token per row. Greedy rows take the argmax; others sample with their generator."""
    tokens = greedy_tokens(logits)
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = sample_token(logits[i], p, generators[i])
    return tokens
