"""Batched multi-LoRA for CPU: the step's adapters gathered from the pool with one
index_select per matrix kind, then batched matmuls — a fixed number of ops per layer and
group, whatever the number of adapters in the step and of row-chunks per matrix (the torch
reference, `lora.lora_sgmv`, loops over both; this is tested against it).

Every row of an adapter's A_cat and Bt sits at an element offset of the flat arena (the row
tables of lora_tables.py). `rows_of(arena, width)` views the arena as overlapping windows of
`width` elements, window o starting at element o: any set of rows is then one
index_select, read where the pool keeps them.

For one layer and group, S adapters (slots), its J targets present in the step, r the
largest rank of a target among them (`GroupPlan`, built once per set of adapters):

    a_idx     [S * J * r]      offset of row k of target j's A in slot s (padding: a real row)
    b_idx     J x [S * r]      offset of row k of target j's Bt in slot s
    rank_mask [S, 1, J * r]    1 where k < rank of target j in slot s; None: no padding

and for the step's tokens (`TokenPlan`): slot s's tokens are tok[s * L : s * L + n_s]
(padding: token 0, masked by tok_mask [S, L, 1]). Contract:

    A = rows_of(arena, in)[a_idx].view(S, J * r, in)
    h = bmm(x[tok].view(S, L, in), A^T) * tok_mask * rank_mask          # shrink [S, L, J * r]
    for j: Bt_j = rows_of(arena, out_j)[b_idx_j].view(S, r, out_j)
           y[:, cols_j].index_add_(0, tok, bmm(h[:, :, j * r : (j + 1) * r], Bt_j))  # expand

Kept rows (`GatheredPlanner._keep_gathered`: gathered once while a step's set of adapters
repeats) may hold the Bts as one block-diagonal [S, J * r, out_total] matrix too, from the
set's second step: for a batch whose tokens are the slots' in order, the expand is then one
baddbmm_ into y's rows.

Groups that read in place (too few ops saved for the bytes a bucket gathers) may keep the
set's rows too, once the set has repeated a few steps, unpadded and target-major
(`MaskedPlan`): a small step is then one product of x with every row of the set, masked to
each token's own adapter's rows, and one addmm_ per target — a fixed number of ops, paid
for in FLOPs that multiply each token by every adapter's rows, so long steps read in place.
The rows serve the set's subsets down to half its adapters, so a batch whose requests
finish keeps them.

Slots are split into buckets by rank (the next power of two of an adapter's largest rank),
so that padding to r at most doubles the rows gathered: gathering copies the rows, and on a
CPU the copy costs about what reading them does. A group costs the ops above once per
bucket (at most log2(max_rank) + 1 of them), whatever the number of adapters or of their
row-chunks. When padding the tokens would more than double them (a prefill beside short
ones), the expand and shrink run per run of tokens instead (one matmul per run and target).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch

from loraplex.kernels.lora import LoraGroupWeights, LoraOut, Segment, lora_expand, lora_shrink
from loraplex.kernels.lora_tables import (
    AdapterTables,
    HasLoraGroups,
    LoraLayout,
    adapter_tables,
    slotted,
)

# Gathering a group's rows pays when it saves ops: on CPU the copy costs about what reading
# the rows does, an op ~10-20 us of dispatch. Measured on the real model (2 cores): 8
# adapters of rank 16 on q/k/v/o, ~60 KiB gathered per op saved, step overhead 0.10
# gathered vs 0.20-0.25 in place; 32 of ranks 8-64 on all projections, one token each,
# ~190 KiB per op saved, 1.3-1.6 gathered vs 0.5-0.7 in place.
GATHER_BYTES_PER_SAVED_OP = 96 * 1024
# A kept group's Bts are kept a second time as one block-diagonal matrix when its zeros
# cost less than the ops it saves (J bmm, a cat and an add become one baddbmm_). Reading
# zeros costs less than gathering rows: on the real model (2026-12-06, in one process,
# interleaved rounds, load 1.5-2.2) SmolLM2's q/k/v blocks (8 adapters of rank 16: 245 KiB
# of zeros per op saved) lowered the light step's LoRA overhead in 17 of 24 rounds over
# three A/Bs, their medians by 0.013, 0.003 and 0.023 (0.091 -> 0.078, 0.100 -> 0.097,
# 0.087 -> 0.064); the heavy step (32 adapters of ranks 8-64, all projections, whose masks
# the zeroed padding rows of A remove) 1.745 / 1.735, 1.746 / 1.777, 1.629 / 1.658.
BLOCK_BYTES_PER_SAVED_OP = 256 * 1024
# A group read in place whose set of adapters repeats may run a small step as one product
# over every row of the set instead (`MaskedPlan`): x @ A_set^T masked to each token's own
# adapter's rows, then one addmm_ per target. It pays where the in-place ops it replaces
# cost more than the products' wasted FLOPs (each token multiplies every adapter's rows):
# an op here is worth ~1 MFLOP (SmolLM2's q/k/v, 6 adapters of ranks 8-16, 16 tokens, one
# thread: 71 us for 7 MFLOP and 5 ops masked, against 122 us for 24 ops in place). On the
# real model (2026-12-07, the bench's serving adapters, 6 of them, zipf over a decode batch
# of 16): LoRA's share of the step 0.19/0.23/0.20 in place, 0.14/0.17/0.16 masked
# (interleaved, load 0.8-0.9); the bench's serving workload 1.737 -> 1.657 s a round
# (medians of 8 alternating rounds, load 0.9-1.3), the same tokens.
MASKED_FLOPS_PER_SAVED_OP = 1_000_000
# The rows are copied when a set has repeated this many steps, not at its first repeat: the
# copy costs ~7 ms a new set on the synthetic model's serving run, whose sets change every
# ~7 steps. In one process (2026-12-07, 8-10 alternating rounds, rotated, load 1.6-1.9),
# copied after 1 / 2 / 4 / 8 repeats against never: the real model's serving round 1.890 /
# - / 1.833 / - s against 1.975, then - / 1.801 / 1.750 / 1.721 against 1.934; the synthetic
# model's 1.528 / - / 1.517 / - against 1.522, then - / 1.674 / 1.624 / 1.596 against 1.746.
MASKED_KEEP_AFTER_REPEATS = 4
# Gathered rows kept across the steps of one set of adapters (a copy of what the step's
# adapters hold in the pool, up to this much; the rest is gathered per step).
GATHERED_KEEP_BYTES = 256 << 20


def kept_dtype(arena: torch.Tensor) -> torch.dtype:
    """The dtype gathered rows are kept in: float32 for a half-precision arena on a CPU, whose
    small half-precision batched matmuls are the slower (SmolLM2's q/k/v shrink and expand,
    8 adapters of rank 16, 4 tokens each, one thread: 82 us in bf16 against 57 in fp32)."""
    half = arena.dtype in (torch.bfloat16, torch.float16)
    return torch.float32 if half and arena.device.type == "cpu" else arena.dtype


def rows_of(arena: torch.Tensor, width: int) -> torch.Tensor:
    """[numel - width + 1, width]: row o is arena.flatten()[o : o + width] (no copy)."""
    flat = arena.view(-1)
    return flat.as_strided((flat.numel() - width + 1, width), (1, 1))


@dataclass(frozen=True, slots=True)
class GroupShape:
    """What one bucket's gather plan for a layer and group would hold, from the ranks alone:
    enough to decide whether to gather (`GatheredPlanner._reads_in_place`) before building
    any index."""

    in_width: int
    rank: int  # r: the largest rank of a present target over the bucket's slots
    present: tuple[int, ...]  # the targets some slot has
    cols: tuple[tuple[int, int], ...]  # their (first, end) columns of y
    num_slots: int

    @property
    def gathered_elems(self) -> int:
        """GroupPlan.gathered_elems of the plan this shape gives."""
        rows = self.num_slots * self.rank
        return rows * (len(self.present) * self.in_width + sum(e - s for s, e in self.cols))


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One bucket of slots for one layer and group."""

    in_width: int
    rank: int  # r: rows per target and slot, padded
    a_idx: torch.Tensor  # [S * J * r] int64
    b_idx: tuple[torch.Tensor, ...]  # J x [S * r] int64
    cols: tuple[tuple[int, int], ...]  # J x (first, end) columns of y
    rank_mask: torch.Tensor | None  # [S, 1, J * r]
    # the rows above, gathered once while the step's set of adapters repeats (see
    # GatheredPlanner); None: gathered by each step
    a: torch.Tensor | None = None  # [S, J * r, in]
    bts: tuple[torch.Tensor, ...] | None = None  # J x [S, r, out_j]
    # the kept Bts as one block-diagonal matrix over columns 0 to the last target's end,
    # so that a step's expand is one baddbmm_ into y (see GatheredPlanner._keep_blocks)
    bt_block: torch.Tensor | None = None  # [S, J * r, out_total]

    def gather_a(self, arena: torch.Tensor, num_slots: int) -> torch.Tensor:
        if self.a is not None:
            return self.a
        a = rows_of(arena, self.in_width).index_select(0, self.a_idx)
        return a.view(num_slots, -1, self.in_width)

    def gather_bts(self, arena: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, ...]:
        if self.bts is not None:
            return self.bts
        return tuple(
            rows_of(arena, end - start).index_select(0, idx).view(num_slots, self.rank, -1)
            for (start, end), idx in zip(self.cols, self.b_idx, strict=True)
        )

    @property
    def gathered_elems(self) -> int:
        return self.a_idx.numel() * self.in_width + sum(
            i.numel() * (end - start) for i, (start, end) in zip(self.b_idx, self.cols, strict=True)
        )

    def covers(self, width: int) -> bool:
        """Whether the targets' columns are [0, width) in order."""
        ends = [0] + [end for _, end in self.cols]
        return ends[-1] == width and all(s == e for (s, _), e in zip(self.cols, ends, strict=False))


