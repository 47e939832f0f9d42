"""Kernel backend selection: Triton on CUDA; on a CPU the compiled loops (native.py) where
they build (`native`: LoRA of decode steps, lora_native; decode attention,
attention_native), torch ops (lora_gathered, decode_attention) for the rest and elsewhere;
each tested against the torch references in lora.py and attention.py.

`kernels="auto"` picks by device; `LORAPLEX_KERNELS=torch|native|triton` (read once, when
an engine starts) or an explicit `kernels=` in the engine config overrides it. On CPU the
Triton kernels run only under the interpreter (`TRITON_INTERPRET=1`, set before triton is
first imported), which is how they are tested here.

A backend offers the LoRA ops in three calls — `prepare` once per step, then `shrink`
and `expand` per layer and group (split so tensor parallelism can reduce the rank-sized
shrink output between them) — and a decode attention (None: the reference path).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

import torch

from loraplex.kernels import attention_native, lora_native, native
from loraplex.kernels.lora_gathered import (
    GatheredArgs,
    GatheredPlanner,
    gathered_expand,
    gathered_shrink,
)
from loraplex.kernels.lora_tables import (
    HasLoraGroups,
    LoraArgs,
    LoraLayout,
    LoraStepMeta,
    LoraTableBuilder,
    slotted,
)
from loraplex.kernels.triton_check import (
    check,
    check_expand_tables,
    check_segments,
    check_shrink_tables,
    check_token_slot,
)

KernelChoice = Literal["auto", "torch", "native", "triton"]
KERNEL_CHOICES = ("auto", "torch", "native", "triton")
ENV_VAR = "LORAPLEX_KERNELS"

Run = tuple[int, int, HasLoraGroups]  # tokens [start, end) share this adapter


class KernelBackend(Protocol):
    name: str
    decode_attention: Callable[..., torch.Tensor] | None
    cpu_loops: ctypes.CDLL | None  # the compiled loops (native.py) the step's small ops use

    def prepare(self, runs: list[Run], num_tokens: int, decode: bool) -> list[list[Any]]:
        """Per-step LoRA metadata, indexed [layer][group]."""

    def shrink(self, x: torch.Tensor, args: Any) -> list[torch.Tensor]:
        """The rank-sized intermediates (one per segment, or one for the whole batch)."""

    def expand(self, y: torch.Tensor, hs: list[torch.Tensor], args: Any) -> None: ...


class TorchBackend:
    """Torch ops: the step's adapters gathered from the pool, then batched matmuls
    (lora_gathered; a fixed number of ops per layer and group)."""

    name = "torch"
    decode_attention: Callable[..., torch.Tensor] | None = None
    cpu_loops: ctypes.CDLL | None = None

    def __init__(self, layout: LoraLayout, arena: torch.Tensor):
        self.planner = GatheredPlanner(arena, layout)

    def prepare(self, runs: list[Run], num_tokens: int, decode: bool) -> list[list[Any]]:
        return self.planner.prepare(runs, num_tokens)

    def shrink(self, x: torch.Tensor, args: GatheredArgs | None) -> list[torch.Tensor]:
        return [] if args is None else gathered_shrink(x, args)

    def expand(self, y: torch.Tensor, hs: list[torch.Tensor], args: GatheredArgs | None) -> None:
        if args is not None:
            gathered_expand(y, hs, args)


class NativeBackend(TorchBackend):
    """The compiled CPU loops (native.py): decode attention (attention_native), the step's
    small ops (`cpu_loops`, used by the model's ForwardOps) and LoRA (lora_native) for
    steps whose segments are short (decode and small prefills) on a float32 pool; the torch
    ops for the others. Every group of such a
    step runs in the loops, those the torch ops would gather too: on SmolLM2's light decode
    step (8 adapters of rank 16 on q/k/v/o, 4 tokens each, whose rows the torch ops gather
    and keep) a step took 92.8-94.2 ms in the loops against 92.1-93.1 with those groups
    left to the torch ops, and the serving round lost a third of its gain with them left
    (1.28-1.32 s against 1.24-1.27; the torch ops alone 1.32-1.35)."""

    name = "native"

    def __init__(self, layout: LoraLayout, arena: torch.Tensor):
        super().__init__(layout, arena)
        lib = native.library()
        if lib is None:
            raise ValueError(f"kernels: native is unavailable here: {native.unavailable()}")
        self.lib = lib
        self.decode_attention = attention_native.DecodeAttention(lib)
        self.cpu_loops = lib
        self.arena = arena
        self.tables = LoraTableBuilder(arena, layout)
        self.num_layers = layout.num_layers
        self.num_groups = len(layout.group_columns)
        self.native = (
            arena.device.type == "cpu" and arena.dtype == torch.float32 and arena.is_contiguous()
        )
        # the last step's set of adapters (ids in slot order; `_residents` keeps them
        # alive), its stacked tables and arguments: decode steps of a running batch repeat
        # the set, and then only the segments change (building them was ~1 ms a step of
        # SmolLM2's 30 layers)
        self._key: tuple[int, ...] = ()
        self._residents: list[HasLoraGroups] = []
        self._args: list[list[Any]] = []
        self._step: lora_native.NativeStep | None = None

    def prepare(self, runs: list[Run], num_tokens: int, decode: bool) -> list[list[Any]]:
        longest = max((e - s for s, e, _ in runs), default=0)
        if not self.native or not runs or longest > lora_native.MAX_SEGMENT_TOKENS:
            return super().prepare(runs, num_tokens, decode)
        segments, residents = slotted(runs)  # the slots the tables are stacked in
        key = tuple(id(r) for r in residents)
        if key == self._key and self._step is not None:
            lora_native.set_segments(self._step, segments)
            return self._args
        step = lora_native.native_step(self.tables.build(runs, num_tokens, decode), self.arena)
        self._key, self._step, self._residents = key, step, residents
        self._args = [
            [
                lora_native.NativeArgs(step, layer, g) if width else None
                for g, width in enumerate(widths)
            ]
            for layer, widths in enumerate(step.widths)
        ]
        return self._args

    def shrink(self, x: torch.Tensor, args: Any) -> list[torch.Tensor]:
        if isinstance(args, lora_native.NativeArgs):
            return [lora_native.shrink(self.lib, x, args)]
        return super().shrink(x, args)

    def expand(self, y: torch.Tensor, hs: list[torch.Tensor], args: Any) -> None:
        if isinstance(args, lora_native.NativeArgs):
            (h,) = hs
            lora_native.expand(self.lib, y, h, args)
            return
        super().expand(y, hs, args)


class TritonBackend:
    """Punica-style kernels reading adapters in place through row tables (lora_tables)."""

    name = "triton"
    cpu_loops = None

    def __init__(self, layout: LoraLayout, arena: torch.Tensor):
        from loraplex.kernels import (
            triton_bgmv_expand,
            triton_bgmv_shrink,
            triton_paged_attention,
            triton_sgmv_expand,
            triton_sgmv_shrink,
        )

        self._k = (triton_bgmv_shrink, triton_bgmv_expand, triton_sgmv_shrink, triton_sgmv_expand)
        self.decode_attention = triton_paged_attention.paged_attention_decode
        check(arena.is_contiguous(), "the arena must be contiguous")
        self.arena = arena
        self.tables = LoraTableBuilder(arena, layout)
        self.scales = torch.ones(layout.max_loras, dtype=torch.float32, device=arena.device)
        self.max_width = max(e - s for cols in layout.group_columns for s, e in cols)
        self.num_layers = layout.num_layers
        self.num_groups = len(layout.group_columns)

    def prepare(self, runs: list[Run], num_tokens: int, decode: bool) -> list[list[Any]]:
        meta = self.tables.build(runs, num_tokens, decode)
        self._check_step(meta)
        return [
            [LoraArgs(meta, layer, g) for g in range(self.num_groups)]
            for layer in range(self.num_layers)
        ]

    def _check_step(self, meta: LoraStepMeta) -> None:
        """The launchers' checks of the step's tables, once per step and group: every layer
        reads views of the same stacked tables, and x, y and h come from the model's fixed
        shapes. Checked per launch they cost ~6 ms of a 38 ms decode step of a 1.1B model
        on an H100 (14 tensor checks x 2 launches x 4 groups x 16 layers)."""
        t, dev = meta.tables, self.arena.device
        if meta.decode:
            check_token_slot(meta.token_slot, meta.num_tokens, dev)
        else:
            check_segments(meta.seg_start, meta.seg_len, meta.seg_slot, dev)
        h = torch.empty(0, max(meta.max_r, 1), dtype=torch.float32, device=dev)
        scales = self.scales[: t.t_rank.shape[0]]
        for g in range(self.num_groups):
            check_shrink_tables(t.ranks[:, 0, g], t.a_rows[:, 0, g], meta.max_r, h)
            check_expand_tables(
                t.t_rank[:, 0, g], t.t_hoff[:, 0, g], t.b_rows[:, 0, g], meta.cols[g], scales, dev
            )

    def shrink(self, x: torch.Tensor, args: LoraArgs) -> list[torch.Tensor]:
        m, t = args.meta, args.meta.tables
        ranks, a_rows = t.ranks[:, args.layer, args.group], t.a_rows[:, args.layer, args.group]
        h = torch.empty(x.shape[0], max(m.max_r, 1), dtype=torch.float32, device=x.device)
        bgmv_shrink, _, sgmv_shrink, _ = self._k
        if m.decode:
            bgmv_shrink.bgmv_shrink(
                h, x, self.arena, m.token_slot, ranks, a_rows, m.max_r, validate=False
            )
        else:
            sgmv_shrink.sgmv_shrink(
                h, x, self.arena, m.seg_start, m.seg_len, m.seg_slot, ranks, a_rows,
                m.max_seg_len, m.max_r, validate=False,
            )  # fmt: skip
        return [h]

    def expand(self, y: torch.Tensor, hs: list[torch.Tensor], args: LoraArgs) -> None:
        (h,) = hs
        m, t, lg = args.meta, args.meta.tables, (args.layer, args.group)
        t_rank, t_hoff = t.t_rank[:, lg[0], lg[1]], t.t_hoff[:, lg[0], lg[1]]
        b_rows, cols = t.b_rows[:, lg[0], lg[1]], m.cols[args.group]
        scales = self.scales[: t_rank.shape[0]]
        _, bgmv_expand, _, sgmv_expand = self._k
        if m.decode:
            bgmv_expand.bgmv_expand(
                y, h, self.arena, m.token_slot, t_rank, t_hoff, b_rows, cols, scales,
                self.max_width, validate=False,
            )  # fmt: skip
        else:
            sgmv_expand.sgmv_expand(
                y, h, self.arena, m.seg_start, m.seg_len, m.seg_slot, t_rank, t_hoff, b_rows,
                cols, scales, m.max_seg_len, self.max_width, validate=False,
            )  # fmt: skip


def resolve_kernels(
    requested: str, device: torch.device, environ: Mapping[str, str] = os.environ
) -> Literal["torch", "native", "triton"]:
    """The backend to use: an explicit request wins, then $LORAPLEX_KERNELS, then the device
    (on a CPU, native where its library builds and loads, else torch)."""
    choice = requested
    if choice == "auto":
        choice = environ.get(ENV_VAR, "auto") or "auto"
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {choice!r}")
    if choice == "auto":
        if device.type == "cuda":
            return "triton"
        return "native" if device.type == "cpu" and native.library() else "torch"
    return choice


def make_backend(choice: str, layout: LoraLayout, arena: torch.Tensor) -> KernelBackend:
    if choice == "triton":
        return TritonBackend(layout, arena)
    if choice == "native":
        return NativeBackend(layout, arena)
    return TorchBackend(layout, arena)
