"""LoRA on a CPU as compiled loops (lora_cpu.c): one call per layer and group, adapters read
in place through the pool's row tables, for steps whose segments are short (decode).

The torch path (lora_gathered) pays per op: a decode step of the bench's serving batch
reads most groups in place, one small matmul per adapter, row-chunk and target, each
~10-13 us of dispatch in the step for a few microseconds of arithmetic (the synthetic
model's 26 decode steps of more than 16 rows ran ~18,500 such ops a round, 0.24 s of a
1.33 s round). Here each layer and group is one call of a C loop that reads every
adapter's rows where the pool keeps them (the tables the Triton kernels read,
lora_tables.py) and splits the work over the calling thread's OpenMP team. Measured on
2026-12-07 (2 cores, load 0.5-1.4, processes of each backend alternating, the same tokens):
the serving round of `bench engine` took 1.05-1.16 s against 1.20-1.33 on the synthetic
model and 1.24-1.32 against 1.32-1.38 on SmolLM2; `bench engine`'s speedups over PEFT went
3.60 -> 4.42 (synthetic) and 2.85 -> 3.02 (SmolLM2), docs/performance.md.

A prefill's long segments stay on torch: a loop of dot products per token computes what
one BLAS product does several times slower, so steps with a segment longer than
MAX_SEGMENT_TOKENS take the torch path. Float32 only (a bf16 pool takes the torch path).
The library is built, loaded and checked by native.py (`check` below is its check of
these loops).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from loraplex.kernels.lora import LoraGroupWeights, LoraOut, lora_sgmv
from loraplex.kernels.lora_tables import LoraLayout, LoraStepMeta, LoraTableBuilder

# Longest run of tokens sharing an adapter that the compiled loops take: decode steps (one
# token a request) and small prefills. On the synthetic serving round every segment
# (no limit) and segments of at most 16 measured alike (1.20 s), at most 4 slower (1.36 s).
MAX_SEGMENT_TOKENS = 16
_STEP_FIELDS = (
    "arena", "seg", "n_seg", "max_r", "ranks", "a_rows", "t_rank", "t_hoff", "b_rows", "cols",
    "layers", "groups", "targets", "a_cap", "r_cap", "max_w",
)  # fmt: skip
_SEG, _N_SEG = _STEP_FIELDS.index("seg"), _STEP_FIELDS.index("n_seg")


@dataclass(slots=True)
class NativeStep:
    """One step's tables as the library reads them; `keep` holds the tensors they point
    into alive while it is used (`set_segments` moves it on to a step of the same
    adapters)."""

    desc: torch.Tensor  # int64 [len(_STEP_FIELDS)]
    # h's width for each layer and group: its largest R over the step's adapters (0: none
    # has the group, which then has no arguments). Under tensor parallelism h is
    # all-reduced: the step's largest R for every group sent 3x the bytes the torch ops
    # send (tp.lora_comm_ratio 0.11 against 0.04)
    widths: list[list[int]]
    keep: tuple[torch.Tensor, ...]
    seg: torch.Tensor  # int64 [n_seg, 3]: start, end, slot


def set_segments(step: NativeStep, segments: list[tuple[int, int, int]]) -> None:
    """The step's segments replaced: (start, end, slot) each, slots those of its tables."""
    step.seg = torch.tensor(segments, dtype=torch.int64).view(-1, 3)
    step.desc[_SEG] = step.seg.data_ptr()
    step.desc[_N_SEG] = step.seg.shape[0]


@dataclass(frozen=True, slots=True)
class NativeArgs:
    """What one layer and group reads in a step."""

    step: NativeStep
    layer: int
    group: int


def native_step(meta: LoraStepMeta, arena: torch.Tensor) -> NativeStep:
    """The step's tables (meta, from lora_tables.LoraTableBuilder) for the library."""
    t = meta.tables
    start = meta.seg_start.long()
    seg = torch.stack([start, start + meta.seg_len, meta.seg_slot.long()], dim=1).contiguous()
    _, layers, groups, targets, r_cap = t.b_rows.shape
    values = {
        "arena": arena.data_ptr(), "seg": seg.data_ptr(), "n_seg": seg.shape[0],
        "max_r": max(meta.max_r, 1), "ranks": t.ranks.data_ptr(), "a_rows": t.a_rows.data_ptr(),
        "t_rank": t.t_rank.data_ptr(), "t_hoff": t.t_hoff.data_ptr(),
        "b_rows": t.b_rows.data_ptr(), "cols": meta.cols.data_ptr(), "layers": layers,
        "groups": groups, "targets": targets, "a_cap": t.a_rows.shape[-1], "r_cap": r_cap,
        "max_w": int((meta.cols[:, 1:] - meta.cols[:, :-1]).max()),
    }  # fmt: skip
    for name in ("ranks", "a_rows", "t_rank", "t_hoff", "b_rows"):
        assert getattr(t, name).is_contiguous(), f"{name} must be contiguous"
    desc = torch.tensor([values[f] for f in _STEP_FIELDS], dtype=torch.int64)
    keep = (t.ranks, t.a_rows, t.t_rank, t.t_hoff, t.b_rows, meta.cols, arena)
    return NativeStep(desc, t.ranks.amax(0).tolist(), keep, seg)