@dataclass(frozen=True, slots=True)
class TokenPlan:
    """One bucket's tokens in a step."""

    num_slots: int
    per_slot: int  # L
    tok: torch.Tensor  # [S * L] int64
    tok_mask: torch.Tensor | None  # [S, L, 1]
    runs: tuple[tuple[int, int, int], ...]  # (start, end, slot)
    batched: bool  # padded bmm; else one matmul per run
    first: int | None  # tok is first, first + 1, ...: rows are read and written in place

    @property
    def num_hs(self) -> int:
        return 1 if self.batched else len(self.runs)


@dataclass(frozen=True, slots=True)
class MaskedPlan:
    """One layer and group of a group read in place: every row of a set of adapters, kept
    (a copy), target-major, no padding. Row k of `a` is a row of slot `row_slot[k]`'s A;
    `targets` are (first, end) columns of y, rows [h_start, h_end) of h and the rows' Bts
    stacked in the same order. A step's h = (x @ a^T) * (token's slot == row_slot)."""

    a: torch.Tensor  # [rows, in]
    row_slot: torch.Tensor  # [rows] int64 (shared by the layers whose rows have one layout)
    targets: tuple[tuple[int, int, int, int, torch.Tensor], ...]  # (c0, c1, h0, h1, Bt)
    flops_per_token: int

    @property
    def ops(self) -> int:
        return 2 + len(self.targets)

    @property
    def elems(self) -> int:
        return self.a.numel() + sum(t[4].numel() for t in self.targets)


