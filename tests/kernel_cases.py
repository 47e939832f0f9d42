"""Adapters laid out in a scattered arena, for checking the Triton LoRA kernels against the
torch reference: mixed ranks, absent targets, rows in non-contiguous pages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels.lora import LoraGroupWeights, LoraOut, Segment
from loraplex.kernels.lora_tables import LoraLayout, LoraTableBuilder
from loraplex.replica.memory.pool import RowPacker, chunk_views

# per adapter, per target rank (0: the adapter lacks the target); 1 to 128 in one batch
TARGET_RANKS = {
    3: [(128, 0, 64), (1, 1, 1), (8, 16, 0), (0, 32, 5)],
    2: [(128, 64), (1, 0), (16, 16), (0, 7)],
    1: [(128,), (1,), (16,), (33,)],
}
# (tokens, adapter index or None): one token a request, adapter 0 in two runs
DECODE = [(1, a) for a in (None, 0, 0, 1, None, 2, 3, 3, 0)]

# Llama-3-8B projections (in, target widths), scaled down 16x for the interpreter.
SCALE = 16
REAL_GROUPS = {
    "qkv": (4096, (4096, 1024, 1024)),  # column-parallel: widths / tp
    "gate_up": (4096, (14336, 14336)),
    "o": (4096, (4096,)),  # row-parallel: in / tp
    "down": (14336, (4096,)),
}


def group_shape(kind: str, tp: int) -> tuple[int, tuple[int, ...]]:
    fan_in, widths = REAL_GROUPS[kind]
    if kind in ("o", "down"):
        return fan_in // SCALE // tp, tuple(w // SCALE for w in widths)
    return fan_in // SCALE, tuple(w // SCALE // tp for w in widths)


@dataclass(eq=False)  # hashed by identity, like the engine's resident adapters
class Resident:
    groups: list[list[LoraGroupWeights | None]]


def scattered_adapters(
    fan_in: int,
    widths: tuple[int, ...],
    target_ranks: list[tuple[int, ...]],  # per adapter, per target (0: absent)
    dtype: torch.dtype,
    page_elems: int = 4096,
    seed: int = 0,
) -> tuple[torch.Tensor, list[Resident]]:
    """An arena holding every adapter's A_cat and Bt in shuffled pages, and the views."""
    g = torch.Generator().manual_seed(seed)
    packer = RowPacker(page_elems)
    plans = []
    for ranks in target_ranks:
        present = [(j, r) for j, r in enumerate(ranks) if r > 0]
        a_index = packer.add(sum(r for _, r in present), fan_in)
        plans.append((present, a_index, [packer.add(r, widths[j]) for j, r in present]))
    num_pages = packer.num_pages + 3
    arena = torch.zeros(num_pages, page_elems, dtype=dtype)
    pages = torch.randperm(num_pages, generator=g)[: packer.num_pages].tolist()
    cols = [0]
    for w in widths:
        cols.append(cols[-1] + w)
    residents = []
    for present, a_index, bt_indices in plans:
        a_views = chunk_views(arena, packer.placements[a_index], pages)
        for v in a_views:
            v.copy_(torch.randn(v.shape, generator=g) / fan_in**0.5)
        outs, h = [], 0
        for (j, r), bt_index in zip(present, bt_indices, strict=True):
            bt_views = chunk_views(arena, packer.placements[bt_index], pages)
            for v in bt_views:
                v.copy_(torch.randn(v.shape, generator=g) / r**0.5)
            outs.append(LoraOut(cols[j], cols[j + 1], h, h + r, tuple(bt_views)))
            h += r
        groups = [[LoraGroupWeights(tuple(a_views), tuple(outs)) if present else None]]
        residents.append(Resident(groups))
    return arena, residents


def to_device(
    arena: torch.Tensor, residents: list[Resident], device: torch.device
) -> tuple[torch.Tensor, list[Resident]]:
    """The arena on `device`, and the residents' views re-made over it."""
    moved = arena.to(device)

    def on(v: torch.Tensor) -> torch.Tensor:
        return moved.as_strided(v.shape, v.stride(), v.storage_offset())

    out = []
    for r in residents:
        groups = []
        for per_layer in r.groups:
            groups.append(
                [
                    None
                    if w is None
                    else LoraGroupWeights(
                        tuple(on(v) for v in w.a),
                        tuple(
                            LoraOut(
                                o.col_start, o.col_end, o.h_start, o.h_end, tuple(map(on, o.bt))
                            )
                            for o in w.outs
                        ),
                    )
                    for w in per_layer
                ]
            )
        out.append(Resident(groups))
    return moved, out


def layout_for(widths: tuple[int, ...], max_rank: int, max_tokens: int, max_loras: int):
    cols, start = [], 0
    for w in widths:
        cols.append((start, start + w))
        start += w
    return LoraLayout(1, (tuple(cols),), max_rank, max_loras, max_tokens)


def runs_of(plan: list[tuple[int, int | None]], residents: list[Resident]):
    """(start, end, resident or None) for each (tokens, adapter index or None) of `plan`,
    and the number of tokens."""
    runs, start = [], 0
    for n, a in plan:
        runs.append((start, start + n, None if a is None else residents[a]))
        start += n
    return runs, start


def segments_of(runs: list[tuple[int, int, Resident | None]]) -> list[Segment]:
    return [(s, e, None if r is None else r.groups[0][0]) for s, e, r in runs]


def table_builder(arena, widths, max_rank, max_tokens, max_loras) -> LoraTableBuilder:
    return LoraTableBuilder(arena, layout_for(widths, max_rank, max_tokens, max_loras))
