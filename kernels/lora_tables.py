"""Per-step metadata of the Triton LoRA kernels: where every adapter row lives in the pool.

The torch reference reads an adapter through views of the pool's pages. The Triton kernels
read the same memory through row tables: the element offset, in the flat arena, of every
row of A_cat and of every target's Bt. Tables are built once per resident adapter (when it
is first used) and stacked once per step into buffers allocated at their maximum size;
layers only take views of them.

Shapes (L layers, G LoRA groups, J = max targets per group, S adapters in the step):

    ranks   [S, L, G]          int32  R = rows of A_cat (0: the adapter skips the group)
    a_rows  [S, L, G, R_cap]   int64  arena offset of A_cat row r (r < R)
    t_rank  [S, L, G, J]       int32  r_t = rows of target j's Bt (0: target absent)
    t_hoff  [S, L, G, J]       int32  first row of target j in h (and in A_cat)
    b_rows  [S, L, G, J, r_cap] int64 arena offset of Bt_j row r (r < r_t)
    cols    [G, J + 1]         int32  target j writes y[:, cols[g, j]:cols[g, j + 1]]
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from loraplex.kernels.lora import LoraGroupWeights


class HasLoraGroups(Protocol):
    """A resident adapter: `groups[layer][group]` are views of its weights in the arena."""

    groups: list[list[LoraGroupWeights | None]]


@dataclass(frozen=True, slots=True)
class LoraLayout:
    """What the tables are sized by; fixed for an engine's life."""

    num_layers: int
    group_columns: tuple[tuple[tuple[int, int], ...], ...]  # [g][j] -> (col_start, col_end)
    max_rank: int
    max_loras: int
    max_tokens: int

    @property
    def max_targets(self) -> int:
        return max(len(cols) for cols in self.group_columns)


def slotted(
    runs: list[tuple[int, int, HasLoraGroups]],
) -> tuple[list[tuple[int, int, int]], list[HasLoraGroups]]:
    """Each run as (start, end, slot), and the step's adapters in slot order: one slot per
    distinct adapter (by identity), in order of first appearance, the order its tables
    are stacked in."""
    slots: dict[int, int] = {}
    residents: list[HasLoraGroups] = []
    out = []
    for s, e, r in runs:
        slot = slots.setdefault(id(r), len(residents))
        if slot == len(residents):
            residents.append(r)
        out.append((s, e, slot))
    return out, residents


@dataclass(frozen=True, slots=True)
class AdapterTables:
    ranks: torch.Tensor  # [L, G]
    a_rows: torch.Tensor  # [L, G, R_cap]
    t_rank: torch.Tensor  # [L, G, J]
    t_hoff: torch.Tensor  # [L, G, J]
    b_rows: torch.Tensor  # [L, G, J, r_cap]


def _row_offsets(arena: torch.Tensor, chunks: tuple[torch.Tensor, ...]) -> torch.Tensor:
    base, elem = arena.data_ptr(), arena.element_size()
    parts = []
    for c in chunks:
        assert c.is_contiguous(), "pool views are whole rows of one page"
        first = (c.data_ptr() - base) // elem
        parts.append(first + torch.arange(c.shape[0], dtype=torch.int64) * c.shape[1])
    return torch.cat(parts)


def adapter_tables(
    groups: list[list[LoraGroupWeights | None]], arena: torch.Tensor, layout: LoraLayout
) -> AdapterTables:
    num_groups, j_max, r_cap = len(layout.group_columns), layout.max_targets, layout.max_rank
    ranks = torch.zeros(layout.num_layers, num_groups, dtype=torch.int32)
    a_rows = torch.zeros(layout.num_layers, num_groups, j_max * r_cap, dtype=torch.int64)
    t_rank = torch.zeros(layout.num_layers, num_groups, j_max, dtype=torch.int32)
    t_hoff = torch.zeros(layout.num_layers, num_groups, j_max, dtype=torch.int32)
    b_rows = torch.zeros(layout.num_layers, num_groups, j_max, r_cap, dtype=torch.int64)
    for layer, per_group in enumerate(groups):
        for g, w in enumerate(per_group):
            if w is None:
                continue
            ranks[layer, g] = w.rank
            a_rows[layer, g, : w.rank] = _row_offsets(arena, w.a)
            starts = [c[0] for c in layout.group_columns[g]]
            for out in w.outs:
                j = starts.index(out.col_start)
                r = out.h_end - out.h_start
                assert r <= r_cap, f"target rank {r} exceeds max_rank {r_cap}"
                t_rank[layer, g, j], t_hoff[layer, g, j] = r, out.h_start
                b_rows[layer, g, j, :r] = _row_offsets(arena, out.bt)
    return AdapterTables(ranks, a_rows, t_rank, t_hoff, b_rows)