@dataclass(frozen=True, slots=True)
class StepMasks:
    """A step's slot of each token (-1: none) in the kept masked rows, [T, 1], and the
    masks made from it, one per row layout (`MaskedPlan.row_slot`)."""

    token_slot: torch.Tensor
    by_layout: dict[int, torch.Tensor]


@dataclass(frozen=True, slots=True)
class GatheredArgs:
    """What one layer and group reads in a step: a plan per bucket of slots, or (`in_place`)
    the reference's segments, read through the pool's views, or (`masked`) one product over
    the rows of the set kept for the group, with the step's [T, rows] mask."""

    arena: torch.Tensor
    parts: tuple[tuple[GroupPlan, TokenPlan], ...]
    in_place: list[Segment] | None = None
    masked: tuple[MaskedPlan, torch.Tensor] | None = None


def token_plan(runs: list[tuple[int, int, int]], num_slots: int, dtype: torch.dtype) -> TokenPlan:
    """runs: (start, end, slot) of each run of tokens sharing an adapter."""
    counts = [0] * num_slots
    for s, e, slot in runs:
        counts[slot] += e - s
    per_slot = max(counts)
    batched = num_slots * per_slot <= 2 * sum(counts)
    tok = torch.zeros(num_slots, per_slot, dtype=torch.int64)
    filled = [0] * num_slots
    for s, e, slot in runs:
        tok[slot, filled[slot] : filled[slot] + e - s] = torch.arange(s, e)
        filled[slot] += e - s
    tok_mask = None
    if min(counts) < per_slot:
        tok_mask = (torch.arange(per_slot) < torch.tensor(counts)[:, None]).to(dtype)[..., None]
    tok = tok.view(-1)
    first = int(tok[0])
    if tok_mask is not None or not bool((tok == torch.arange(first, first + tok.numel())).all()):
        first = None
    return TokenPlan(num_slots, per_slot, tok, tok_mask, tuple(runs), batched, first)


