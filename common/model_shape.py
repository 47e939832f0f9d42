"""The one reader of a checkpoint's shape: a Hugging Face folder (`config.json`) or a GGUF
file. Torch-free (the registry validates adapters with it and must not import torch); the
engine's `ModelConfig`, the registry's adapter validation and the cluster config all start
here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from loraplex.checkpoint_shape import GGUF_SUFFIX, CheckpointError, ModelShape, is_gguf
from loraplex.gguf_checkpoint import open_gguf


def read_model_shape(path: str | os.PathLike[str]) -> ModelShape:
    """The shape of the checkpoint at `path`: a Hugging Face folder (its config.json) or a
    `.gguf` file (its metadata). CheckpointError names what is missing or unsupported."""
    path = Path(path)
    if is_gguf(path):
        return open_gguf(path).shape
    config = path / "config.json"
    if not config.is_file():
        raise CheckpointError(
            f"{path} is neither a Hugging Face checkpoint folder (no config.json) nor a "
            f"{GGUF_SUFFIX} file"
        )
    try:
        raw = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{config}: not readable JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config}: expected a JSON object")
    try:
        return ModelShape.from_config_dict(raw)
    except CheckpointError as e:
        raise CheckpointError(f"{config}: {e}") from None
