"""PEFT LoRA adapters: read and validate a folder against the base model, and lay an
adapter out in the unified pool as views the LoRA kernels read in place."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.kernels.lora import LoraGroupWeights, LoraOut
from loraplex.replica.model.config import ModelConfig
from loraplex.replica.model.llama import LORA_GROUPS
from loraplex.replica.pool import PageKind, RowPacker, UnifiedPool, chunk_views

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(0|[1-9]\d*)\."
    r"(?:self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))"
    r"\.lora_([AB])\.weight$"
)
_FLOAT_DTYPES = ("F32", "F16", "BF16")


class AdapterError(ValueError):
    """The adapter is malformed or does not fit the base model; the message says why."""


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """An adapter on the host: per (layer, target) A [r, in] and Bt = scale * B.T [r, out]."""

    name: str
    rank: int  # the largest rank among its modules
    targets: tuple[str, ...]
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + bt.nbytes for a, bt in self.modules.values())


def is_adapter_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file()


def read_adapter_config(path: Path) -> dict:
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise AdapterError(
            f"{path} has no {CONFIG_FILE}; expected a PEFT LoRA adapter folder"
        ) from None
    except json.JSONDecodeError as e:
        raise AdapterError(f"{path / CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path / CONFIG_FILE} must hold a JSON object")
    return cfg


def _check_config(cfg: dict, max_rank: int) -> tuple[int, float, bool]:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {cfg.get('peft_type')!r} unsupported; only 'LORA'")
    unsupported = {
        "use_dora": bool(cfg.get("use_dora")),
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")),
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
        "bias": cfg.get("bias", "none") != "none",
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise AdapterError(f"adapter_config.json sets unsupported options: {bad}")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"adapter_config.json 'r' must be a positive integer, found {r!r}")
    if r > max_rank:
        raise AdapterError(f"rank {r} exceeds the configured maximum {max_rank}")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"adapter_config.json 'lora_alpha' must be a number, found {alpha!r}")
    return r, float(alpha), bool(cfg.get("use_rslora", False))


def load_adapter(path: Path, name: str, model: ModelConfig, max_rank: int) -> AdapterWeights:
    """Read and validate a PEFT adapter folder. Reads safetensors only (never pickle)."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"adapter path {path} is not a folder")
    cfg = read_adapter_config(path)
    config_rank, alpha, rslora = _check_config(cfg, max_rank)
    declared = cfg.get("target_modules")
    declared = set(declared) if isinstance(declared, list) else None  # a regex string: not checked
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        hint = (
            " (.bin pickle files are refused; save with safetensors)"
            if (path / "adapter_model.bin").exists()
            else ""
        )
        raise AdapterError(f"{path} has no {WEIGHTS_FILE}{hint}")
    tensors = _read_tensors(weights_path)
    shapes = model.projection_shapes()
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"tensor {key!r} is not a LoRA weight of a Llama projection")
        layer, target, which = int(m[1]), m[2] or m[3], m[4]
        if declared is not None and target not in declared:
            raise AdapterError(
                f"tensor {key!r}: {target} is not in adapter_config.json target_modules {sorted(declared)}"
            )
        if layer >= model.num_layers:
            raise AdapterError(
                f"tensor {key!r}: layer {layer} but the base model has {model.num_layers}"
            )
        pairs.setdefault((layer, target), {})[which] = tensor
    if not pairs:
        raise AdapterError(f"{weights_path} holds no LoRA weights")

    modules = {}
    for (layer, target), ab in sorted(pairs.items()):
        prefix = f"layers.{layer}.{target}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{prefix}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[target]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or a.shape[1] != fan_in or not 1 <= r <= max_rank:
            raise AdapterError(
                f"{prefix}.lora_A: expected shape [r<={max_rank}, {fan_in}], found {list(a.shape)}"
            )
        if tuple(b.shape) != (fan_out, r):
            raise AdapterError(
                f"{prefix}.lora_B: expected shape [{fan_out}, {r}], found {list(b.shape)}"
            )
        if r != config_rank:
            raise AdapterError(
                f"{prefix}.lora_A: rank {r} but adapter_config.json says r = {config_rank}"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{prefix}: lora_A or lora_B holds NaN or infinite values")
        scale = alpha / (math.sqrt(r) if rslora else r)
        a = a.to(model.dtype).contiguous()
        bt = (b.float().T * scale).to(model.dtype).contiguous()
        modules[(layer, target)] = (a, bt)
    targets = tuple(t for t in TARGETS if any(k[1] == t for k in modules))
    rank = max(a.shape[0] for a, _ in modules.values())
    return AdapterWeights(name=name, rank=rank, targets=targets, modules=modules)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                dtype = f.get_slice(key).get_dtype()
                if dtype not in _FLOAT_DTYPES:
                    raise AdapterError(
                        f"tensor {key!r} has dtype {dtype}; expected one of {_FLOAT_DTYPES}"
                    )
            return {key: f.get_tensor(key) for key in f.keys()}
    except AdapterError:
        raise
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise AdapterError(f"{path} is not a valid safetensors file: {e}") from None


def plan_layout(
    weights: AdapterWeights, page_elems: int, num_layers: int
) -> tuple[RowPacker, list]:
    """Row layout of an adapter in pages: per layer and LoRA group, the group's A matrices
    stacked in one placement, then each target's Bt. Returns the packer and the plan
    [(layer, group, a_placement, [(target, bt_placement, rank)])]."""
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
    """An adapter placed in pool pages. `groups[layer][group]` are the kernel views."""

    def __init__(self, weights: AdapterWeights, pool: UnifiedPool, model: ModelConfig, columns):
        self.name = weights.name
        self.rank = weights.rank
        self.pins = 0  # running requests using it; its pages are pinned while > 0
        packer, plan = plan_layout(weights, pool.page_elems, model.num_layers)
        self.fragmentation = packer.fragmentation()
        self.pages = pool.allocate(packer.num_pages, PageKind.ADAPTER)
        self.nbytes = packer.num_pages * pool.page_bytes
        self.groups: list[list[LoraGroupWeights | None]] = [
            [None] * len(LORA_GROUPS) for _ in range(model.num_layers)
        ]
        for layer, group, a_index, outs in plan:
            a_views = chunk_views(pool.arena, packer.placements[a_index], self.pages)
            a_rows = torch.cat([weights.modules[(layer, t)][0] for t, _, _ in outs])
            _copy_rows(a_views, a_rows)
            lora_outs, h = [], 0
            for target, bt_index, rows in outs:
                bt_views = chunk_views(pool.arena, packer.placements[bt_index], self.pages)
                _copy_rows(bt_views, weights.modules[(layer, target)][1])
                lora_outs.append(LoraOut(*columns(group)[target], h, h + rows, tuple(bt_views)))
                h += rows
            self.groups[layer][group] = LoraGroupWeights(tuple(a_views), tuple(lora_outs))


def _copy_rows(views: list[torch.Tensor], rows: torch.Tensor) -> None:
    start = 0
    for view in views:
        view.copy_(rows[start : start + view.shape[0]])
        start += view.shape[0]