def gathered_shrink(x: torch.Tensor, args: GatheredArgs) -> list[torch.Tensor]:
    """x [T, in] -> per bucket, [h [S, L, J * r]] (batched) or [h_i [e - s, J * r] per run]."""
    if args.masked is not None:
        plan, mask = args.masked
        h = (x if x.dtype == plan.a.dtype else x.to(plan.a.dtype)) @ plan.a.T
        return [h.mul_(mask)]
    if args.in_place is not None:
        return lora_shrink(x, args.in_place)
    hs: list[torch.Tensor] = []
    for g, t in args.parts:
        assert x.shape[1] == g.in_width, f"x has {x.shape[1]} features, A has {g.in_width}"
        a = g.gather_a(args.arena, t.num_slots)  # [S, J * r, in], kept_dtype when kept
        if x.dtype != a.dtype:
            x = x.to(a.dtype)
        if not t.batched:
            for s, e, slot in t.runs:
                h = x[s:e] @ a[slot].T
                hs.append(h if g.rank_mask is None else h.mul_(g.rank_mask[slot]))
            continue
        if t.first is not None:
            xs = x[t.first : t.first + t.tok.numel()]
        else:
            xs = x.index_select(0, t.tok)
        h = torch.bmm(xs.view(t.num_slots, t.per_slot, g.in_width), a.transpose(1, 2))
        if t.tok_mask is not None:
            h.mul_(t.tok_mask)
        if g.rank_mask is not None:
            h.mul_(g.rank_mask)
        hs.append(h)
    return hs


def gathered_expand(y: torch.Tensor, hs: list[torch.Tensor], args: GatheredArgs) -> None:
    """y [T, out_total] += each target's part of h @ its Bt, in place."""
    if args.masked is not None:
        (h,) = hs
        for c0, c1, h0, h1, bt in args.masked[0].targets:
            _add_product(y[:, c0:c1], h[:, h0:h1], bt)
        return
    if args.in_place is not None:
        lora_expand(y, hs, args.in_place)
        return
    used = 0
    for g, t in args.parts:
        _expand_part(y, hs[used : used + t.num_hs], args.arena, g, t)
        used += t.num_hs
    assert used == len(hs), "one h per bucket (batched) or per run"


def _add_product(out: torch.Tensor, h: torch.Tensor, bt: torch.Tensor) -> None:
    """out += h @ bt in place; h kept in float32 beside a half-precision out is multiplied
    then narrowed (addmm_ wants one dtype)."""
    if h.dtype == out.dtype:
        out.addmm_(h, bt)
    else:
        out += h @ bt


def _expand_part(
    y: torch.Tensor, hs: list[torch.Tensor], arena: torch.Tensor, g: GroupPlan, t: TokenPlan
) -> None:
    r = g.rank
    bts = g.gather_bts(arena, t.num_slots)  # J x [S, r, out_j]
    if not t.batched:
        for h, (s, e, slot) in zip(hs, t.runs, strict=True):
            for j, ((start, end), bt) in enumerate(zip(g.cols, bts, strict=True)):
                _add_product(y[s:e, start:end], h[:, j * r : (j + 1) * r], bt[slot])
        return
    (h,) = hs
    block = g.bt_block
    if (
        block is not None
        and t.first is not None
        and block.shape[2] == y.shape[1]
        and h.dtype == y.dtype
    ):
        rows = y[t.first : t.first + t.tok.numel()]
        rows.view(t.num_slots, t.per_slot, -1).baddbmm_(h, block)
        return
    outs = [torch.bmm(h[:, :, j * r : (j + 1) * r], bt) for j, bt in enumerate(bts)]
    if g.covers(y.shape[1]):
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    else:  # some target absent from every adapter of the bucket
        out = y.new_zeros(t.num_slots, t.per_slot, y.shape[1])
        for (start, end), o in zip(g.cols, outs, strict=True):
            out[:, :, start:end] = o
    # whole rows: index_add_ on a column slice of y takes a path ~10x slower
    if t.first is not None:
        y[t.first : t.first + t.tok.numel()].add_(out.view(-1, y.shape[1]))
    else:
        y.index_add_(0, t.tok, out.view(-1, y.shape[1]).to(y.dtype))


def in_place_ops(w: LoraGroupWeights) -> int:
    """The reference's matmuls for one adapter's group: one per row-chunk of A and of Bt."""
    return len(w.a) + sum(len(t.bt) for t in w.outs)


