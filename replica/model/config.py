"""The model's shape as the engine uses it: the checkpoint's shape (`loraplex.model_shape`,
one reader for Hugging Face folders and GGUF files) and the dtype it computes in."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch

from loraplex.checkpoint_shape import ModelShape
from loraplex.model_shape import read_model_shape
from loraplex.registry.validation import BaseModelShape

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
    def from_shape(cls, shape: ModelShape, dtype: torch.dtype | None = None) -> ModelConfig:
        """`dtype` None: the checkpoint's own."""
        values = {f.name: getattr(shape, f.name) for f in fields(ModelShape)}
        values["dtype"] = DTYPES[shape.dtype] if dtype is None else dtype
        return cls(**values)

    @classmethod
    def from_dict(cls, raw: dict, dtype: torch.dtype | None = None) -> ModelConfig:
        """From a parsed Hugging Face config.json."""
        return cls.from_shape(ModelShape.from_config_dict(raw), dtype)

    @classmethod
    def from_pretrained(cls, path: Path, dtype: torch.dtype | None = None) -> ModelConfig:
        """From a Hugging Face folder or a .gguf file."""
        return cls.from_shape(read_model_shape(path), dtype)
