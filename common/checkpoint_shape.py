"""What a checkpoint's shape is (`ModelShape`), how a Hugging Face `config.json` spells it,
and the error for a checkpoint this project cannot read. Torch-free; `model_shape.
read_model_shape` is the reader, `gguf_checkpoint` builds the shape of a GGUF file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple

SUPPORTED_MODEL_TYPES = ("llama", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
GGUF_SUFFIX = ".gguf"
# What a checkpoint whose config.json names no max_position_embeddings is taken to hold.
DEFAULT_MAX_POSITIONS = 4096


class CheckpointError(ValueError):
    """A checkpoint this project cannot read or run; the message names the file and what
    is wrong and what is accepted."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Everything the engine needs to know about a model besides its weights."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str  # the checkpoint's own: one of DTYPE_NAMES

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise CheckpointError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise CheckpointError(
                f"rope type {rope_type!r} unsupported; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if self.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"dtype {self.dtype!r} unsupported; supported: {DTYPE_NAMES}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_elems_per_token(self) -> int:
        """Elements of K and V one token occupies across all layers."""
        return self.num_layers * 2 * self.kv_size

    def projection_shapes(self) -> dict[str, Projection]:
        """Each LoRA-targetable projection of one layer."""
        return projection_shapes(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )

    @classmethod
    def from_config_dict(cls, raw: dict[str, Any]) -> ModelShape:
        """From a parsed Hugging Face `config.json` (transformers 4 or 5 spelling)."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"model_type {model_type!r} unsupported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if raw.get(flag):
                raise CheckpointError(
                    f"{flag}=true is not supported (Llama/Mistral have no biases)"
                )
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(
                f"hidden_act {raw['hidden_act']!r} unsupported; only 'silu' (SwiGLU)"
            )
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if k not in raw
        ]
        if missing:
            raise CheckpointError(f"config.json lacks {', '.join(missing)}")
        heads = raw["num_attention_heads"]
        # transformers 5 moved rope settings into `rope_parameters`; 4.x used rope_theta + rope_scaling.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            max_position_embeddings=raw.get("max_position_embeddings", DEFAULT_MAX_POSITIONS),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=raw.get("sliding_window"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=raw.get("dtype") or raw.get("torch_dtype") or "float32",
        )


def is_gguf(path: str | os.PathLike[str]) -> bool:
    return str(path).endswith(GGUF_SUFFIX)


class Projection(NamedTuple):
    """A linear layer's weight is [out_features, in_features] (torch's `nn.Linear` order);
    LoRA's A is [rank, in_features] and B is [out_features, rank]."""

    out_features: int
    in_features: int


def projection_shapes(
    *, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> dict[str, Projection]:
    """Each LoRA-targetable projection of one layer of a Llama-family model."""
    h, i = hidden_size, intermediate_size
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return {
        "q_proj": Projection(q, h),
        "k_proj": Projection(kv, h),
        "v_proj": Projection(kv, h),
        "o_proj": Projection(h, q),
        "gate_proj": Projection(i, h),
        "up_proj": Projection(i, h),
        "down_proj": Projection(h, i),
    }