def masked_plan(
    weights: list[LoraGroupWeights | None],
    dtype: torch.dtype,
    row_slots: dict[tuple[int, ...], torch.Tensor],
) -> MaskedPlan | None:
    """The rows of one layer and group over a set of adapters (weights[slot], None where
    the adapter lacks the group), target by target; None where the set's in-place ops are
    no more than a masked step's. row_slots shares one row-slot tensor between layouts."""
    present = [(slot, w) for slot, w in enumerate(weights) if w is not None]
    ops = sum(in_place_ops(w) for _, w in present)
    by_target: dict[tuple[int, int], list[tuple[int, LoraGroupWeights, LoraOut]]] = {}
    for slot, w in present:
        for t in w.outs:
            by_target.setdefault((t.col_start, t.col_end), []).append((slot, w, t))
    if ops <= 2 + len(by_target):
        return None
    a_rows, slots, targets, h = [], [], [], 0
    for (c0, c1), items in sorted(by_target.items()):
        bts = []
        for slot, w, t in items:
            a = w.a[0] if len(w.a) == 1 else torch.cat(w.a)
            a_rows.append(a[t.h_start : t.h_end])
            bts.extend(t.bt)
            slots += [slot] * (t.h_end - t.h_start)
        rows = len(slots) - h
        targets.append((c0, c1, h, h + rows, torch.cat(bts).to(dtype)))
        h += rows
    a = torch.cat(a_rows).to(dtype)
    row_slot = row_slots.setdefault(tuple(slots), torch.tensor(slots))
    flops = 2 * (a.numel() + sum((h1 - h0) * (c1 - c0) for c0, c1, h0, h1, _ in targets))
    return MaskedPlan(a, row_slot, tuple(targets), flops)