@dataclass(frozen=True, slots=True)
class LoraStepMeta:
    """One step's metadata: segments of tokens sharing an adapter, the token -> adapter map
    and the stacked tables (views of max-size buffers)."""

    decode: bool  # one token per request: the BGMV kernels; else SGMV
    num_tokens: int
    seg_start: torch.Tensor  # [num_segs] int32, only segments with an adapter
    seg_len: torch.Tensor  # [num_segs] int32
    seg_slot: torch.Tensor  # [num_segs] int32
    max_seg_len: int
    token_slot: torch.Tensor  # [T] int32, -1: no adapter
    tables: AdapterTables  # each with a leading [S] dim
    cols: torch.Tensor  # [G, J + 1] int32
    max_r: int  # largest R (rows of h) over the step's adapters and groups


@dataclass(frozen=True, slots=True)
class LoraArgs:
    """The view of a step's metadata one layer and group reads."""

    meta: LoraStepMeta
    layer: int
    group: int


class LoraTableBuilder:
    """Builds `LoraStepMeta` once per step; caches each resident adapter's tables."""

    def __init__(self, arena: torch.Tensor, layout: LoraLayout):
        self.arena = arena
        self.layout = layout
        self._cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        device = arena.device
        n, layers, groups = layout.max_loras, layout.num_layers, len(layout.group_columns)
        j, r = layout.max_targets, layout.max_rank
        self._buf = AdapterTables(
            ranks=torch.zeros(n, layers, groups, dtype=torch.int32, device=device),
            a_rows=torch.zeros(n, layers, groups, j * r, dtype=torch.int64, device=device),
            t_rank=torch.zeros(n, layers, groups, j, dtype=torch.int32, device=device),
            t_hoff=torch.zeros(n, layers, groups, j, dtype=torch.int32, device=device),
            b_rows=torch.zeros(n, layers, groups, j, r, dtype=torch.int64, device=device),
        )
        self._token_slot = torch.full((layout.max_tokens,), -1, dtype=torch.int32, device=device)
        cols = torch.zeros(groups, j + 1, dtype=torch.int32)
        for g, targets in enumerate(layout.group_columns):
            edges = [targets[0][0]] + [end for _, end in targets]
            edges += [edges[-1]] * (j + 1 - len(edges))  # missing targets: empty ranges
            cols[g] = torch.tensor(edges, dtype=torch.int32)
        self._cols = cols.to(device)

    def tables(self, resident: HasLoraGroups) -> tuple[AdapterTables, int]:
        """The adapter's tables on the arena's device and its largest R (host int)."""
        cached = self._cache.get(resident)
        if cached is None:
            t = adapter_tables(resident.groups, self.arena, self.layout)
            max_r = int(t.ranks.max())
            t = AdapterTables(*(getattr(t, f).to(self.arena.device) for f in t.__slots__))
            cached = self._cache[resident] = (t, max_r)
        return cached

    def build(
        self, runs: list[tuple[int, int, HasLoraGroups]], num_tokens: int, decode: bool
    ) -> LoraStepMeta:
        """runs: (start, end, adapter) for each run of tokens sharing an adapter."""
        if num_tokens > self.layout.max_tokens:
            raise ValueError(f"{num_tokens} tokens exceed max_tokens {self.layout.max_tokens}")
        segments, residents = slotted(runs)
        seg_start = [s for s, _, _ in segments]
        seg_len = [e - s for s, e, _ in segments]
        seg_slot = [slot for _, _, slot in segments]
        if len(residents) > self.layout.max_loras:
            raise ValueError(f"{len(residents)} adapters exceed max_loras {self.layout.max_loras}")
        n = len(residents)
        per = [self.tables(r) for r in residents]
        for field in AdapterTables.__slots__:
            if per:
                torch.stack([getattr(t, field) for t, _ in per], out=getattr(self._buf, field)[:n])
        host_slots = torch.full((num_tokens,), -1, dtype=torch.int32)
        for s, length, slot in zip(seg_start, seg_len, seg_slot, strict=True):
            host_slots[s : s + length] = slot
        token_slot = self._token_slot[:num_tokens]
        token_slot.copy_(host_slots)
        device = self.arena.device
        max_r = max((r for _, r in per), default=0)
        return LoraStepMeta(
            decode=decode,
            num_tokens=num_tokens,
            seg_start=torch.tensor(seg_start, dtype=torch.int32, device=device),
            seg_len=torch.tensor(seg_len, dtype=torch.int32, device=device),
            seg_slot=torch.tensor(seg_slot, dtype=torch.int32, device=device),
            max_seg_len=max(seg_len, default=0),
            token_slot=token_slot,
            tables=AdapterTables(*(getattr(self._buf, f)[:n] for f in AdapterTables.__slots__)),
            cols=self._cols,
            max_r=max_r,
        )
