"""Reads a Llama checkpoint — a Hugging Face folder (single or sharded safetensors) or a GGUF
file (dequantized at load) — into the engine's fused layout: q/k/v stacked into one
[q+2kv, hidden] weight, gate/up into one [2i, hidden]."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.checkpoint_shape import CheckpointError, is_gguf
from loraplex.replica.model.config import ModelConfig


def checkpoint_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    if any(model_dir.glob("*.bin")):
        raise CheckpointError(
            f"{model_dir} holds only .bin (pickle) weights; convert them to safetensors"
        )
    raise CheckpointError(f"{model_dir} has no model.safetensors or model.safetensors.index.json")


# rows and columns of a 2-D checkpoint tensor to read (a tensor-parallel rank's share)
Part = Callable[[str], tuple[slice, slice]]


def load_weights(
    model_dir: Path, cfg: ModelConfig, device: torch.device, part: Part | None = None
) -> dict[str, torch.Tensor]:
    """The model's weights in the fused layout. With `part`, only part(name) of each 2-D
    tensor is read from disk (safetensors slices; GGUF rows, and columns on quantization
    block bounds) and dequantized — the rest never enters memory."""
    if is_gguf(model_dir):
        from loraplex.gguf_checkpoint import open_gguf

        checkpoint = open_gguf(model_dir)
        tensors = {name: _GGUFSlice(checkpoint, name) for name in checkpoint.names()}
        return _assemble(model_dir, cfg, device, part, tensors)
    with ExitStack() as files:
        tensors = {}  # name without "model." -> the file's slice reader
        for path in checkpoint_files(model_dir):
            f = files.enter_context(safe_open(str(path), framework="pt"))
            tensors.update({name.removeprefix("model."): f.get_slice(name) for name in f.keys()})
        return _assemble(model_dir, cfg, device, part, tensors)


class _GGUFSlice:
    """A GGUF tensor behind safetensors' slice interface (`get_shape`, `[rows, cols]`)."""

    def __init__(self, checkpoint, name: str):
        self.checkpoint, self.name = checkpoint, name

    def get_shape(self) -> list[int]:
        return list(self.checkpoint.tensor_shape(self.name))

    def __getitem__(self, index) -> torch.Tensor:
        rows, cols = index if isinstance(index, tuple) else (index, None)
        return torch.from_numpy(self.checkpoint.read(self.name, rows, cols))


def _assemble(model_dir, cfg: ModelConfig, device, part: Part | None, tensors: dict):
    expected = _expected_shapes(cfg)
    missing = [
        n
        for n in expected
        if n not in tensors and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    ]
    if missing:
        raise CheckpointError(
            f"checkpoint {model_dir} lacks tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    for name, shape in expected.items():
        found = tuple(tensors[name].get_shape()) if name in tensors else shape
        if found != shape:
            raise CheckpointError(f"tensor {name}: expected shape {shape}, found {found}")

    def take(name: str, part_of: str | None = None) -> torch.Tensor:
        s = tensors[name]
        if len(s.get_shape()) == 1 or part is None:
            t = s[:]
        else:
            rows, cols = part(part_of or name)
            t = s[rows, cols]
        return t.to(device=device, dtype=cfg.dtype).contiguous()

    weights = {"embed": take("embed_tokens.weight"), "norm": take("norm.weight")}
    if cfg.tie_word_embeddings:
        weights["lm_head"] = (
            weights["embed"] if part is None else take("embed_tokens.weight", "lm_head.weight")
        )
    else:
        weights["lm_head"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        weights[p + "input_norm"] = take(p + "input_layernorm.weight")
        weights[p + "post_norm"] = take(p + "post_attention_layernorm.weight")
        weights[p + "qkv"] = torch.cat(
            [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
        ).contiguous()
        weights[p + "o"] = take(p + "self_attn.o_proj.weight")
        weights[p + "gate_up"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
        ).contiguous()
        weights[p + "down"] = take(p + "mlp.down_proj.weight")
    return weights


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (cfg.vocab_size, h),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.vocab_size, h),
    }
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, projection in cfg.projection_shapes().items():
            group = "self_attn" if name[0] in "qkvo" else "mlp"
            shapes[f"{p}{group}.{name}.weight"] = tuple(projection)
    return shapes
