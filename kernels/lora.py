"""Batched multi-LoRA over weights that live in place in the paged pool — torch reference.

The batch's tokens are ordered so that tokens sharing an adapter are contiguous
(segments; Punica's SGMV form — a decode batch is the case of one token per request).
Each adapter's matrices are read through views of the pool's pages, never copied.

For one adapter, one layer and one group of projections that share an input (q/k/v,
gate/up, o, down), the pool holds

    A_cat  [R, in]       the A matrices of the group's targets stacked by rows
                         (R = sum of their ranks; no padding to a maximum rank)
    Bt_t   [r_t, out_t]  per target t: B_t transposed, with the LoRA scale folded in

each as one or a few row-chunks (a matrix larger than a page spans a few pages).

Contract of `lora_sgmv`:

    for (s, e, w) in segments:                  # w is None for base-model tokens
        h = x[s:e] @ A_cat(w).T                 # shrink   [e-s, R]
        for t in w.outs:
            y[s:e, t.col_start:t.col_end] += h[:, t.h_start:t.h_end] @ Bt_t   # expand
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LoraOut:
    col_start: int  # first column of y this target writes
    col_end: int
    h_start: int  # rows [h_start, h_end) of A_cat belong to this target
    h_end: int
    bt: tuple[torch.Tensor, ...]  # row-chunks of Bt [r_t, out_t], in row order


@dataclass(frozen=True, slots=True)
class LoraGroupWeights:
    a: tuple[torch.Tensor, ...]  # row-chunks of A_cat [R, in], in row order
    outs: tuple[LoraOut, ...]

    @property
    def rank(self) -> int:
        return sum(c.shape[0] for c in self.a)


Segment = tuple[int, int, LoraGroupWeights | None]


def _shrink(x: torch.Tensor, a: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if len(a) == 1:
        return x @ a[0].T
    return torch.cat([x @ chunk.T for chunk in a], dim=1)


def _expand(y: torch.Tensor, h: torch.Tensor, bt: tuple[torch.Tensor, ...]) -> None:
    row = 0
    for chunk in bt:
        n = chunk.shape[0]
        y.addmm_(h[:, row : row + n], chunk)
        row += n


def lora_shrink(x: torch.Tensor, segments: list[Segment]) -> list[torch.Tensor]:
    """[h_i [e-s, R(w)] = x[s:e] @ A_cat(w).T for each segment with an adapter]."""
    return [_shrink(x[s:e], w.a) for s, e, w in segments if w is not None]


def lora_expand(y: torch.Tensor, hs: list[torch.Tensor], segments: list[Segment]) -> None:
    """y[s:e, t.cols] += h_i[:, t.h_rows] @ Bt_t for each segment with an adapter, in place."""
    live = [(s, e, w) for s, e, w in segments if w is not None]
    for (s, e, w), h in zip(live, hs, strict=True):
        for t in w.outs:
            _expand(y[s:e, t.col_start : t.col_end], h[:, t.h_start : t.h_end], t.bt)


def lora_sgmv(y: torch.Tensor, x: torch.Tensor, segments: list[Segment]) -> None:
    """y [T, out_total] += LoRA(x [T, in]) per segment, in place. See the module contract."""
    for s, e, w in segments:
        if w is None:
            continue
        h = _shrink(x[s:e], w.a)
        for t in w.outs:
            _expand(y[s:e, t.col_start : t.col_end], h[:, t.h_start : t.h_end], t.bt)
