"""The model's shape, read from a Hugging Face `config.json` (Llama 2/3, Mistral)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.registry.validation import BaseModelShape
from loraplex.replica.config import DEFAULT_MAX_POSITIONS

SUPPORTED_MODEL_TYPES = ("llama", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelConfigError(ValueError):
    """The checkpoint's config.json describes a model this engine cannot run."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
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
    dtype: torch.dtype

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(
                f"rope type {rope_type!r} unsupported; supported: {SUPPORTED_ROPE_TYPES}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def shape(self) -> BaseModelShape:
        """The dimensions adapters are validated against (the registry's view of a model)."""
        return BaseModelShape(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each LoRA-targetable projection."""
        return {name: (i, o) for name, (o, i) in self.shape.projection_shapes().items()}

    def kv_elems_per_token(self) -> int:
        """Elements of K and V one token occupies across all layers."""
        return self.num_layers * 2 * self.kv_size

    @classmethod
    def from_dict(cls, raw: dict, dtype: torch.dtype | None = None) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type {model_type!r} unsupported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if raw.get(flag):
                raise ModelConfigError(
                    f"{flag}=true is not supported (Llama/Mistral have no biases)"
                )
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(
                f"hidden_act {raw['hidden_act']!r} unsupported; only 'silu' (SwiGLU)"
            )
        heads = raw["num_attention_heads"]
        # transformers 5 moved rope settings into `rope_parameters`; 4.x used rope_theta + rope_scaling.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if dtype is None:
            name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
            if name not in DTYPES:
                raise ModelConfigError(f"dtype {name!r} unsupported; supported: {tuple(DTYPES)}")
            dtype = DTYPES[name]
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
            dtype=dtype,
        )

    @classmethod
    def from_pretrained(cls, model_dir: Path, dtype: torch.dtype | None = None) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(
                f"{model_dir} has no config.json; expected a Hugging Face checkpoint folder"
            )
        return cls.from_dict(json.loads(path.read_text()), dtype)