def bt_block(plan: GroupPlan, bts: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """The kept Bts of `plan` as one [S, J * r, width] block-diagonal matrix over columns
    0 to its last target's end (target j's Bt in rows j * r : (j + 1) * r and its columns,
    zeros elsewhere), so that a step's expand is one baddbmm_ into y when y is that wide (a
    trailing target absent from the bucket, or a tensor-parallel shard's slice of a
    row-parallel output, is not: those steps expand per target). None where the zeros would
    cost more than the ops they save (see BLOCK_BYTES_PER_SAVED_OP), or where the first
    target does not start y. One target starting y is its Bt itself."""
    r, slots, width = plan.rank, bts[0].shape[0], plan.cols[-1][1]
    if plan.cols[0][0] != 0:
        return None
    if len(bts) == 1:
        return bts[0]
    extra = slots * len(bts) * r * width - sum(bt.numel() for bt in bts)
    saved = len(bts) + 1  # J bmm, their cat (or zeros and copies) and the add, for one op
    if extra * bts[0].element_size() > BLOCK_BYTES_PER_SAVED_OP * saved:
        return None
    block = bts[0].new_zeros(slots, len(bts) * r, width)
    for j, ((start, end), bt) in enumerate(zip(plan.cols, bts, strict=True)):
        block[:, j * r : (j + 1) * r, start:end] = bt
    return block


class GatheredPlanner:
    """Per-step arguments of the gathered ops. The buckets and row offsets of a set of
    adapters (`GroupPlan`s) are computed when the step's set changes and kept while it
    repeats (decode steps of a running batch); each adapter's row tables once."""

    def __init__(self, arena: torch.Tensor, layout: LoraLayout):
        self.arena = arena
        self.layout = layout
        self._tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._key: tuple[int, ...] = ()
        self._residents: list[HasLoraGroups] = []  # holds the key's ids alive
        self._buckets: list[list[int]] = []  # slots of each bucket
        self._groups: list[list[list[GroupPlan | None]]] = []  # [bucket][layer][group]
        self._in_place: list[list[bool]] = []  # [layer][group]
        self._repeats = 0  # steps since the key's set's first (see _keep_blocks, _keep_masked)
        self._keep_budget = 0  # elements GATHERED_KEEP_BYTES leaves after the kept rows
        # rows of the groups read in place, kept for a set of adapters (see _keep_masked)
        self._masked: list[list[MaskedPlan | None]] = []  # [layer][group]
        self._masked_slots: dict[int, int] = {}  # id of a resident -> its slot
        self._masked_residents: list[HasLoraGroups] = []  # holds those ids alive
        self._masked_elems = 0

    def prepare(
        self, runs: list[tuple[int, int, HasLoraGroups]], num_tokens: int
    ) -> list[list[GatheredArgs | None]]:
        layers, num_groups = self.layout.num_layers, len(self.layout.group_columns)
        slotted_runs, residents = slotted(runs)
        if not residents:
            return [[None] * num_groups for _ in range(layers)]
        key = tuple(id(r) for r in residents)
        if key != self._key:
            self._plan(residents)
            self._key, self._residents, self._repeats = key, residents, 0
        else:
            self._repeats += 1
            if self._repeats == 1:
                self._keep_blocks()
            if self._repeats == MASKED_KEEP_AFTER_REPEATS:
                self._keep_masked(residents)
        masks = self._step_masks(runs, residents, num_tokens)
        tokens = []
        for bucket in self._buckets:
            local = {slot: i for i, slot in enumerate(bucket)}
            bucket_runs = [(s, e, local[slot]) for s, e, slot in slotted_runs if slot in local]
            tokens.append(token_plan(bucket_runs, len(bucket), self.arena.dtype))
        args: list[list[GatheredArgs | None]] = []
        for layer in range(layers):
            args.append([])
            for g in range(num_groups):
                if self._in_place[layer][g]:
                    segments = [
                        (s, e, w) for s, e, r in runs if (w := r.groups[layer][g]) is not None
                    ]
                    masked = self._masked_step(layer, g, segments, num_tokens, masks)
                    args[layer].append(GatheredArgs(self.arena, (), segments, masked))
                    continue
                parts = tuple(
                    (plans[layer][g], t)
                    for plans, t in zip(self._groups, tokens, strict=True)
                    if plans[layer][g] is not None
                )
                args[layer].append(GatheredArgs(self.arena, parts) if parts else None)
        return args

    def _tables_of(self, resident: HasLoraGroups) -> AdapterTables:
        tables = self._tables.get(resident)
        if tables is None:
            tables = self._tables[resident] = adapter_tables(
                resident.groups, self.arena, self.layout
            )
        return tables

    def _plan(self, residents: list[HasLoraGroups]) -> None:
        """A new set of adapters: its buckets, which layers and groups read in place, and the
        gather plans of the others. Which ones read in place is decided on each group's
        shape first (ranks and widths, no tensor built), so a set whose groups all read in
        place builds no plan: a set changes at most steps of a churning batch, and building
        every plan before deciding was 26 ms a new set on the router bench's replica, whose
        groups all read in place (3 x its base step; the LoRA burst's capacity 0.22 x the
        base-model burst's, on one engine, 2026-12-02)."""
        tabs = [self._tables_of(r) for r in residents]
        by_rank: dict[int, list[int]] = {}
        for slot, t in enumerate(tabs):
            top = int(t.t_rank.max())
            by_rank.setdefault(1 << max(top - 1, 0).bit_length(), []).append(slot)
        self._buckets = [by_rank[k] for k in sorted(by_rank)]
        shapes = [
            self._group_shapes([tabs[slot] for slot in bucket], [residents[s] for s in bucket])
            for bucket in self._buckets
        ]
        self._in_place = [
            [self._reads_in_place(residents, layer, g, shapes) for g in range(len(per_layer))]
            for layer, per_layer in enumerate(shapes[0])
        ]
        self._groups = [
            self._group_plans([tabs[slot] for slot in bucket], bucket_shapes, self._in_place)
            for bucket, bucket_shapes in zip(self._buckets, shapes, strict=True)
        ]
        self._keep_gathered(len(residents))

    def _keep_gathered(self, num_slots: int) -> None:
        """Gather the gathered groups' rows now, once for every step that repeats this set
        of adapters (decode steps of a running batch mostly do), instead of once per step:
        the copy was most of LoRA's cost on a CPU (SmolLM2, 8 adapters r16 on q/k/v/o, batch
        32: 41 ms of index_select against 20 ms of base matmuls over 4 steps). Rows of a
        resident adapter never change, and `_residents` keeps the key's adapters alive.
        Up to GATHERED_KEEP_BYTES; past that, steps gather as before."""
        dtype = kept_dtype(self.arena)
        budget = GATHERED_KEEP_BYTES // dtype.itemsize - self._masked_elems
        for b, plans in enumerate(self._groups):
            slots = len(self._buckets[b])
            for layer, per_layer in enumerate(plans):
                for g, plan in enumerate(per_layer):
                    if plan is None or self._in_place[layer][g] or plan.gathered_elems > budget:
                        continue
                    budget -= plan.gathered_elems
                    per_layer[g] = replace(
                        plan,
                        a=plan.gather_a(self.arena, slots).to(dtype),
                        bts=tuple(bt.to(dtype) for bt in plan.gather_bts(self.arena, slots)),
                    )
        self._keep_budget = budget

    def _keep_blocks(self) -> None:
        """The kept Bts of each group as one block-diagonal matrix (`bt_block`), built when a
        set of adapters first repeats, not when it appears: the block is one more copy of
        the Bts and their zeros, which only steps that repeat the set pay back, and a
        serving batch that admits or finishes a request changes its set at most steps (the
        real model's serving run measured the same either way, within the ~3% that the
        order engines are built in moves it). Within what GATHERED_KEEP_BYTES leaves. The
        kept A's padding rows are zeroed then too (in place: the kept rows are the plan's
        own copy), so that h needs no rank mask."""
        for per_bucket in self._groups:
            for per_layer in per_bucket:
                for g, plan in enumerate(per_layer):
                    if plan is None or plan.bts is None or plan.a is None:
                        continue
                    if plan.rank_mask is not None:
                        plan.a.mul_(plan.rank_mask.to(plan.a.dtype).transpose(1, 2))
                        plan = per_layer[g] = replace(plan, rank_mask=None)
                    block = bt_block(plan, plan.bts)
                    if block is None:
                        continue
                    if block is not plan.bts[0]:  # a copy: within the budget
                        if block.numel() > self._keep_budget:
                            continue
                        self._keep_budget -= block.numel()
                    per_layer[g] = replace(plan, bt_block=block)

    def _keep_masked(self, residents: list[HasLoraGroups]) -> None:
        """Keep the rows of the groups read in place for this set of adapters (`MaskedPlan`),
        once the set has repeated MASKED_KEEP_AFTER_REPEATS steps, unless the rows kept for
        an earlier set serve it (`_masks_serve`). Only groups where the set's in-place ops
        outnumber the masked ones; within what GATHERED_KEEP_BYTES leaves."""
        if self._masks_serve(residents) or not any(map(any, self._in_place)):
            return
        dtype = kept_dtype(self.arena)
        budget = self._keep_budget + self._masked_elems
        self._masked, self._masked_elems = [], 0
        row_slots: dict[tuple[int, ...], torch.Tensor] = {}  # one tensor per layout
        for layer, per_layer in enumerate(self._in_place):
            self._masked.append([])
            for g, in_place in enumerate(per_layer):
                plan = None
                if in_place:
                    plan = masked_plan([r.groups[layer][g] for r in residents], dtype, row_slots)
                if plan is not None and plan.elems <= budget:
                    budget -= plan.elems
                    self._masked_elems += plan.elems
                else:
                    plan = None
                self._masked[layer].append(plan)
        self._masked_slots = {id(r): slot for slot, r in enumerate(residents)}
        self._masked_residents = residents
        self._keep_budget = budget

    def _masks_serve(self, residents: list[HasLoraGroups]) -> bool:
        """Whether the kept masked rows hold every adapter of the step and at least half of
        them are the step's (the others' rows are multiplied by zeros): a batch whose
        requests finish keeps its rows until half its adapters are gone."""
        slots = self._masked_slots
        return 2 * len(residents) >= len(slots) and all(id(r) in slots for r in residents)

    def _step_masks(
        self,
        runs: list[tuple[int, int, HasLoraGroups]],
        residents: list[HasLoraGroups],
        num_tokens: int,
    ) -> StepMasks | None:
        """None when the kept masked rows do not serve this step."""
        if not self._masked_slots or not self._masks_serve(residents):
            return None
        token_slot = torch.full((num_tokens, 1), -1, dtype=torch.int64)
        for s, e, r in runs:
            token_slot[s:e] = self._masked_slots[id(r)]
        return StepMasks(token_slot, {})

    def _masked_step(
        self,
        layer: int,
        group: int,
        segments: list[Segment],
        num_tokens: int,
        masks: StepMasks | None,
    ) -> tuple[MaskedPlan, torch.Tensor] | None:
        """The kept rows and the step's mask for a group read in place, where one product
        costs less than the in-place ops (MASKED_FLOPS_PER_SAVED_OP); else None."""
        if masks is None or (plan := self._masked[layer][group]) is None:
            return None
        ops = sum(in_place_ops(w) for _, _, w in segments)
        if num_tokens * plan.flops_per_token > (ops - plan.ops) * MASKED_FLOPS_PER_SAVED_OP:
            return None
        mask = masks.by_layout.get(id(plan.row_slot))
        if mask is None:
            mask = (masks.token_slot == plan.row_slot).to(plan.a.dtype)
            masks.by_layout[id(plan.row_slot)] = mask
        return plan, mask

    def _reads_in_place(
        self,
        residents: list[HasLoraGroups],
        layer: int,
        group: int,
        shapes: list[list[list[GroupShape | None]]],
    ) -> bool:
        """Whether the reference's ops on the pool's views beat gathering (see
        GATHER_BYTES_PER_SAVED_OP)."""
        gathered = [b[layer][group] for b in shapes if b[layer][group] is not None]
        if not gathered:
            return False
        ops = sum(in_place_ops(w) for r in residents if (w := r.groups[layer][group]) is not None)
        gathered_ops = sum(4 + 2 * len(shape.present) for shape in gathered)
        gathered_bytes = self.arena.element_size() * sum(s.gathered_elems for s in gathered)
        saved = ops - gathered_ops
        return saved <= 0 or gathered_bytes > saved * GATHER_BYTES_PER_SAVED_OP

    def _group_shapes(
        self, tabs: list[AdapterTables], residents: list[HasLoraGroups]
    ) -> list[list[GroupShape | None]]:
        """[layer][group] of one bucket: what its gather plan would hold (None: no adapter of
        the bucket has the group there), from the ranks alone."""
        # [L][G][J]: the largest rank of each target over the bucket's slots
        top = torch.stack([t.t_rank for t in tabs]).amax(0).tolist()
        slots = len(tabs)
        shapes: list[list[GroupShape | None]] = []
        for layer, per_layer in enumerate(top):
            shapes.append([])
            for g, (columns, ranks) in enumerate(
                zip(self.layout.group_columns, per_layer, strict=True)
            ):
                present = tuple(j for j in range(len(columns)) if ranks[j] > 0)
                if not present:
                    shapes[layer].append(None)
                    continue
                in_width = next(
                    r.groups[layer][g].a[0].shape[1]
                    for r in residents
                    if r.groups[layer][g] is not None
                )
                shapes[layer].append(
                    GroupShape(
                        in_width,
                        max(ranks),
                        present,
                        tuple(columns[j] for j in present),
                        slots,
                    )
                )
        return shapes

    def _group_plans(
        self,
        tabs: list[AdapterTables],
        shapes: list[list[GroupShape | None]],
        in_place: list[list[bool]],
    ) -> list[list[GroupPlan | None]]:
        """The bucket's gather plans, built for the layers and groups that gather (None for
        the others: absent from the bucket, or read in place, `in_place[layer][group]`)."""
        built = [
            (layer, g, shape)
            for layer, per_layer in enumerate(shapes)
            for g, shape in enumerate(per_layer)
            if shape is not None and not in_place[layer][g]
        ]
        plans: list[list[GroupPlan | None]] = [[None] * len(p) for p in shapes]
        if not built:
            return plans
        t_rank = torch.stack([t.t_rank for t in tabs]).long()  # [S, L, G, J]
        t_hoff = torch.stack([t.t_hoff for t in tabs]).long()
        a_rows = torch.stack([t.a_rows for t in tabs])  # [S, L, G, J * r_cap]
        b_rows = torch.stack([t.b_rows for t in tabs])  # [S, L, G, J, r_cap]
        num_slots = len(tabs)
        for layer, g, shape in built:
            present, rank = list(shape.present), shape.rank
            k = torch.arange(rank)
            valid = k < t_rank[:, layer, g, present, None]  # [S, J', r]
            pos = (t_hoff[:, layer, g, present, None] + k).clamp(max=a_rows.shape[-1] - 1)
            a_off = a_rows[:, layer, g].gather(1, pos.view(num_slots, -1)).view(valid.shape)
            a_idx = torch.where(valid, a_off, a_off[valid][0]).view(-1)
            b_idx = []
            for i, j in enumerate(present):
                b_off = b_rows[:, layer, g, j, :rank]
                b_idx.append(torch.where(valid[:, i], b_off, b_off[valid[:, i]][0]).view(-1))
            mask = None
            if not bool(valid.all()):
                mask = valid.view(num_slots, 1, -1).to(self.arena.dtype)
            plans[layer][g] = GroupPlan(shape.in_width, rank, a_idx, tuple(b_idx), shape.cols, mask)
        return plans
