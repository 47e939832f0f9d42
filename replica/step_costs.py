"""What a step costs on this replica, learnt from its own steps: the costs the router weighs
and the autoscaling report prices tokens with.

Each step records (prompt tokens computed, decode rows, distinct adapters in the batch,
seconds). A least-squares fit over the last `window` steps gives

    step_s ≈ base_s + per_prompt_token_s * prompt_tokens + per_decode_row_s * decode_rows
             + per_adapter_s * adapters

(coefficients clamped at 0: noise must not make a token or an adapter look free of cost
below zero). A decode row makes one output token from a sequence whose prompt is computed.
On a GPU the two differ by an order of magnitude: a prompt token is compute (~27 µs on an
H100 for a 7B model) while a decode row reads its sequence's KV cache (~0.2-0.3 ms at a
thousand tokens of context), so one column for both priced an output token by whichever
kind the recent steps held most. A CPU step grows with every token of either kind.
per_adapter_s is the multi-LoRA loop's cost of one more adapter segment.

Finished requests give the mean output length, so the cost of bringing an adapter into a
batch for one request's life is per_adapter_s * mean_output_tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from loraplex.replica.sequence import Sequence


@dataclass(frozen=True, slots=True)
class StepCosts:
    base_s: float
    per_prompt_token_s: float
    per_decode_row_s: float
    per_adapter_s: float
    mean_output_tokens: float
    samples: int


def step_rows(scheduled: Iterable[tuple[Sequence, int]]) -> tuple[int, int]:
    """(prompt tokens, decode rows) of a step's (sequence, tokens) rows, before the step
    advances them: a decode row computes one token past its computed prompt; every other
    token (a prompt chunk, or a preempted sequence's recompute) is counted as a prompt
    token."""
    tokens = decode = 0
    for seq, n in scheduled:
        tokens += n
        decode += n == 1 and seq.num_computed >= len(seq.prompt_ids)
    return tokens - decode, decode


class StepCostEstimator:
    def __init__(self, window: int = 512, min_samples: int = 32, output_decay: float = 0.05):
        if not (window >= min_samples >= 3 and 0 < output_decay <= 1):
            raise ValueError("need window >= min_samples >= 3 and 0 < output_decay <= 1")
        self.min_samples = min_samples
        self.output_decay = output_decay
        self._steps: deque[tuple[int, int, int, float]] = deque(maxlen=window)
        self._mean_output: float | None = None

    def record_step(
        self, prompt_tokens: int, decode_rows: int, adapters: int, seconds: float
    ) -> None:
        self._steps.append((prompt_tokens, decode_rows, adapters, seconds))

    def record_finished(self, output_tokens: int) -> None:
        """An exponentially weighted mean, so it follows a changing workload."""
        if self._mean_output is None:
            self._mean_output = float(output_tokens)
        else:
            self._mean_output += self.output_decay * (output_tokens - self._mean_output)

    def estimate(self) -> StepCosts | None:
        """None until `min_samples` steps were seen."""
        if len(self._steps) < self.min_samples:
            return None
        data = np.array(self._steps, dtype=float)
        x = np.column_stack([np.ones(len(data)), data[:, :3]])
        base, prompt, decode, adapter = _nonneg_lstsq(x, data[:, 3])
        return StepCosts(
            base_s=base,
            per_prompt_token_s=prompt,
            per_decode_row_s=decode,
            per_adapter_s=adapter,
            mean_output_tokens=self._mean_output or 0.0,
            samples=len(data),
        )


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares with every coefficient >= 0: refit without the columns that came out
    negative (at most one round a column). A column that never varies (all steps of one
    adapter, say, or no prompt in the window) is dropped too: its cost cannot be told apart
    from the base."""
    active = [j for j in range(x.shape[1]) if j == 0 or np.ptp(x[:, j]) > 0]
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        negative = [j for j, c in zip(active, coef, strict=True) if c < 0]
        if not negative:
            out = [0.0] * x.shape[1]
            for j, c in zip(active, coef, strict=True):
                out[j] = float(c)
            return out
        active = [j for j in active if j not in negative]
        if not active:
            return [0.0] * x.shape[1]