def shrink(lib: ctypes.CDLL, x: torch.Tensor, args: NativeArgs) -> torch.Tensor:
    """h [T, the group's largest R] float32 (zeros beyond each adapter's rows and for base
    tokens)."""
    if x.stride(1) != 1 or x.dtype != torch.float32:
        x = x.contiguous().float()
    width = args.step.widths[args.layer][args.group]
    h = torch.zeros(x.shape[0], width, dtype=torch.float32)
    lib.lora_shrink(
        args.step.desc.data_ptr(), args.layer, args.group,
        x.data_ptr(), x.stride(0), x.shape[1], h.data_ptr(), h.stride(0),
    )  # fmt: skip
    return h


def expand(lib: ctypes.CDLL, y: torch.Tensor, h: torch.Tensor, args: NativeArgs) -> None:
    """y += each target's part of h @ its Bt, in place (through a float32 copy where y is
    not float32 rows)."""
    if y.stride(1) != 1 or y.dtype != torch.float32:
        out = y.float()  # a copy
        expand(lib, out, h, args)
        y.copy_(out)
        return
    lib.lora_expand(
        args.step.desc.data_ptr(), args.layer, args.group,
        y.data_ptr(), y.stride(0), h.data_ptr(), h.stride(0),
    )  # fmt: skip


def declare(lib: ctypes.CDLL) -> None:
    """The loops' argument types."""
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.lora_shrink.argtypes = [p, i, i, p, i, i, p, i]
    lib.lora_expand.argtypes = [p, i, i, p, i, p, i]
    lib.lora_shrink.restype = lib.lora_expand.restype = None


class _Resident:
    def __init__(self, groups: list[list[LoraGroupWeights | None]]):
        self.groups = groups


def check(lib: ctypes.CDLL) -> None:
    """The library against the torch reference on a small pool: two adapters of different
    ranks, one with a target absent and a matrix in two row-chunks, a base token between."""
    gen = torch.Generator().manual_seed(0)
    arena = torch.randn(4096, generator=gen)
    cols = ((0, 6), (6, 10))
    layout = LoraLayout(1, (cols,), max_rank=4, max_loras=2, max_tokens=8)

    def weights(at: int, rank: int, both: bool) -> LoraGroupWeights:
        a = arena[at : at + 2 * rank * 5].view(2 * rank, 5)
        chunks = (a[:rank], a[rank:]) if rank > 1 else (a,)
        bt0 = arena[at + 200 : at + 200 + rank * 6].view(rank, 6)
        bt1 = arena[at + 400 : at + 400 + rank * 4].view(rank, 4)
        outs = [LoraOut(0, 6, 0, rank, (bt0,))]
        if both:
            outs.append(LoraOut(6, 10, rank, 2 * rank, (bt1,)))
        return LoraGroupWeights(chunks if both else (a[:rank],), tuple(outs))

    adapters = [_Resident([[weights(0, 3, True)]]), _Resident([[weights(1000, 2, False)]])]
    x = torch.randn(6, 5, generator=gen)
    segments = [(0, 2, adapters[0]), (3, 6, adapters[1])]
    meta = LoraTableBuilder(arena, layout).build(segments, 6, decode=False)
    step = native_step(meta, arena)
    y = torch.randn(6, 10, generator=gen)
    want = y.clone()
    lora_sgmv(want, x, [(s, e, r.groups[0][0]) for s, e, r in segments])
    args = NativeArgs(step, 0, 0)
    expand(lib, y, shrink(lib, x, args), args)
    if not torch.allclose(y, want, rtol=1e-4, atol=1e-4):
        raise RuntimeError("the compiled loops disagree with the torch reference")
