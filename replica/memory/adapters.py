"""PEFT LoRA adapters: read and validate a folder against the base model, and lay an
adapter out in the unified pool as views the LoRA kernels read in place."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from loraplex.adapter_format import (
    CONFIG_FILE,
    TENSOR_NAME,
    WEIGHTS_FILE,
    contents_digest,
    validate_adapter_dir,
)
from loraplex.errors import AdapterRejected
from loraplex.kernels.lora import LoraGroupWeights, LoraOut
from loraplex.replica.memory.pool import PageKind, RowPacker, UnifiedPool, chunk_views
from loraplex.replica.model.config import ModelConfig
from loraplex.replica.model.lora_groups import LORA_GROUPS

MAX_ADAPTER_BYTES = 64 << 30  # the engine's own bound; the registry API sets tighter limits


class AdapterError(ValueError):
    """The adapter is malformed or does not fit the base model; the message says why."""


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """An adapter on the host: per (layer, target) A [r, in] and Bt = scale * B.T [r, out].
    `version` identifies the weights (a content digest, as the registry's artifacts have):
    cached KV blocks computed with them are keyed by it."""

    name: str
    rank: int  # the largest rank among its modules
    targets: tuple[str, ...]
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    version: str | None = None
    # plan_layout's results, keyed by what they depend on (the page size, the layers, the
    # shapes): the copies `replace` makes (version set, pinned, meta skeleton) share the
    # dict, so an adapter's load plans its layout once
    layouts: dict[tuple, tuple[RowPacker, list]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + bt.nbytes for a, bt in self.modules.values())

    def pin_memory(self) -> AdapterWeights:
        """Page-locked host copies, so device copies can run asynchronously (CUDA)."""
        modules = {k: (a.pin_memory(), bt.pin_memory()) for k, (a, bt) in self.modules.items()}
        return replace(self, modules=modules)


def is_adapter_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file()


def load_adapter(path: Path, name: str, model: ModelConfig, max_rank: int) -> AdapterWeights:
    """Validate a PEFT adapter folder (the registry's checks: safetensors header, config,
    names and shapes against the base model, finite values; never pickle), then read it.
    Its version is the digest of the files as read (registry/artifacts.py's framing)."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"adapter path {path} is not a folder")
    try:
        summary = validate_adapter_dir(path, model.shape, max_rank, MAX_ADAPTER_BYTES)
    except AdapterRejected as e:
        raise AdapterError(f"adapter {name!r}: {e.message}") from None
    scale = summary.alpha / (math.sqrt(summary.rank) if summary.use_rslora else summary.rank)
    contents = {f: (path / f).read_bytes() for f in (CONFIG_FILE, WEIGHTS_FILE)}
    tensors = load_safetensors(contents[WEIGHTS_FILE])
    modules = {}
    for key, a in tensors.items():
        m = TENSOR_NAME.match(key)
        if m[4] != "A":
            continue
        b = tensors[key.removesuffix("lora_A.weight") + "lora_B.weight"]
        bt = (b.float().T * scale).to(model.dtype).contiguous()
        modules[(int(m[1]), m[2] or m[3])] = (a.to(model.dtype).contiguous(), bt)
    modules = dict(sorted(modules.items()))
    return AdapterWeights(
        name, summary.rank, summary.target_modules, modules, contents_digest(contents)
    )


def tensors_digest(weights: AdapterWeights) -> str:
    """A content digest of weights that came without one (not read from files)."""
    h = hashlib.sha256()
    for (layer, target), pair in weights.modules.items():
        h.update(f"{layer}:{target}".encode())
        for t in pair:
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def plan_layout(
    weights: AdapterWeights, page_elems: int, num_layers: int
) -> tuple[RowPacker, list]:
    """Row layout of an adapter in pages: per layer and LoRA group, the group's A matrices
    stacked in one placement, then each target's Bt. Returns the packer and the plan
    [(layer, group, a_placement, [(target, bt_placement, rank)])]; computed once per
    adapter (`weights.layouts`), the packer and plan are not to be changed."""
    shapes = tuple((k, *a.shape, bt.shape[1]) for k, (a, bt) in weights.modules.items())
    key = (page_elems, num_layers, shapes)
    cached = weights.layouts.get(key)
    if cached is None:
        cached = weights.layouts[key] = _plan_layout(weights, page_elems, num_layers)
    return cached


def _plan_layout(
    weights: AdapterWeights, page_elems: int, num_layers: int
) -> tuple[RowPacker, list]:
    packer = RowPacker(page_elems)
    plan = []
    for layer in range(num_layers):
        for group, targets in LORA_GROUPS.items():
            present = [t for t in targets if (layer, t) in weights.modules]
            if not present:
                continue
            mods = [weights.modules[(layer, t)] for t in present]
            a_index = packer.add(sum(a.shape[0] for a, _ in mods), mods[0][0].shape[1])
            outs = [
                (t, packer.add(*bt.shape), bt.shape[0])
                for t, (_, bt) in zip(present, mods, strict=True)
            ]
            plan.append((layer, group, a_index, outs))
    return packer, plan


class ResidentAdapter:
    """An adapter placed in pool pages. `groups[layer][group]` are the kernel views.

    Built in two parts so the copy can run off the engine thread: the constructor takes
    the pages (allocates them from `pool`, or takes `pages` another allocator chose: the
    cache, or tensor-parallel rank 0 for a worker) and builds the views; `fill` copies the
    weights in (at once unless `fill=False`)."""

    def __init__(
        self,
        weights: AdapterWeights,
        pool: UnifiedPool,
        model: ModelConfig,
        columns,
        pages: list[int] | None = None,
        fill: bool = True,
    ):
        self.name = weights.name
        self.rank = weights.rank
        self.version = weights.version
        self.pins = 0  # running requests using it; its pages are pinned while > 0
        packer, self._plan = plan_layout(weights, pool.page_elems, model.num_layers)
        self.fragmentation = packer.fragmentation()
        if pages is None:
            pages = pool.allocate(packer.num_pages, PageKind.ADAPTER)
        assert len(pages) == packer.num_pages, "pages given do not match the adapter's layout"
        self.pages = pages
        self.nbytes = packer.num_pages * pool.page_bytes
        self.groups: list[list[LoraGroupWeights | None]] = [
            [None] * len(LORA_GROUPS) for _ in range(model.num_layers)
        ]
        self._a_views = {}
        self._bt_views = {}
        for layer, group, a_index, outs in self._plan:
            a_views = chunk_views(pool.arena, packer.placements[a_index], self.pages)
            self._a_views[layer, group] = a_views
            lora_outs, h = [], 0
            for target, bt_index, rows in outs:
                bt_views = chunk_views(pool.arena, packer.placements[bt_index], self.pages)
                self._bt_views[layer, target] = bt_views
                lora_outs.append(LoraOut(*columns(group)[target], h, h + rows, tuple(bt_views)))
                h += rows
            self.groups[layer][group] = LoraGroupWeights(tuple(a_views), tuple(lora_outs))
        if fill:
            self.fill(weights)

    def fill(self, weights: AdapterWeights) -> None:
        """Copy the host weights into the pool pages (the load proper)."""
        for layer, group, _, outs in self._plan:
            a_rows = torch.cat([weights.modules[(layer, t)][0] for t, _, _ in outs])
            _copy_rows(self._a_views[layer, group], a_rows)
            for target, _, _ in outs:
                _copy_rows(self._bt_views[layer, target], weights.modules[(layer, target)][1])


class PoolLayout:
    """How the adapter cache places real adapters in the unified pool."""

    def __init__(self, pool: UnifiedPool, model: ModelConfig, columns):
        self.pool, self.model, self.columns = pool, model, columns

    def num_pages(self, weights: AdapterWeights) -> int:
        return plan_layout(weights, self.pool.page_elems, self.model.num_layers)[0].num_pages

    def skeleton(self, weights: AdapterWeights) -> AdapterWeights:
        """The same adapter with meta tensors: shapes for `place`, no memory."""
        modules = {k: (a.to("meta"), bt.to("meta")) for k, (a, bt) in weights.modules.items()}
        return replace(weights, modules=modules)

    def place(self, weights: AdapterWeights, pages: list[int]) -> ResidentAdapter:
        return ResidentAdapter(weights, self.pool, self.model, self.columns, pages, fill=False)

    def fill(self, resident: ResidentAdapter, weights: AdapterWeights) -> None:
        resident.fill(weights)


def _copy_rows(views: list[torch.Tensor], rows: torch.Tensor) -> None:
    start = 0
    for view in views:
        view.copy_(rows[start : start + view.shape[0]])
        start += view.shape[0]
