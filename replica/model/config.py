"""The model as the engine runs it: the checkpoint's shape (`loraplex.checkpoint_shape.
ModelShape`, read by `loraplex.model_shape` from a Hugging Face folder or a GGUF file) and
the dtype it computes in. The shape's fields read through: `config.hidden_size` is
`config.shape.hidden_size`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from loraplex.checkpoint_shape import ModelShape
from loraplex.model_shape import read_model_shape

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_SHAPE_ATTRIBUTES = frozenset(
    [f.name for f in fields(ModelShape) if f.name != "dtype"]
    + ["q_size", "kv_size", "kv_elems_per_token", "projection_shapes"]
)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    shape: ModelShape
    dtype: torch.dtype  # what the engine computes in; the checkpoint's is `shape.dtype`

    def __getattr__(self, name: str) -> Any:
        # Called only for names the config itself lacks; the shape's, and nothing else.
        if name in _SHAPE_ATTRIBUTES:
            return getattr(self.shape, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def from_shape(cls, shape: ModelShape, dtype: torch.dtype | None = None) -> ModelConfig:
        """`dtype` None: the checkpoint's own."""
        return cls(shape, DTYPES[shape.dtype] if dtype is None else dtype)

    @classmethod
    def from_dict(cls, raw: dict, dtype: torch.dtype | None = None) -> ModelConfig:
        """From a parsed Hugging Face config.json."""
        return cls.from_shape(ModelShape.from_config_dict(raw), dtype)

    @classmethod
    def from_pretrained(cls, path: Path, dtype: torch.dtype | None = None) -> ModelConfig:
        """From a Hugging Face folder or a .gguf file."""
        return cls.from_shape(read_model_shape(path), dtype)
