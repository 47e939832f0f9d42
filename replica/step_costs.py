"""What a step costs on this replica, learnt from its own steps: the costs the router weighs.

Each step records (tokens computed, distinct adapters in the batch, seconds). A least-squares
fit over the last `window` steps gives

    step_s ≈ base_s + per_token_s * tokens + per_adapter_s * adapters

(coefficients clamped at 0: noise must not make a token or an adapter look free of cost
below zero). A GPU decoding is memory-bound, so per_token_s is ~0 there; a CPU step grows
with every token. per_adapter_s is the multi-LoRA loop's cost of one more adapter segment.

Finished requests give the mean output length, so the cost of bringing an adapter into a
batch for one request's life is per_adapter_s * mean_output_tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class StepCosts:
    base_s: float
    per_token_s: float
    per_adapter_s: float
    mean_output_tokens: float
    samples: int


class StepCostEstimator:
    def __init__(self, window: int = 512, min_samples: int = 32, output_decay: float = 0.05):
        if not (window >= min_samples >= 3 and 0 < output_decay <= 1):
            raise ValueError("need window >= min_samples >= 3 and 0 < output_decay <= 1")
        self.min_samples = min_samples
        self.output_decay = output_decay
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._mean_output: float | None = None

    def record_step(self, tokens: int, adapters: int, seconds: float) -> None:
        self._steps.append((tokens, adapters, seconds))

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
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        coef = _nonneg_lstsq(x, data[:, 2])
        return StepCosts(
            base_s=coef[0],
            per_token_s=coef[1],
            per_adapter_s=coef[2],
            mean_output_tokens=self._mean_output or 0.0,
            samples=len(data),
        )


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares with every coefficient >= 0: refit without the columns that came out
    negative (3 columns, so at most 3 rounds). A column that never varies (all steps of one
    adapter, say) is dropped too: its cost cannot be told apart from the base."""
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
