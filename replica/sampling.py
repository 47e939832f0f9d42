"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
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
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(
                f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}"
            )
        if isinstance(self.stop, str):
            raise ValueError(f"stop must be a tuple of strings, not the string {self.stop!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] with tokens outside top-k / the top-p nucleus set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,  # [n, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[int]:
    """One token per row. Greedy rows take the argmax; others sample with their generator."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = _filter(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return tokens
